"""Allocation and admission together, against the database (issue 19): keep-warm is a
contract, capacity that is still loading is never lent out, refused demand grows the fleet."""

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from capacity.actuation.config import validate_actuator_config
from capacity.allocation.tick import allocation_tick
from capacity.health.probes import probe_round
from capacity.models import (
    ActuatorKind,
    AdmissionAllowance,
    AllocationDecision,
    Deployment,
    Reservation,
    UsageEvent,
    UsageMinute,
)
from capacity.selling.entitlements import entitlements_set
from tests.dataplane.supervisor.support import (  # noqa: F401 - fixtures
    TINY_MODEL,
    emulator_command,
    engines,
    free_port_range,
    http_supervisor,
    supervisor,
    wait_until,
)

pytestmark = [pytest.mark.django_db, pytest.mark.slow]


@pytest.fixture
def idle_fleet(sellable, served_model, acme):
    """llama-8b at 3 replicas that may scale to zero after 10 idle minutes; acme's 250 MU/min
    reservation started two hours ago and was never used."""
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=3, target_utilisation=1.0, min_replicas=0,
        scale_to_zero_after_seconds=600,
    )  # fmt: skip

    def reserve(*, keep_warm: bool) -> Reservation:
        return Reservation.objects.create(
            customer=acme, served_model=served_model, mu_per_minute=250, keep_warm=keep_warm,
            starts_at=timezone.now() - timedelta(hours=2), status="active",
        )  # fmt: skip

    return reserve


def replicas_after_the_stabilisation_window() -> int:
    """Tick every minute until a scale-down may take effect (the 120 s stabilisation window
    holds while any tick inside it recommended more)."""
    start = timezone.now()
    with time_machine.travel(start, tick=False) as clock:
        for _ in range(3):
            allocation_tick()
            clock.shift(timedelta(seconds=65))
    return Deployment.objects.get(name="llama-8b-h100").current_replicas


@pytest.mark.both_databases
def test_a_reservation_without_keep_warm_lets_the_model_go_to_zero_after_its_idle_window(
    idle_fleet,
):
    idle_fleet(keep_warm=False)

    assert replicas_after_the_stabilisation_window() == 0
    decision = AllocationDecision.objects.get(current_replicas=3, target_replicas=0)
    assert "scale_to_zero" in {reason["code"] for reason in decision.reasons}
    # The reservation still holds: a request within it is admitted and waits a cold start.
    allowance = AdmissionAllowance.objects.get()
    assert allowance.guaranteed_mu_per_minute == 250


@pytest.mark.both_databases
def test_a_reservation_with_keep_warm_never_lets_the_model_go_cold(idle_fleet):
    idle_fleet(keep_warm=True)

    assert replicas_after_the_stabilisation_window() == 3


@pytest.mark.both_databases
def test_a_reservation_used_within_its_idle_window_stays_warm(idle_fleet, served_model, acme):
    idle_fleet(keep_warm=False)
    UsageMinute.objects.create(
        customer=acme, served_model=served_model, requests=1, mu=1.0,
        minute=timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=8),
    )  # fmt: skip

    assert replicas_after_the_stabilisation_window() == 3


@pytest.mark.both_databases
def test_refused_best_effort_demand_grows_the_fleet_before_its_minute_is_rolled_up(
    sellable, served_model, globex
):
    # globex has no reservation and no history; what admission refused it in the last
    # seconds (estimated at 280 MU/min) is demand the fleet grows for, at once.
    Deployment.objects.filter(name="llama-8b-h100").update(
        current_replicas=1, target_utilisation=1.0
    )
    entitlements_set(customer=globex, served_models=[served_model], actor="test")
    now = timezone.now()
    UsageEvent.objects.bulk_create(
        UsageEvent(
            # A steady rate over the last 18 s, not a burst.
            event_id=f"refused-{i}", customer=globex, served_model=served_model,
            started_at=now - timedelta(seconds=18 - 0.4 * i),
            finished_at=now - timedelta(seconds=18 - 0.4 * i),
            minute=(now - timedelta(seconds=18 - 0.4 * i)).replace(second=0, microsecond=0),
            input_tokens=0, output_tokens=0, outcome="refused", admission_class="best_effort",
            mu=0.0, estimated_mu=2.0, cost_model=sellable, ingested_at=now,
        )
        for i in range(45)  # 90 MU in 20 s: 270 MU/min
    )  # fmt: skip

    allocation_tick()

    assert Deployment.objects.get(name="llama-8b-h100").current_replicas == 3
    decision = AllocationDecision.objects.get()
    assert "best_effort" in {reason["code"] for reason in decision.reasons}


@pytest.fixture
def slow_starting(sellable, served_model, globex, http_supervisor, monkeypatch, tmp_path):  # noqa: F811
    """llama-8b on the process supervisor, whose engines load for 3 s before serving, as
    vLLM does; globex may use the model (no reservation: best-effort only)."""
    monkeypatch.setenv("MU_ACTUATOR_SUPERVISOR_TOKEN", "s3cret-token")
    served_model.engine_model_id = TINY_MODEL["name"]
    served_model.save()
    entitlements_set(customer=globex, served_models=[served_model], actor="test")
    http_supervisor.supervisor.engines["slow"] = (
        *http_supervisor.supervisor.engines["emulator"], "--startup-seconds", "3",
    )  # fmt: skip
    deployment = served_model.deployments.get()
    deployment.actuator_kind = ActuatorKind.PROCESS
    deployment.actuator_config = validate_actuator_config(
        ActuatorKind.PROCESS,
        {"engine": "slow", "base_port": free_port_range(3),
         "supervisor_url": http_supervisor.url, "drain_seconds": 1,
         "token_env": "MU_ACTUATOR_SUPERVISOR_TOKEN"},
    )  # fmt: skip
    deployment.min_replicas = deployment.max_replicas = 2
    deployment.current_replicas = 0
    deployment.target_utilisation = 1.0
    deployment.save()
    return deployment


def best_effort_lent() -> float:
    return sum(a.best_effort_mu_per_minute for a in AdmissionAllowance.objects.all())


def test_replicas_still_loading_are_never_lent_out(slow_starting, http_supervisor, settings):  # noqa: F811
    settings.HEALTH_PROBE_QUIET_SECONDS = 0
    running = http_supervisor.supervisor
    allocation_tick()  # asks the supervisor for 2 replicas: they load for 3 s
    assert running.deployment_status(slow_starting.name)["target"] == 2

    probe_round()  # the supervisor reports them starting; none answers yet
    allocation_tick()

    loading = AllocationDecision.objects.filter(deployment=slow_starting).first()
    assert (loading.current_replicas, loading.ready_replicas, loading.starting_replicas) == (
        2, 0, 2,
    )  # fmt: skip
    assert best_effort_lent() == 0.0

    wait_until(lambda: running.deployment_status(slow_starting.name)["ready"] == 2,
               timeout_seconds=20, what="two ready replicas")  # fmt: skip
    probe_round()  # they answer now
    allocation_tick()

    ready = AllocationDecision.objects.filter(deployment=slow_starting).first()
    assert (ready.ready_replicas, ready.starting_replicas) == (2, 0)
    assert best_effort_lent() == pytest.approx(200.0)  # 2 ready × 100 MU/min
