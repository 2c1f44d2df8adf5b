"""Model and deployment names are engine-style, dots included (the demo's `llama-3.1-8b`):
every planner page that links to them renders (a slug-only URL once gave the demo a 500)."""

import uuid

import pytest
from django.utils import timezone

from benchmarking.models import BenchmarkRun
from capacity.models import (
    AllocationDecision,
    DegradationPolicy,
    DeploymentFingerprint,
    Replica,
)
from tests.conftest import make_cost_model
from tests.support.factories import (
    DeploymentFactory,
    GpuPoolFactory,
    GpuTypeFactory,
    ServedModelFactory,
)

pytestmark = pytest.mark.django_db


def test_pages_link_to_dotted_model_and_deployment_names(planner_client):
    gpu_type = GpuTypeFactory(name="H100-80GB")
    model = ServedModelFactory(name="llama-3.1-8b", reference_gpu_type=gpu_type)
    pool = GpuPoolFactory(gpu_type=gpu_type, gpu_count=4)
    deployment = DeploymentFactory(name="llama-3.1-8b.h100", served_model=model, gpu_pool=pool)
    make_cost_model(model, gpu_type)
    BenchmarkRun.objects.create(served_model=model, gpu_type=gpu_type, deployment=deployment)
    AllocationDecision.objects.create(
        tick_id=uuid.uuid4(),
        deployment=deployment,
        served_model=model,
        inputs_digest="0" * 64,
        current_replicas=0,
        recommended_replicas=1,
        target_replicas=1,
        actuator_kind="dry_run",
    )
    Replica.objects.create(deployment=deployment, key="endpoint", url="http://engine:8000")
    DeploymentFingerprint.objects.create(
        deployment=deployment,
        prompt="p",
        answer="a",
        answer_sha256="0" * 64,
        recorded_at=timezone.now(),
    )
    DegradationPolicy.objects.create(served_model=model)
    pages = [
        "/planner/",
        "/planner/benchmarks/",
        "/planner/benchmarks/cost-models/",
        f"/planner/benchmarks/cost-models/llama-3.1-8b/{gpu_type.pk}/1/",
        "/planner/allocation/",
        "/planner/allocation/deployments/llama-3.1-8b.h100/",
        "/planner/health/",
        "/planner/health/models/llama-3.1-8b/policy/",
    ]
    for page in pages:
        response = planner_client.get(page)
        assert response.status_code == 200, (page, response.status_code)
    health = planner_client.get("/planner/health/").content.decode()
    assert "/planner/health/models/llama-3.1-8b/policy/" in health
    assert "/planner/health/deployments/llama-3.1-8b.h100/reset-fingerprint/" in health
