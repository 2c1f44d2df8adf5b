"""List endpoints cost the same number of queries whatever the page holds (no N+1)."""

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts.services import api_key_create
from capacity.models import AllocationDecision, Reservation
from tests.support.factories import CustomerFactory, DeploymentFactory

pytestmark = pytest.mark.django_db

LISTS = [
    "/api/v1/api-keys/",
    "/api/v1/customers/",
    "/api/v1/deployments/",
    "/api/v1/reservations/",
    "/api/v1/allocation/decisions/",
    "/api/v1/allocation/allowances/",
    "/api/v1/cost-models/",
    "/api/v1/benchmark-runs/",
]


def grow(served_model, pool, gpu_type, count: int) -> None:
    from capacity.models import AdmissionAllowance
    from tests.conftest import make_cost_model

    for _ in range(count):
        customer = CustomerFactory()
        api_key_create(name="k", customer=customer)
        deployment = DeploymentFactory(served_model=served_model, gpu_pool=pool, max_replicas=1)
        Reservation.objects.create(
            customer=customer,
            served_model=served_model,
            mu_per_minute=1,
            starts_at=timezone.now() - timedelta(hours=1),
        )
        AllocationDecision.objects.create(
            tick_id=uuid.uuid4(),
            deployment=deployment,
            served_model=served_model,
            inputs_digest="0" * 64,
            current_replicas=0,
            recommended_replicas=1,
            target_replicas=1,
            actuator_kind="dry_run",
        )
        AdmissionAllowance.objects.create(
            customer=customer,
            served_model=served_model,
            guaranteed_mu_per_minute=1,
            best_effort_mu_per_minute=1,
            tick_id=uuid.uuid4(),
            updated_at=timezone.now(),
        )
        make_cost_model(served_model, gpu_type)


def queries_for(client, path: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(path)
    assert response.status_code == 200, (path, response.content[:200])
    return len(captured)


def test_list_endpoints_do_not_grow_queries_with_their_rows(
    planner_client, served_model, pool, gpu_type
):
    grow(served_model, pool, gpu_type, 2)
    few = {path: queries_for(planner_client, path) for path in LISTS}
    grow(served_model, pool, gpu_type, 6)
    many = {path: queries_for(planner_client, path) for path in LISTS}
    assert many == few
