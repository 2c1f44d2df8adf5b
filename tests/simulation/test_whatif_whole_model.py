"""A what-if of a model simulates its whole fleet: every deployment that serves it, each with the
replica its own GPU type's cost model describes, its own max replicas and cold start, and the
GPUs of its pool, a pool shared by several deployments counted once; the result splits
replica-hours, GPU-hours and cost by deployment. Real database; short traces."""

import pytest

from core.errors import DomainError
from simulation import whatif
from simulation.models import WhatIfRun
from tests.conftest import make_cost_model
from tests.support.factories import DeploymentFactory, GpuPoolFactory, GpuTypeFactory

pytestmark = [pytest.mark.django_db, pytest.mark.both_databases]

# Replica-seconds per unit of an 8B model on the reference H100 (as test_whatif_from_fleet).
WEIGHTS = {
    "input_tokens": 1.2e-4,
    "cached_input_tokens": 0.0,
    "output_tokens": 1.1e-4,
    "input_x_output_per_1000": 4.0e-5,
    "output_sq_per_1000": 2.0e-5,
    "images": 0.0,
    "request": 0.02,
}


def scaled(factor: float) -> dict[str, float]:
    return {key: factor * value for key, value in WEIGHTS.items()}


@pytest.fixture
def two_gpu_types(served_model, pool, gpu_type):
    """llama-8b on up to 2 H100s (of a pool of 8), and on L40S pairs twice as slow, up to 3
    by its own limit but 2 by its pool of 4 L40S. H100: $2.50 a GPU-hour for 100 MU/min a
    replica; an L40S pair: $2.00 for 50, so the H100s are the cheaper MU."""
    h100 = DeploymentFactory(
        name="llama-8b-h100",
        served_model=served_model,
        gpu_pool=pool,
        max_replicas=2,
        cold_start_seconds=90,
    )
    make_cost_model(served_model, gpu_type, weights=WEIGHTS)
    l40s_type = GpuTypeFactory(name="L40S-48GB", hourly_cost_usd="1.0000")
    l40s = DeploymentFactory(
        name="llama-8b-l40s",
        served_model=served_model,
        gpu_pool=GpuPoolFactory(name="eu-l40s", gpu_type=l40s_type, gpu_count=4),
        gpus_per_replica=2,
        max_replicas=3,
        cold_start_seconds=150,
        engine_profile={"max_num_seqs": 32},
    )
    make_cost_model(served_model, l40s_type, gpus_per_replica=2, weights=scaled(2.0))
    return h100, l40s


def create(**overrides) -> WhatIfRun:
    values = {"trace_name": "azure-conv", "duration_minutes": 3, "policies": ["static-peak"]}
    return whatif.whatif_create(**(values | overrides))


def by_name(fleet: dict) -> dict[str, dict]:
    return {row["name"]: row for row in fleet["deployments"]}


def test_the_fleet_holds_every_deployment_with_its_own_replica_and_limits(
    served_model, two_gpu_types
):
    run = create(served_model=served_model)

    fleet = run.settings["fleet"]
    deployments = by_name(fleet)
    assert set(deployments) == {"llama-8b-h100", "llama-8b-l40s"}
    h100, l40s = deployments["llama-8b-h100"], deployments["llama-8b-l40s"]
    # Each replica from its own GPU type's cost model: an L40S pair serves half the MU.
    assert h100["replica_mu_per_minute"] == 100.0
    assert l40s["replica_mu_per_minute"] == pytest.approx(50.0)
    assert (h100["gpu_type"], h100["gpus_per_replica"]) == ("H100-80GB", 1)
    assert (l40s["gpu_type"], l40s["gpus_per_replica"]) == ("L40S-48GB", 2)
    assert h100["cost_model"]["label"] == "H100-80GB×1 v1"
    assert l40s["cost_model"]["label"] == "L40S-48GB×2 v1"
    # Its own limit: the H100s their max replicas, the L40S what their pool holds.
    assert (h100["max_replicas"], l40s["max_replicas"]) == (2, 2)
    assert (h100["cold_start_seconds"], l40s["cold_start_seconds"]) == (90.0, 150.0)
    # Each its own replica: twice the prefill on the L40S, its own batch.
    assert l40s["model_config"]["prefill_seconds_per_token"] == pytest.approx(
        2 * h100["model_config"]["prefill_seconds_per_token"]
    )
    assert (h100["model_config"]["max_num_seqs"], l40s["model_config"]["max_num_seqs"]) == (
        256,
        32,
    )
    # The fleet's cap, in replicas of its cheapest MU (the H100's): 2 × 100 + 2 × 50 MU/min.
    assert fleet["replica_mu_per_minute"] == 100.0
    assert run.settings["max_replicas"] == fleet["max_replicas"] == 3
    assert {pool["name"]: pool["gpus"] for pool in fleet["pools"]} == {
        "us-east-h100": 8,
        "eu-l40s": 4,
    }
    assert fleet["skipped"] == []


def test_the_result_splits_hours_and_cost_by_deployment(served_model, two_gpu_types):
    # Four times the conversation trace wants about 5 H100 replicas: more than the fleet's 3.
    run = create(served_model=served_model, rate_scale=4, policies=["static-peak", "modelunit"])
    done = whatif.whatif_execute(run.pk)
    assert done.status == WhatIfRun.Status.SUCCEEDED, done.error

    static = done.result["policies"]["static-peak"]
    h100 = done.result["deployments"]["static-peak"]["llama-8b-h100"]
    l40s = done.result["deployments"]["static-peak"]["llama-8b-l40s"]
    # Capped at the fleet's 3: both H100s, then two L40S pairs for the last 100 MU/min.
    scored_hours = h100["replica_hours"] / 2
    assert scored_hours > 0
    assert l40s["replica_hours"] == pytest.approx(2 * scored_hours)
    assert h100["gpu_hours"] == pytest.approx(h100["replica_hours"])
    assert l40s["gpu_hours"] == pytest.approx(2 * l40s["replica_hours"])
    assert h100["cost_usd"] == pytest.approx(2.5 * h100["gpu_hours"])
    assert l40s["cost_usd"] == pytest.approx(1.0 * l40s["gpu_hours"])
    # The model's totals are the deployments'.
    assert static["gpu_hours"] == pytest.approx(h100["gpu_hours"] + l40s["gpu_hours"])
    assert static["cost_usd"] == pytest.approx(h100["cost_usd"] + l40s["cost_usd"])

    # The live policy spreads the demand as it does live: the cheaper H100s first, the
    # L40S for what they cannot hold.
    modelunit = done.result["deployments"]["modelunit"]
    assert modelunit["llama-8b-h100"]["replica_hours"] > 0
    assert modelunit["llama-8b-l40s"]["replica_hours"] > 0
    assert modelunit["llama-8b-h100"]["replica_hours"] <= 2 * scored_hours + 1e-9
    assert modelunit["llama-8b-l40s"]["replica_hours"] <= 2 * scored_hours + 1e-9


def test_a_pool_shared_by_two_deployments_is_counted_once(served_model, pool, gpu_type):
    # On the same 8 H100s: one GPU a replica up to 6, or pairs 1.5 times as fast up to 4.
    # Alone each fits its max (6 and 8 GPUs); together they hold 8 GPUs, not 14.
    DeploymentFactory(name="llama-8b-tp1", served_model=served_model, gpu_pool=pool, max_replicas=6)
    DeploymentFactory(
        name="llama-8b-tp2",
        served_model=served_model,
        gpu_pool=pool,
        gpus_per_replica=2,
        max_replicas=4,
    )
    make_cost_model(served_model, gpu_type, weights=WEIGHTS)
    make_cost_model(served_model, gpu_type, gpus_per_replica=2, weights=scaled(1 / 1.5))

    run = create(served_model=served_model, rate_scale=8, duration_minutes=2)
    fleet = run.settings["fleet"]
    deployments = by_name(fleet)
    assert (
        deployments["llama-8b-tp1"]["max_replicas"],
        deployments["llama-8b-tp2"]["max_replicas"],
    ) == (6, 4)
    assert deployments["llama-8b-tp2"]["replica_mu_per_minute"] == pytest.approx(150.0)
    assert fleet["pools"] == [
        {
            "name": "us-east-h100",
            "gpu_type": "H100-80GB",
            "gpus": 8,
            "deployments": ["llama-8b-tp1", "llama-8b-tp2"],
            "other_models": [],
        }
    ]
    assert fleet["gpus"] == 8
    # 6 one-GPU replicas (600 MU/min, the cheaper MU) and one pair in the 2 GPUs left: 750,
    # 7 replicas of 100 MU/min; counted twice the pool would hold 6 + 4 pairs, 12.
    assert fleet["max_replicas"] == 7

    done = whatif.whatif_execute(run.pk)
    assert done.status == WhatIfRun.Status.SUCCEEDED, done.error
    static = done.result["policies"]["static-peak"]
    shares = done.result["deployments"]["static-peak"]
    tp1, tp2 = shares["llama-8b-tp1"], shares["llama-8b-tp2"]
    scored_hours = tp1["replica_hours"] / 6
    assert tp2["replica_hours"] == pytest.approx(scored_hours)
    # Never more GPUs than the pool has: 6 + 2.
    assert static["gpu_hours"] == pytest.approx(8 * scored_hours)


def test_a_deployment_without_a_cost_model_is_skipped_with_the_reason(served_model, two_gpu_types):
    DeploymentFactory(
        name="llama-8b-a10g",
        served_model=served_model,
        gpu_pool=GpuPoolFactory(name="a10g", gpu_type__name="A10G"),
    )
    run = create(served_model=served_model)
    fleet = run.settings["fleet"]
    assert set(by_name(fleet)) == {"llama-8b-h100", "llama-8b-l40s"}
    [skipped] = fleet["skipped"]
    assert skipped["deployment"] == "llama-8b-a10g"
    assert "A10G×1" in skipped["reason"] and "no active cost model" in skipped["reason"]


def test_a_picked_deployment_is_simulated_alone(served_model, two_gpu_types):
    _, l40s = two_gpu_types
    run = create(served_model=served_model, deployment=l40s)
    fleet = run.settings["fleet"]
    assert [row["name"] for row in fleet["deployments"]] == ["llama-8b-l40s"]
    assert fleet["deployment"] == "llama-8b-l40s"
    assert fleet["max_replicas"] == 2


def test_a_model_whose_deployments_all_lack_a_cost_model_is_refused(served_model, gpu_type):
    make_cost_model(served_model, gpu_type, weights=WEIGHTS)
    DeploymentFactory(
        name="llama-8b-a10g",
        served_model=served_model,
        gpu_pool=GpuPoolFactory(name="a10g", gpu_type__name="A10G"),
    )
    with pytest.raises(DomainError) as caught:
        create(served_model=served_model)
    assert caught.value.field == "served_model"
    assert "no deployment on a GPU type with an active cost model" in caught.value.message
    assert not WhatIfRun.objects.exists()
