"""A benchmark of a deployment measures replicas held for the run, out of the customers'
rotation (benchmarking/isolation.py), end to end with real processes: the process supervisor
and its emulator replicas, Celery beat and a worker running the ticks, the probes and the
benchmark, gunicorn for the gateway's usage, and the gateway carrying a customer's traffic.

- The run measured while a customer's traffic flows through the gateway finds the same
  sustainable req/s per replica (±10 %) as the run of the idle deployment.
- No customer's request is routed to a benchmark replica during the run: the usage events
  name the replica that served each request.
- After each run the hold is released and the extra replica goes.
"""

import json
import time
from datetime import UTC, datetime, timedelta

import pytest

from accounts import scopes as S
from benchmarking.models import BenchmarkRun, BenchmarkSuite
from benchmarking.services import run_queue
from capacity.actuation.config import validate_actuator_config
from capacity.models import ActuatorKind, Deployment, Replica, UsageEvent
from capacity.selling.reservations import reservation_create
from tests.dataplane.gateway.conftest import gateway_process
from tests.dataplane.gateway.control_plane import control_plane
from tests.dataplane.gateway.test_loop_through_the_gateway import Traffic, schedule
from tests.dataplane.supervisor.support import (  # noqa: F401 - fixtures
    TINY_MODEL,
    emulator_command,
    engines,
    free_port_range,
    http_supervisor,
    supervisor,
)
from tests.support.processes import celery_beat_process, celery_worker_process, free_port

# Timing-sensitive: it compares two runs' throughput and the runner's own lag, which another
# worker's load would change.
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgresql_only,
    pytest.mark.serial,
]

# Paced by simulated time (20 ms a decode step), not by this machine's two cores: what the
# benchmark finds per replica must not depend on the CPU the customer's replica takes.
PACED = TINY_MODEL | {"decode_step_base_seconds": 0.02, "max_num_seqs": 4, "vocab_size": 32000}
MAX_REPLICAS = 3


@pytest.fixture
def fleet(sellable, served_model, acme, make_key, http_supervisor, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MU_ACTUATOR_SUPERVISOR_TOKEN", "s3cret-token")
    config_path = tmp_path / "paced.json"
    config_path.write_text(json.dumps({"models": [PACED]}))
    emulator = http_supervisor.supervisor.engines["emulator"]
    http_supervisor.supervisor.engines["paced"] = (*emulator[:-1], str(config_path))
    served_model.engine_model_id = PACED["name"]
    served_model.save()
    deployment = served_model.deployments.get()
    deployment.actuator_kind = ActuatorKind.PROCESS
    deployment.actuator_config = validate_actuator_config(
        ActuatorKind.PROCESS,
        {"engine": "paced", "base_port": free_port_range(MAX_REPLICAS + 1),
         "supervisor_url": http_supervisor.url, "drain_seconds": 1,
         "token_env": "MU_ACTUATOR_SUPERVISOR_TOKEN"},
    )  # fmt: skip
    deployment.min_replicas, deployment.max_replicas, deployment.current_replicas = 1, 3, 0
    deployment.cold_start_seconds = 5
    deployment.target_utilisation = 1.0
    deployment.save()
    reservation_create(
        customer=acme, served_model=served_model, mu_per_minute=60, keep_warm=True, actor="test"
    )
    _, acme_key = make_key(customer=acme, scopes=[S.READ, S.ADMISSION])
    _, service_key = make_key(service_name="gateway", scopes=[S.USAGE_WRITE])
    suite = BenchmarkSuite.objects.create(
        name="isolation",
        grid=[[64, 16], [128, 16]],
        slo_ttft_p95_ms=5000,
        slo_tpot_p95_ms=1000,
        duration_per_point_seconds=2.0,
        concurrency_start=2,
        max_concurrency=4,
    )
    return {"acme": acme_key, "service": service_key, "deployment": deployment, "suite": suite}


def finished(run_id: int, timeout_seconds: float = 60) -> BenchmarkRun:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        run = BenchmarkRun.objects.get(pk=run_id)
        if run.status in (BenchmarkRun.Status.SUCCEEDED, BenchmarkRun.Status.FAILED):
            return run
        time.sleep(0.5)
    replicas = list(Replica.objects.values_list("key", "state", "held_by_benchmark_run_id"))
    raise AssertionError(
        f"run {run_id} still {run.status}: {run.progress_message}\n{run.log}\n"
        f"decisions {_decisions(3)}\nreplicas {replicas}\nheld "
        f"{Deployment.objects.values_list('current_replicas', 'benchmark_held_replicas')[0]}"
    )


def _decisions(last: int = 40) -> list:
    """The last ticks' decisions, newest first, with what each reason said: why a target moved."""
    from capacity.models import AllocationDecision

    return [
        (d.created_at.strftime("%H:%M:%S"), d.current_replicas, d.recommended_replicas,
         d.target_replicas, d.actuator_ok,
         d.actuator_error[:80], [(r["code"], r.get("message", "")[:120]) for r in d.reasons])
        for d in AllocationDecision.objects.order_by("-id")[:last]
    ]  # fmt: skip


def per_replica(run: BenchmarkRun) -> dict[tuple[int, int], float]:
    return {
        (s.input_len, s.output_len): s.requests_per_s for s in run.samples.filter(sustainable=True)
    }


def serving(deployment) -> int:
    return Replica.objects.filter(
        deployment=deployment, state=Replica.State.HEALTHY, last_ok_at__isnull=False
    ).count()


def test_a_benchmark_beside_customer_traffic_measures_what_an_idle_one_does_on_held_replicas(
    fleet, tmp_path, settings
):
    deployment = fleet["deployment"]
    schedule("allocation: tick (test)", "capacity.allocation_tick", 3, "allocation")
    schedule("health: probes (test)", "capacity.health_probes", 1, "health")
    port = free_port()
    (tmp_path / "health").mkdir()
    with celery_worker_process(tmp_path, queues="allocation,default,benchmarks"), \
            celery_worker_process(tmp_path / "health", queues="health"), \
            celery_beat_process(tmp_path), control_plane(tmp_path, port) as api_url, \
            gateway_process(
                tmp_path, GATEWAY_CONTROL_PLANE_URL=api_url, GATEWAY_SERVICE_KEY=fleet["service"],
                GATEWAY_REDIS_URL=settings.ADMISSION_REDIS_URL,
            ) as gateway:  # fmt: skip
        # The customers' replica (min 1, kept warm) comes up first.
        deadline = time.monotonic() + 60
        while serving(deployment) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert serving(deployment) == 1

        idle = finished(run_queue(suite=fleet["suite"], deployment=deployment, replicas=1).pk)
        assert idle.status == BenchmarkRun.Status.SUCCEEDED, idle.error + idle.log

        traffic = Traffic(gateway.url).start()
        # 2 req/s of 0.42 MU: 50 MU/min, within acme's 60 reserved and one replica's 100.
        # At 4 req/s (101 MU/min) admission refused some, and the refused MU was demand for a
        # second replica, which the stabilisation window then kept for 120 s after the run.
        traffic.set("acme", fleet["acme"], 2.0)
        try:
            time.sleep(3)
            busy_started = time.time()
            busy = finished(run_queue(suite=fleet["suite"], deployment=deployment).pk)
            busy_finished = time.time()
            time.sleep(2)
        finally:
            traffic.stop()
        assert busy.status == BenchmarkRun.Status.SUCCEEDED, busy.error + busy.log

        # Released: the extra replica goes at the next ticks (and its drain). The bound is
        # liveness only: on a loaded machine two ticks and a drain took over 30 s.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            deployment.refresh_from_db()
            if deployment.current_replicas == 1:
                break
            time.sleep(0.5)

    assert idle.isolated and busy.isolated
    assert len(busy.measured_endpoints) == 1
    assert busy.reliable is not False, busy.log
    idle_rates, busy_rates = per_replica(idle), per_replica(busy)
    assert set(busy_rates) == set(idle_rates) == {(64, 16), (128, 16)}
    for shape, rate in idle_rates.items():
        assert abs(busy_rates[shape] - rate) <= 0.10 * rate, (shape, rate, busy_rates[shape])
    # From the moment the run measured its replica (its log line; the replica was a
    # customers' one until the run took it and the gateways re-read their documents).
    measuring_from = _logged_at(busy.log, "benchmarking ") + timedelta(seconds=1)
    # ... until its last shape was measured: right after, the replica returns to the rotation.
    measured_until = _logged_at(busy.log, "128/16: sustainable")
    during = UsageEvent.objects.filter(
        customer__slug="acme",
        started_at__gte=max(measuring_from, _aware(busy_started)),
        started_at__lte=min(measured_until, _aware(busy_finished)),
        outcome="completed",
    )
    served_by = set(during.values_list("replica", flat=True))
    assert during.count() > 10
    wrong = [
        (e.started_at.isoformat(), e.finished_at.isoformat())
        for e in during.filter(replica__in=busy.measured_endpoints)
    ]
    assert served_by and not wrong, (measuring_from.isoformat(), wrong[:5], busy.log)
    assert traffic.window("acme", 0, 10_000)[200] > 0
    deployment.refresh_from_db()
    assert deployment.benchmark_held_replicas == 0
    assert deployment.current_replicas == 1, _decisions()
    assert not Replica.objects.filter(held_by_benchmark_run_id__isnull=False).exists()
    print(
        f"\nper replica, idle vs beside {during.count()} customer requests: "
        + ", ".join(
            f"{i}/{o}: {idle_rates[(i, o)]:.2f} vs {busy_rates[(i, o)]:.2f} req/s"
            for i, o in sorted(idle_rates)
        )
        + f"; customers served by {sorted(served_by)}, the run measured {busy.measured_endpoints}"
    )


def _aware(epoch_seconds: float) -> datetime:
    return datetime.fromtimestamp(epoch_seconds, tz=UTC)


def _logged_at(log: str, text: str) -> datetime:
    [line] = [line for line in log.splitlines() if text in line][:1]
    return datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
