"""The gateway's acceptance, end to end with real processes: two emulator replicas run by the
real process supervisor, the allocation tick run every 2 s by a Celery worker fed by Celery
beat (the contract the gateway reads is the one that worker published), the control plane's
API in gunicorn on the test database, and the gateway.

N requests (streamed, non-streamed, refused, cancelled and timed out) leave exactly N usage
events with the outcome each had, also when the API was stopped for 30 s in the middle: the
gateway keeps serving, spools the events in Redis and delivers each once when the API is back.
Completed events carry the engine's own token counts; cancelled and timed-out ones at most
what the engines generated for them (the last usage chunk never arrives).
"""

import json
import re
import time

import httpx
import pytest
import redis
from django.conf import settings
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from accounts import scopes as S
from capacity.actuation.config import validate_actuator_config
from capacity.allocation.tick import allocation_tick
from capacity.health.probes import probe_round
from capacity.models import ActuatorKind, Replica, UsageEvent
from capacity.selling.entitlements import entitlements_set
from capacity.selling.reservations import reservation_create
from tests.dataplane.supervisor.support import (  # noqa: F401 - fixtures
    emulator_command,
    engines,
    free_port_range,
    http_supervisor,
    supervisor,
    wait_until,
)
from tests.support.processes import celery_beat_process, celery_worker_process, free_port

from .conftest import gateway_process, wait_for
from .control_plane import cancel_mid_stream, complete, control_plane

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgresql_only,
    pytest.mark.slow(seconds=70),
]

OUTAGE_SECONDS = 30
TICK_EVERY_SECONDS = 2
TOKEN_TIMEOUT_SECONDS = 1
# The slow fault makes a 2 ms step take 2 s: twice the gateway's per-token timeout.
SLOW_FACTOR = 1000
# Cancelled and timed-out answers: long enough to leave after the first token (2 ms steps),
# short enough that acme stays within its reservation (~3.4 MU each, estimated at max_tokens).
LONG_TOKENS = 100
# A round of the mix takes at least this long: about 4 MU every 3 s against 150 MU/min.
ROUND_SECONDS = 3.0
GW_DOCUMENTS = ("gw:v1:keys", "gw:v1:models", "gw:v1:entitlements", "gw:v1:customers",
                "gw:v1:meta")  # fmt: skip
SPOOL = "gw:v1:spool"


@pytest.fixture
def fleet(
    sellable,
    served_model,
    acme,
    globex,
    make_key,
    http_supervisor,  # noqa: F811
    monkeypatch,
):
    """llama-8b on two emulator replicas of the process supervisor, found healthy by a probe
    round; acme holds 150 MU/min, globex nothing; both may use the model, which lends no
    best-effort capacity."""
    monkeypatch.setenv("MU_ACTUATOR_SUPERVISOR_TOKEN", "s3cret-token")  # http_supervisor's
    served_model.engine_model_id = "tiny"  # what the supervisor's emulator serves
    # No best-effort capacity at all (the planners' ceiling): globex, allowed on the model
    # but without a reservation, is refused every time.
    served_model.best_effort_ceiling_mu_per_minute = 0.0
    served_model.save()
    deployment = served_model.deployments.get()
    deployment.actuator_kind = ActuatorKind.PROCESS
    deployment.actuator_config = validate_actuator_config(
        ActuatorKind.PROCESS,
        {
            "engine": "emulator",
            "base_port": free_port_range(3),
            "supervisor_url": http_supervisor.url,
            "drain_seconds": 1,
            "token_env": "MU_ACTUATOR_SUPERVISOR_TOKEN",
        },
    )
    deployment.min_replicas = deployment.max_replicas = 2
    deployment.save()
    for customer in (acme, globex):
        entitlements_set(customer=customer, served_models=[served_model], actor="test")
    reservation_create(customer=acme, served_model=served_model, mu_per_minute=150, actor="test")
    assert allocation_tick().applied == 1  # starts the two replicas
    running = http_supervisor.supervisor
    wait_until(
        lambda: running.deployment_status(deployment.name)["ready"] == 2,
        what="two ready replicas",
    )
    assert probe_round().probed == 2
    assert Replica.objects.filter(state=Replica.State.HEALTHY).count() == 2
    status = running.deployment_status(deployment.name)
    replicas = [f"http://127.0.0.1:{replica['port']}" for replica in status["replicas"]]
    _, acme_key = make_key(customer=acme, scopes=[S.READ, S.ADMISSION])
    _, globex_key = make_key(customer=globex, scopes=[S.READ, S.ADMISSION])
    _, service_key = make_key(service_name="gateway", scopes=[S.USAGE_WRITE])
    return {"acme": acme_key, "globex": globex_key, "service": service_key,
            "model": served_model.name, "replicas": replicas}  # fmt: skip


def ticks_every(seconds: int) -> None:
    """The allocation tick as `setup_periodic_tasks` schedules it, at a test's pace."""
    interval, _ = IntervalSchedule.objects.get_or_create(
        every=seconds, period=IntervalSchedule.SECONDS
    )
    PeriodicTask.objects.create(
        name="allocation: tick (test)",
        task="capacity.allocation_tick",
        interval=interval,
        queue="allocation",
        expire_seconds=seconds,
    )


def generation_tokens(replicas: list[str]) -> tuple[int, int]:
    """(prompt, generated) tokens over the replicas, from vLLM's counters on their /metrics."""
    totals = {"prompt": 0, "generation": 0}
    for url in replicas:
        text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
        for kind in totals:
            match = re.search(rf"^vllm:{kind}_tokens_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
            assert match, f"no vllm:{kind}_tokens_total on {url}"
            totals[kind] += int(float(match.group(1)))
    return totals["prompt"], totals["generation"]


# How often a stream is tried until its engines stall before it ends: the faults are posted
# once its first token arrived, and under load its 100 tokens (200 ms) may all be out by then.
STALL_ATTEMPTS = 3


def timed_out_mid_stream(
    gateway_url: str, key: str, model: str, replicas: list[str]
) -> list[tuple[str, str, dict | None]]:
    """A stream whose engines stall after its first token: the gateway's per-token timeout
    ends it with an error event. Returns (request id, outcome, usage) of every stream tried:
    one that ended before the stall reached its engines is a completed request (its usage as
    the engine reported it), and another is tried."""
    body = {"model": model, "messages": [{"role": "user", "content": "then it stalls"}],
            "max_tokens": LONG_TOKENS, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tried: list[tuple[str, str, dict | None]] = []
    with httpx.Client(timeout=30, trust_env=False) as client:
        for _ in range(STALL_ATTEMPTS):
            with client.stream(
                "POST", gateway_url + "/v1/chat/completions", json=body,
                headers={"Authorization": f"Bearer {key}"},
            ) as response:  # fmt: skip
                assert response.status_code == 200
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                for url in replicas:
                    fault = {"mode": "slow", "factor": SLOW_FACTOR, "duration_seconds": 10}
                    client.post(url + "/emulator/faults", json=fault).raise_for_status()
                rest = list(lines)
                request_id = response.headers["x-request-id"]
            for url in replicas:
                client.post(url + "/emulator/faults", json={"mode": "none"}).raise_for_status()
            chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
            errors = [chunk for chunk in chunks if "error" in chunk]
            if errors:
                message = errors[0]["error"]["message"]
                assert f"no token within {TOKEN_TIMEOUT_SECONDS}" in message, message
                tried.append((request_id, "error", None))
                return tried
            usage = next(chunk["usage"] for chunk in chunks if chunk.get("usage"))
            tried.append((request_id, "completed", usage))
    raise AssertionError(f"{STALL_ATTEMPTS} streams ended before their engines stalled")


def test_n_requests_leave_n_events_with_their_outcomes_across_a_30_s_api_outage(
    fleet, tmp_path, capsys
):
    rds = redis.Redis.from_url(settings.ADMISSION_REDIS_URL)
    # The gateway must read what the Celery worker publishes, not what the fixture's tick did.
    rds.delete(*GW_DOCUMENTS, SPOOL)
    ticks_every(TICK_EVERY_SECONDS)
    expected: dict[str, tuple[str, dict | None]] = {}  # request id -> (outcome, usage seen)

    def send_mix(client, gateway_url: str, *, with_timeout: bool) -> None:
        began = time.monotonic()
        for stream in (False, True):
            rid, status, usage = complete(
                client, gateway_url, fleet["acme"], fleet["model"], stream=stream
            )
            assert status == 200, status
            expected[rid] = ("completed", usage)
        rid, status, _ = complete(client, gateway_url, fleet["globex"], fleet["model"], stream=True)
        assert status == 429, status
        expected[rid] = ("refused", None)
        expected[cancel_mid_stream(gateway_url, fleet["acme"], fleet["model"], LONG_TOKENS)] = (
            "cancelled",
            None,
        )
        if with_timeout:
            replicas = fleet["replicas"]
            for rid, outcome, usage in timed_out_mid_stream(
                gateway_url, fleet["acme"], fleet["model"], replicas
            ):
                expected[rid] = (outcome, usage)
        time.sleep(max(0.0, ROUND_SECONDS - (time.monotonic() - began)))

    port = free_port()
    with celery_worker_process(tmp_path, queues="allocation"), celery_beat_process(tmp_path):
        models = wait_for(lambda: rds.hget("gw:v1:models", fleet["model"]), timeout_seconds=30)
        assert len(json.loads(models)["replicas"]) == 2
        prompt_before, generated_before = generation_tokens(fleet["replicas"])
        with gateway_process(
            tmp_path,
            GATEWAY_CONTROL_PLANE_URL=f"http://127.0.0.1:{port}",
            GATEWAY_SERVICE_KEY=fleet["service"],
            GATEWAY_REDIS_URL=settings.ADMISSION_REDIS_URL,
            GATEWAY_TOKEN_TIMEOUT_SECONDS=str(TOKEN_TIMEOUT_SECONDS),
        ) as gateway, httpx.Client(timeout=30, trust_env=False) as client:  # fmt: skip
            with control_plane(tmp_path, port):
                send_mix(client, gateway.url, with_timeout=True)
                wait_for(lambda: UsageEvent.objects.count() == len(expected), timeout_seconds=20)
            # The API is down for OUTAGE_SECONDS while traffic goes on.
            before_outage = len(expected)
            version_before = int(rds.hget("gw:v1:meta", "version"))
            outage_began = time.monotonic()
            rounds = 0
            while time.monotonic() - outage_began < OUTAGE_SECONDS:
                send_mix(client, gateway.url, with_timeout=rounds == 0)
                rounds += 1
            wait_for(lambda: rds.xlen(SPOOL) > 0, timeout_seconds=5)
            spooled = sum(len(json.loads(f[b"events"])) for _, f in rds.xrange(SPOOL))
            with capsys.disabled():
                print(
                    f"\nAPI down {time.monotonic() - outage_began:.0f} s: "
                    f"{len(expected) - before_outage} requests in {rounds} rounds; spool depth "
                    f"{rds.xlen(SPOOL)} batch(es), {spooled} event(s)"
                )
            assert UsageEvent.objects.count() == before_outage
            # Celery went on ticking and publishing while the web server was down.
            assert int(rds.hget("gw:v1:meta", "version")) > version_before
            with control_plane(tmp_path, port):
                send_mix(client, gateway.url, with_timeout=True)
                wait_for(lambda: UsageEvent.objects.count() == len(expected), timeout_seconds=60)
                wait_for(lambda: rds.xlen(SPOOL) == 0, timeout_seconds=10)
                time.sleep(1.5)  # a redelivery would show up as a second row by now: none does
        prompt_after, generated_after = generation_tokens(fleet["replicas"])

    events = {e.event_id: e for e in UsageEvent.objects.all()}
    assert len(events) == UsageEvent.objects.count() == len(expected)
    assert set(events) == set(expected)
    outcomes = {}
    for request_id, (outcome, usage) in expected.items():
        event = events[request_id]
        assert event.outcome == outcome, (request_id, event.outcome, outcome)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome == "completed":
            # The engine's own counts, as it reported them to the client.
            assert (event.input_tokens, event.output_tokens) == (
                usage["prompt_tokens"],
                usage["completion_tokens"],
            )
            assert event.admission_class == "guaranteed" and event.verification == "recorded"
        elif outcome == "refused":
            assert event.mu == 0 and event.estimated_mu > 0
        elif outcome == "cancelled":
            # Some tokens; all of them when the engine finished before the client's leaving
            # reached it (a loaded machine), which the sum below still bounds.
            assert 1 <= event.output_tokens <= LONG_TOKENS, (outcome, event.output_tokens)
        else:  # timed out: the engines stalled, so some tokens, never the whole answer
            assert 1 <= event.output_tokens < LONG_TOKENS, (outcome, event.output_tokens)
    assert outcomes["error"] == 3 and outcomes["cancelled"] >= 10, outcomes
    # No probe ran meanwhile (no health worker): the engines generated for these requests
    # only. Completed requests are counted exactly; the others at most what was generated.
    generated = generated_after - generated_before
    completed = sum(e.output_tokens for e in events.values() if e.outcome == "completed")
    unfinished = sum(
        e.output_tokens for e in events.values() if e.outcome in ("cancelled", "error")
    )
    assert completed + unfinished <= generated
    with capsys.disabled():
        print(
            f"events by outcome {outcomes}; engine tokens generated {generated}, prompt "
            f"{prompt_after - prompt_before}; events: completed {completed} + unfinished "
            f"{unfinished} output tokens"
        )
