"""The planner sees an oversold model and its customers on the fleet and customer pages, and
sold capacity the last tick could not make hot (the guaranteed shortfall)."""

import json
import re

import pytest

from capacity.allocation.tick import allocation_tick
from capacity.catalog.services import deployment_update
from capacity.models import Deployment
from capacity.selling.reservations import reservation_create
from capacity.tasks import capacity_sample
from tests.support.factories import DeploymentFactory, ServedModelFactory

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


def chart_datasets(page: str, script_id: str) -> dict[str, list]:
    match = re.search(rf'<script id="{script_id}" type="application/json">(.*?)</script>', page)
    assert match, f"no chart config {script_id} in the page"
    return {d["label"]: d["data"] for d in json.loads(match.group(1))["data"]["datasets"]}


def test_a_guaranteed_shortfall_is_shown_in_the_banner_and_the_chart_without_an_oversold_state(
    planner_client, acme, sellable, served_model, pool
):
    Deployment.objects.filter(served_model=served_model).update(target_utilisation=1.0)
    # Sold within what the pool's GPUs serve (720 MU/min sellable), kept warm ...
    reservation_create(customer=acme, served_model=served_model, mu_per_minute=300, keep_warm=True)
    # ... but another model's minimum takes 6 of the 8 GPUs first: the tick makes 200 hot.
    qwen = ServedModelFactory(name="qwen", reference_gpu_type=pool.gpu_type)
    qwen_h100 = DeploymentFactory(name="qwen-h100", served_model=qwen, gpu_pool=pool,
                                  min_replicas=6, max_replicas=6)  # fmt: skip

    allocation_tick()
    capacity_sample()  # the minute's sample the chart draws (beat runs it every 30 s)

    page = planner_client.get("/planner/").content.decode()
    assert 'data-testid="oversold-llama-8b"' in page
    banner = page.split('data-testid="oversold-llama-8b"')[1].split("</div>")[0]
    assert "<strong>llama-8b</strong>: the last tick could not make" in banner
    assert "100.0 MU/min of sold capacity hot." in banner
    assert "is oversold" not in banner  # the GPUs could serve it: nothing is oversold
    assert 'data-testid="oversold-qwen"' not in page  # nothing sold, nothing short
    series = chart_datasets(page, f"capacity-{served_model.pk}")
    assert [v for v in series["Guaranteed shortfall"] if v is not None] == [100]
    assert [v for v in series["Oversold"] if v is not None] == [0]
    assert [v for v in series["Hot"] if v is not None] == [200]

    # The other model gives its GPUs back: the next tick makes all 300 hot, the banner goes.
    Deployment.objects.filter(pk=qwen_h100.pk).update(min_replicas=0)
    allocation_tick()

    page = planner_client.get("/planner/").content.decode()
    assert 'data-testid="oversold-llama-8b"' not in page
