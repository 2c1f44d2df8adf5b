"""Runtime reliability against real engine emulators run by the real process supervisor,
with the default probe settings (HEALTH_PROBE_*), probe rounds started every interval as
beat starts them.

- hang_to_serving_s: an injected hang (the engine accepts requests and never answers, while
  /health answers 200) → detected → restarted → answering the probe as known good, in
  seconds from the injection. Baseline, same run: a crash of the other replica → the
  supervisor's own restart → answering again (the floor: no detection needed). Target: < 60.
- hang_liveness_detections: /health checks (5 s timeout, as the probes) of the hung replica
  that failed while it hung: a liveness check never sees a hang. Baseline: the probes' one.
- saturated_false_unhealthy: replicas marked unhealthy over BENCH_HEALTH_SATURATED_SECONDS
  (60, within make bench's 15 minutes; issue 10 measured 600) with every replica saturated
  and no faults, probing every round (quiet window 0, so real traffic never stands in for a
  probe). Baseline, same run: the same probe sent at the traffic's own priority, counted as K
  timeouts in a row (the seeds' false kills).
- saturated_probe_p99_ms: the probes' p99 latency under that load, beside the p50 of the
  same probe at the traffic's priority.
"""

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from django.conf import settings
from django.utils import timezone

from bench.figures import Figure
from capacity.actuation.config import validate_actuator_config
from capacity.health.probes import probe_endpoint, probe_round
from capacity.models import (
    ActuatorKind,
    Deployment,
    GpuPool,
    GpuType,
    Incident,
    ProbeResult,
    Replica,
    ServedModel,
)
from dataplane.supervisor.server import make_server
from dataplane.supervisor.supervisor import ProcessSupervisor
from tests.dataplane.supervisor.support import TINY_MODEL
from tests.support.saturation import Saturator, waiting_requests

ROOT = Path(__file__).resolve().parent.parent
SATURATED_SECONDS = float(os.environ.get("BENCH_HEALTH_SATURATED_SECONDS", "60"))
# A small fast engine: 8 sequences per batch, ~2 ms steps; 600-token requests last ~1.3 s.
# The tests' small fast engine, with room in its KV cache for the saturating load.
MODEL = {**TINY_MODEL, "kv_cache_tokens": 16384}


class Fleet:
    """Two emulator replicas under an in-process supervisor with its HTTP API."""

    def __init__(self, folder: Path, name: str):
        config = folder / "engine.json"
        config.write_text(json.dumps({"models": [MODEL]}))
        os.environ["PYTHONPATH"] = str(ROOT)
        self.command = [
            sys.executable, "-m", "dataplane.emulator", "--port", "{port}",
            "--config", str(config), "--scheduling-policy", "priority",
        ]  # fmt: skip
        self.supervisor = ProcessSupervisor(
            engines={"emulator": tuple(self.command)}, log_dir=folder / "logs"
        ).start()
        self.server = make_server(self.supervisor, port=0, token="")
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        self.name = name

    def deployment(self, served_model, pool, base_port: int) -> Deployment:
        config = validate_actuator_config(
            ActuatorKind.PROCESS,
            {"engine": "emulator", "base_port": base_port, "supervisor_url": self.server.url},
        )
        from dataplane.supervisor.supervisor import DeploymentSpec

        self.supervisor.scale(
            self.name, 2, DeploymentSpec("emulator", "127.0.0.1", base_port, 30.0)
        )
        deadline = time.monotonic() + 60
        while self.supervisor.deployment_status(self.name)["ready"] < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"replicas not ready: {self.supervisor.deployment_status(self.name)}"
                )
            time.sleep(0.1)
        return Deployment.objects.create(
            name=self.name,
            served_model=served_model,
            gpu_pool=pool,
            max_replicas=3,
            current_replicas=2,
            actuator_kind=ActuatorKind.PROCESS,
            actuator_config=config,
            priority_scheduling=True,  # its engines run --scheduling-policy priority
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.supervisor.shutdown(drain=False)


def _free_base_port() -> int:
    from tests.dataplane.supervisor.support import free_port_range

    return free_port_range(3)


def _beat(until, *, interval: float) -> int:
    """Probe rounds on beat's grid: one every `interval`, a busy grid point skipped."""
    start = time.monotonic()
    rounds = 0
    while not until():
        probe_round()
        rounds += 1
        elapsed = time.monotonic() - start
        time.sleep(interval - elapsed % interval)
    return rounds


def _serves(url: str) -> bool:
    return probe_endpoint(url, "tiny", timeout_seconds=2).outcome == "ok"


def _hang(deployment, fleet) -> dict:
    interval = settings.HEALTH_PROBE_INTERVAL_SECONDS
    base = deployment.actuator_config["base_port"]
    hung, crashed = f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base}"
    probe_round()  # the fingerprint
    liveness_failures = []

    def liveness():
        while (
            not Incident.objects.filter(ready_at__isnull=False).exists()
            and len(liveness_failures) < 1000
        ):
            try:
                ok = httpx.get(f"{hung}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                ok = False
            liveness_failures.append((timezone.now(), not ok))
            time.sleep(interval)

    injected = timezone.now()
    httpx.post(f"{hung}/emulator/faults", json={"mode": "hang"}, timeout=5)
    checker = threading.Thread(target=liveness, daemon=True)
    checker.start()
    _beat(lambda: Incident.objects.filter(ready_at__isnull=False).exists(), interval=interval)
    checker.join(timeout=10)
    incident = Incident.objects.get()
    steps = {step.step: step.at for step in incident.steps.all()}

    # The floor: a crash, which the supervisor sees and restarts by itself.
    crashed_at = time.monotonic()
    httpx.post(f"{crashed}/emulator/faults", json={"mode": "crash"}, timeout=5)
    time.sleep(0.2)
    while not _serves(crashed):
        time.sleep(0.1)
    crash_to_serving = time.monotonic() - crashed_at
    return {
        "hang_to_serving_s": (incident.ready_at - injected).total_seconds(),
        "detected_s": (steps["detected"] - injected).total_seconds(),
        "restart_requested_s": (steps["restart_requested"] - injected).total_seconds(),
        "crash_to_serving_s": crash_to_serving,
        # Only while the engine hung: the restart stops it, and the check may see that.
        "liveness_detections": sum(
            failed for at, failed in liveness_failures if at < steps["detected"]
        ),
        "liveness_checks": sum(1 for at, _ in liveness_failures if at < steps["detected"]),
    }


def _saturated(deployment) -> dict:
    interval = settings.HEALTH_PROBE_INTERVAL_SECONDS
    timeout = settings.HEALTH_PROBE_TIMEOUT_SECONDS
    failures_to_kill = settings.HEALTH_PROBE_FAILURES
    base = deployment.actuator_config["base_port"]
    urls = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    Incident.objects.all().delete()
    ProbeResult.objects.all().delete()
    naive = {"latencies_ms": [], "false_kills": 0}
    stop = threading.Event()

    def naive_prober(url):
        in_a_row = 0
        while not stop.is_set():
            answer = probe_endpoint(url, "tiny", timeout_seconds=timeout, priority=None)
            naive["latencies_ms"].append(answer.latency_ms or timeout * 1000)
            in_a_row = 0 if answer.outcome == "ok" else in_a_row + 1
            if in_a_row >= failures_to_kill:
                naive["false_kills"] += 1
                in_a_row = 0
            stop.wait(interval)

    waiting = []
    with Saturator(urls, model="tiny", streams_per_url=48, max_tokens=600) as load:
        time.sleep(5)
        threads = [threading.Thread(target=naive_prober, args=(u,), daemon=True) for u in urls]
        for thread in threads:
            thread.start()
        ends = time.monotonic() + SATURATED_SECONDS

        def done():
            waiting.append(min(waiting_requests(u) for u in urls))
            return time.monotonic() >= ends

        rounds = _beat(done, interval=interval)
        stop.set()
        for thread in threads:
            thread.join(timeout=timeout + 5)
    latencies = sorted(
        ProbeResult.objects.exclude(latency_ms=None).values_list("latency_ms", flat=True)
    )
    naive_sorted = sorted(naive["latencies_ms"])
    return {
        "rounds": rounds,
        "probes": ProbeResult.objects.count(),
        "failed_probes": ProbeResult.objects.exclude(outcome="ok").count(),
        "unhealthy": Replica.objects.exclude(state="healthy").count() + Incident.objects.count(),
        "probe_p50_ms": latencies[len(latencies) // 2],
        "probe_p99_ms": latencies[int(0.99 * (len(latencies) - 1))],
        "naive_p50_ms": naive_sorted[len(naive_sorted) // 2],
        "naive_false_kills": naive["false_kills"],
        "min_waiting": min(waiting),
        "completed": load.completed,
    }


def run() -> list[Figure]:
    settings.HEALTH_PROBE_QUIET_SECONDS = 0  # every round probes, even with traffic
    gpu = GpuType.objects.create(name="bench-gpu", memory_gb=80, hourly_cost_usd=2)
    pool = GpuPool.objects.create(name="bench-pool", gpu_type=gpu, gpu_count=8)
    model = ServedModel.objects.create(
        name="bench-tiny", engine_model_id="tiny", parameters_billions=1,
        reference_gpu_type=gpu, context_length_tokens=4096,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        fleet = Fleet(Path(folder), "bench-health")
        try:
            deployment = fleet.deployment(model, pool, _free_base_port())
            hang = _hang(deployment, fleet)
            print(
                f"\nhang: detected {hang['detected_s']:.1f} s, restart requested "
                f"{hang['restart_requested_s']:.1f} s, serving {hang['hang_to_serving_s']:.1f} s "
                f"after the injection; crash → serving {hang['crash_to_serving_s']:.1f} s; "
                f"/health failed {hang['liveness_detections']} of {hang['liveness_checks']} checks"
            )
            Replica.objects.update(state="healthy", consecutive_failures=0)
            saturated = _saturated(deployment)
            print(
                f"saturated {SATURATED_SECONDS:.0f} s: {saturated['rounds']} rounds, "
                f"{saturated['probes']} probes, {saturated['failed_probes']} failed, "
                f"{saturated['unhealthy']} unhealthy; probe p50 "
                f"{saturated['probe_p50_ms']:.0f} ms, p99 {saturated['probe_p99_ms']:.0f} ms; "
                "same probe at the traffic's priority: "
                f"p50 {saturated['naive_p50_ms']:.0f} ms, {saturated['naive_false_kills']} false "
                f"kills; queue ≥ {saturated['min_waiting']:.0f} waiting per replica throughout; "
                f"{saturated['completed']} requests completed"
            )
        finally:
            fleet.close()
    return [
        Figure("hang_to_serving_s", hang["hang_to_serving_s"], "s",
               hang["crash_to_serving_s"], "crash → serving, supervisor's own restart"),
        Figure("hang_liveness_detections", hang["liveness_detections"], "detections",
               1, "inference probes"),
        Figure("saturated_false_unhealthy", saturated["unhealthy"], "replicas",
               saturated["naive_false_kills"], "same probe at the traffic's priority"),
        Figure("saturated_probe_p99_ms", saturated["probe_p99_ms"], "ms",
               saturated["naive_p50_ms"], "p50 of the probe at the traffic's priority"),
    ]  # fmt: skip
