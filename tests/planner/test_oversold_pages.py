"""The planner sees an oversold model and its customers on the fleet and customer pages."""

import pytest

from capacity.catalog.services import deployment_update
from capacity.selling.reservations import reservation_create

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]


def test_an_oversold_model_and_its_customers_are_shown(planner_client, acme, globex, sellable,
                                                       served_model, pool):  # fmt: skip
    acme_sale = reservation_create(customer=acme, served_model=served_model, mu_per_minute=300)
    page = planner_client.get("/planner/").content.decode()
    assert 'data-testid="oversold-llama-8b"' not in page
    deployment_update(deployment=served_model.deployments.get(), max_replicas=2, force=True,
                      force_reason="a rack is down")  # fmt: skip

    page = planner_client.get("/planner/").content.decode()
    assert 'data-testid="oversold-llama-8b"' in page
    assert "llama-8b is oversold</strong> by 120.0 MU/min" in page  # 300 sold, 180 served
    assert '/planner/customers/acme/">acme</a>' in page
    customer = planner_client.get("/planner/customers/acme/").content.decode()
    assert 'data-testid="oversold"' in customer
    assert f'data-testid="at-risk-{acme_sale.pk}"' in customer
    # A customer with nothing at risk carries no such state.
    other = planner_client.get("/planner/customers/globex/").content.decode()
    assert 'data-testid="oversold"' not in other
