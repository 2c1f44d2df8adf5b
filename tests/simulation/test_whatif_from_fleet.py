"""A what-if of a served model starts from its own fleet: the replica from its active cost model
and its deployment's engine profile, requests priced as its usage is, the fleet within its
deployment and pool, and, if asked, its own usage of the last days as the trace. Real
PostgreSQL; short traces."""

import csv
import io
from datetime import timedelta

import pytest
from django.utils import timezone

from capacity.models import CostModel, Reservation, UsageEvent
from core.errors import DomainError
from simulation import whatif
from simulation.models import WhatIfRun
from tests.conftest import make_cost_model
from tests.support.factories import DeploymentFactory, GpuPoolFactory, GpuTypeFactory

pytestmark = pytest.mark.django_db

# Replica-seconds per unit of an 8B model on the reference GPU: what a fit would give.
WEIGHTS = {
    "input_tokens": 1.2e-4,
    "cached_input_tokens": 0.0,
    "output_tokens": 1.1e-4,
    "input_x_output_per_1000": 4.0e-5,
    "output_sq_per_1000": 2.0e-5,
    "images": 0.0,
    "request": 0.02,
}


@pytest.fixture
def fleet(served_model, pool, gpu_type):
    """llama-8b on up to 6 of the pool's 8 H100s, with an engine profile and a cost model."""
    deployment = DeploymentFactory(
        name="llama-8b-h100",
        served_model=served_model,
        gpu_pool=pool,
        max_replicas=6,
        cold_start_seconds=90,
        target_utilisation=0.7,
        scale_to_zero_after_seconds=300,
        engine_profile={"max_num_seqs": 64, "kv_cache_tokens": 100_000},
    )
    make_cost_model(served_model, gpu_type, weights=WEIGHTS)
    return deployment


def create(**overrides) -> WhatIfRun:
    values = {"trace_name": "azure-conv", "duration_minutes": 3, "policies": ["modelunit"]}
    return whatif.whatif_create(**(values | overrides))


def test_a_models_what_if_simulates_its_deployment_from_its_cost_model(served_model, fleet):
    run = create(served_model=served_model, reservations="default = 120")

    fleet_settings = run.settings["fleet"]
    assert fleet_settings["deployment"] == "llama-8b-h100"
    assert fleet_settings["max_replicas"] == 6
    # The tighter of the fleet's cap and the overcommit's: 120 MU/min sold at 1.0 deploys 2.
    assert (run.settings["overcommit_max_replicas"], run.settings["max_replicas"]) == (2, 2)
    # On the reference GPU a replica serves R = 100 MU/min by definition.
    assert fleet_settings["replica_mu_per_minute"] == 100.0
    # The engine profile, and vLLM's defaults and the model's context length for the rest.
    assert fleet_settings["engine_profile"] == {
        "max_num_seqs": 64,
        "max_num_batched_tokens": 8192,
        "kv_cache_tokens": 100_000,
        "context_length": 8192,
    }
    model = run.settings["model_config"]
    assert model["name"] == "llama-8b-h100"
    assert model["cold_start_seconds"] == 90
    assert (model["max_num_seqs"], model["kv_cache_tokens"]) == (64, 100_000)
    # The prefill is the input weight plus the per-request overhead spread over the prompt.
    assert WEIGHTS["input_tokens"] < model["prefill_seconds_per_token"]
    assert model["prefill_seconds_per_token"] < WEIGHTS["input_tokens"] + WEIGHTS["request"] / 100

    done = whatif.whatif_execute(run.pk)
    assert done.status == WhatIfRun.Status.SUCCEEDED, done.error
    modelunit = done.result["policies"]["modelunit"]
    assert modelunit["refused_guaranteed_share"] is not None
    assert modelunit["refused_best_effort_share"] is None  # 'default' is every request
    assert modelunit["refused_within_reservation_share"] == 0
    assert done.result["model"] == "llama-8b-h100"


def test_a_deployment_on_another_gpu_type_serves_the_exchange_rate(served_model, fleet):
    # An L40S twice as slow as the reference H100 for every request, in a pool of 4 GPUs
    # holding 2 replicas of 2 GPUs.
    l40s = GpuTypeFactory(name="L40S-48GB")
    slow = DeploymentFactory(
        name="llama-8b-l40s",
        served_model=served_model,
        gpu_pool=GpuPoolFactory(name="l40s", gpu_type=l40s, gpu_count=4),
        gpus_per_replica=2,
        max_replicas=2,
    )
    make_cost_model(
        served_model, l40s, gpus_per_replica=2, weights={k: 2 * v for k, v in WEIGHTS.items()}
    )
    run = create(served_model=served_model, deployment=slow)
    fleet_settings = run.settings["fleet"]
    assert fleet_settings["deployment"] == "llama-8b-l40s"
    assert fleet_settings["replica_mu_per_minute"] == pytest.approx(50.0)
    assert fleet_settings["max_replicas"] == 2
    assert fleet_settings["reference_cost_model"]["label"] == "H100-80GB×1 v1"
    done = whatif.whatif_execute(run.pk)
    assert done.status == WhatIfRun.Status.SUCCEEDED, done.error
    # GPU-hours count both GPUs of each replica: at least the 2 replicas' 2 GPUs for 3 minutes
    # when static-peak needs them all.
    assert done.result["policies"]["static-peak"]["gpu_hours"] >= 2 * 2 * 3 / 60 - 1e-9


def test_the_form_starts_from_the_models_reservations_in_term(served_model, fleet, acme):
    now = timezone.now()
    Reservation.objects.create(
        customer=acme,
        served_model=served_model,
        mu_per_minute=80,
        starts_at=now - timedelta(days=1),
        status=Reservation.Status.ACTIVE,
        keep_warm=True,
    )
    from simulation import from_fleet

    assert from_fleet.reservations_of(served_model, now=now) == ({"acme": 80.0}, True)


def usage(customer, served_model, cost_model, *, start, count, gap_s, outcome="completed"):
    UsageEvent.objects.bulk_create(
        UsageEvent(
            event_id=f"{customer.slug}-{outcome}-{start.timestamp()}-{i}",
            customer=customer,
            served_model=served_model,
            started_at=start + timedelta(seconds=i * gap_s),
            finished_at=start + timedelta(seconds=i * gap_s + 2),
            minute=(start + timedelta(seconds=i * gap_s + 2)).replace(second=0, microsecond=0),
            input_tokens=800 + i % 400,
            output_tokens=0 if outcome == "refused" else 100 + i % 200,
            outcome=outcome,
            admission_class="best_effort",
            mu=0.0 if outcome == "refused" else 0.3,
            estimated_mu=0.3 if outcome == "refused" else None,
            cost_model=cost_model,
            ingested_at=start,
        )
        for i in range(count)
    )


def test_the_fleets_own_usage_of_the_last_days_is_the_trace(served_model, fleet, acme, globex):
    cost_model = CostModel.objects.get()
    now = timezone.now()
    start = now - timedelta(hours=5)
    usage(acme, served_model, cost_model, start=start, count=300, gap_s=1.0)
    usage(globex, served_model, cost_model, start=start, count=100, gap_s=2.0)
    usage(globex, served_model, cost_model, start=start, count=20, gap_s=5.0, outcome="refused")
    # A week ago: outside the last 2 days.
    usage(acme, served_model, cost_model, start=now - timedelta(days=7), count=50, gap_s=1.0)

    run = create(served_model=served_model, trace_name="usage", usage_days=2, duration_minutes=60)

    assert run.settings["trace_source"] == "usage"
    assert (run.settings["usage_days"], run.settings["usage_events"]) == (2, 420)
    rows = list(csv.DictReader(io.StringIO(run.trace_csv)))
    assert len(rows) == 420
    assert float(rows[0]["timestamp"]) == 0.0
    assert {row["client"] for row in rows} == {"acme", "globex"}
    # A refused request never produced its output: it is replayed with the completed mean.
    outputs = [int(row["output_tokens"]) for row in rows]
    assert 0 not in outputs
    assert run.trace_filename == "usage-llama-8b-2d.csv"

    done = whatif.whatif_execute(run.pk)
    assert done.status == WhatIfRun.Status.SUCCEEDED, done.error
    assert done.result["trace"]["requests"] == 420
    assert done.result["trace"]["clients"] == ["acme", "globex"]
    assert done.result["trace"]["duration_s"] == pytest.approx(299.0)


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"trace_name": "usage"}, "trace", "pick a model"),
        ({"trace_name": "usage", "with_model": True}, "trace", "recorded no usage in the last 7"),
        (
            {"trace_name": "usage", "with_model": True, "usage_days": 40},
            "usage_days",
            "usage_days must be ≥ 1 and ≤ 31",
        ),
        ({"with_model": True, "unpriced": True}, "served_model", "no active cost model"),
        ({"with_model": True, "foreign_deployment": True}, "deployment", "serves other-model"),
        ({"with_model": True, "unpriced_deployment": True}, "deployment", "no active cost model"),
    ],
)
def test_a_bad_fleet_what_if_is_refused_naming_the_field(
    served_model, pool, gpu_type, overrides, field, reason
):
    overrides = dict(overrides)
    if not overrides.pop("unpriced", False):
        make_cost_model(served_model, gpu_type, weights=WEIGHTS)
    DeploymentFactory(name="llama-8b-h100", served_model=served_model, gpu_pool=pool)
    if overrides.pop("with_model", False):
        overrides["served_model"] = served_model
    if overrides.pop("foreign_deployment", False):
        overrides["deployment"] = DeploymentFactory(served_model__name="other-model")
    if overrides.pop("unpriced_deployment", False):
        overrides["deployment"] = DeploymentFactory(
            served_model=served_model, gpu_pool=GpuPoolFactory(gpu_type__name="A10G")
        )
    with pytest.raises(DomainError) as caught:
        create(**overrides)
    assert caught.value.field == field
    assert reason in caught.value.message
    assert not WhatIfRun.objects.exists()


def test_a_pasted_replica_profile_replaces_the_fleets(served_model, fleet):
    run = create(served_model=served_model, model_config='{"name": "mine", "max_num_seqs": 32}')
    assert run.settings["fleet"] is None
    assert run.settings["model_config"]["name"] == "mine"
    assert run.served_model == served_model


def test_the_saturated_batch_is_what_the_kv_cache_holds_of_the_trace(served_model, fleet):
    run = create(served_model=served_model)
    requests = whatif.load_requests(trace_name="azure-conv", duration_minutes=3, rate_scale=1)
    mean_tokens = sum(r.input_tokens + max(1, r.output_tokens) for r in requests) / len(requests)
    assert run.settings["fleet"]["saturated_batch"] == min(64, int(100_000 // mean_tokens))
