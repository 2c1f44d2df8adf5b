"""Which runs are measured on held replicas, and what a run at a shared endpoint may not do:
activate its own fit (benchmarking/isolation.py, benchmarking/services.py)."""

import pytest

from benchmarking import services
from benchmarking.models import BenchmarkRun, BenchmarkSample
from capacity.models import CostModel, Deployment

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

SUITE = {
    "name": "rules",
    "grid": [[128, 16], [512, 16]],
    "slo_ttft_p95_ms": 2000,
    "slo_tpot_p95_ms": 200,
    "duration_per_point_seconds": 0.5,
    "max_concurrency": 4,
}


@pytest.fixture
def suite(db):
    return services.suite_create(**SUITE)


def test_a_deployment_whose_replicas_can_be_told_apart_is_measured_on_held_ones(suite, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(
        actuator_kind="process",
        actuator_config={"engine": "vllm", "base_port": 8100, "host": "127.0.0.1",
                         "supervisor_url": "http://127.0.0.1:8190"},
    )  # fmt: skip

    run = services.run_queue(suite=suite, deployment=deployment)

    assert (run.isolated, run.endpoint_url, run.source_detail) == (True, "", "")


def test_an_endpoint_only_deployment_is_measured_at_its_endpoint_and_said_to_be_shared(
    suite, deployment
):
    Deployment.objects.filter(pk=deployment.pk).update(endpoint_url="http://127.0.0.1:9")

    run = services.run_queue(suite=suite, deployment=deployment)

    assert (run.isolated, run.endpoint_url) == (False, "http://127.0.0.1:9")
    assert run.source_detail.startswith("shared endpoint: deployment llama-8b-h100's replicas")


def test_the_fit_of_a_run_at_a_shared_endpoint_waits_for_a_planner(suite, deployment, settings):
    settings.COST_MODEL_MAX_ACTIVE_MAPE = 1.0  # however good the fit
    Deployment.objects.filter(pk=deployment.pk).update(endpoint_url="http://127.0.0.1:9")
    run = services.run_queue(suite=suite, deployment=deployment)
    BenchmarkRun.objects.filter(pk=run.pk).update(status=BenchmarkRun.Status.SUCCEEDED)
    # Replica time 1 ms per input token + 20 ms per output token + 50 ms per request.
    for input_len in (128, 256, 512, 1024, 2048):
        for output_len in (16, 64, 256):
            seconds = 0.001 * input_len + 0.02 * output_len + 0.05
            BenchmarkSample.objects.create(
                run=run, input_len=input_len, output_len=output_len, concurrency=4,
                requests_per_s=1 / seconds, sustainable=True,
            )  # fmt: skip

    cost_model = services.cost_model_fit(run=BenchmarkRun.objects.get(pk=run.pk))

    assert cost_model.status == CostModel.Status.CANDIDATE
    assert "shared with customers' traffic" in cost_model.review_reason
