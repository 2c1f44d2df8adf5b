"""Inference probes: is each engine replica really serving? (the reliability loop)

Every HEALTH_PROBE_INTERVAL_SECONDS (Celery beat → `capacity.health_probes` on the `health`
queue) each replica endpoint (capacity.actuation.replicas) gets a minimal completion: a fixed
prompt, temperature 0, a fixed seed and max_tokens, at the highest vLLM priority (so a
saturated engine schedules it first instead of timing it out) when the deployment's engines
run priority scheduling (`Deployment.priority_scheduling`); otherwise without `priority`,
since vLLM answers 400 to a non-zero priority under its default fcfs policy and every probe
would fail. An engine that answers vLLM's 400 to the priority anyway (the setting is on, the
engine runs fcfs) is probed again without it and kept healthy, the probe naming the wrong
setting: restarting it would never help. The answer must match the deployment's
fingerprint, recorded from the first good answer; a different answer means corrupted
weights or a wrong model. A replica whose engine counter shows real requests completing in
the last HEALTH_PROBE_QUIET_SECONDS is not probed, up to HEALTH_PROBE_MAX_SKIP_SECONDS.

After HEALTH_PROBE_FAILURES failures in a row a replica is unhealthy: an Incident opens, the
replica's capacity leaves the next allocation snapshot (which starts a replacement), and the
actuator restarts it. The first good answer afterwards closes the incident as ready. Every
step is an IncidentStep row with its time.

A replica drained for a scale-down (`draining`) that is still listed ready once the
scale-down has settled was kept by the platform and serves again (capacity/actuation/drain.py,
`serve_survivors`); one whose pod terminates is gone.
"""

from __future__ import annotations

import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from capacity.actuation import drain
from capacity.actuation.replicas import Endpoint, Observed, ReplicaError, list_replicas, restart
from capacity.hooks import gateway_state_changed, tick_wanted
from capacity.models import (
    Deployment,
    DeploymentFingerprint,
    Incident,
    IncidentStep,
    ProbeOutcome,
    ProbeResult,
    Replica,
)
from capacity.telemetry import metrics
from core import outbound
from core.db import Lock, exclusive

logger = logging.getLogger(__name__)

PROBE_PROMPT = "Control-plane health probe. Reply with the next words:"
PROBE_MAX_TOKENS = 8
PROBE_SEED = 0
COMPLETIONS_METRIC = "vllm:request_success"  # counter; exposed as ..._total
RUNNING_METRIC = "vllm:num_requests_running"  # gauge: requests in the engine's batch now
MAX_PROBE_THREADS = 32


@dataclass
class ProbeAnswer:
    outcome: str
    latency_ms: float | None = None
    text: str = ""
    detail: str = ""


@dataclass
class RoundResult:
    probed: int = 0
    skipped: int = 0
    failed: int = 0
    marked_unhealthy: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped_round: bool = False


_DEFAULT = object()


def probe_body(engine_model_id: str, priority=_DEFAULT) -> dict:
    body = {
        "model": engine_model_id,
        "prompt": PROBE_PROMPT,
        "max_tokens": PROBE_MAX_TOKENS,
        "temperature": 0,
        "seed": PROBE_SEED,
    }
    priority = settings.HEALTH_PROBE_PRIORITY if priority is _DEFAULT else priority
    if priority is not None:
        body["priority"] = priority
    return body


def probe_endpoint(
    url: str, engine_model_id: str, *, timeout_seconds: float, priority=_DEFAULT
) -> ProbeAnswer:
    """One end-to-end completion against an engine; never raises. `priority=None` sends the
    probe without one (the engine's default, as a naive liveness check would)."""
    started = time.perf_counter()
    try:
        # Through the guarded client: replicas' addresses come from the data plane (pod IPs,
        # a supervisor's answer), so they are checked against OUTBOUND_ALLOWED_HOSTS too.
        response = outbound.request(
            "POST",
            f"{url}/v1/completions",
            json=probe_body(engine_model_id, priority),
            timeout=timeout_seconds,
        )
    except httpx.TimeoutException:
        return ProbeAnswer(ProbeOutcome.TIMEOUT, detail=f"no answer within {timeout_seconds:g} s")
    except httpx.HTTPError as error:
        return ProbeAnswer(ProbeOutcome.ERROR, detail=f"{type(error).__name__}: {error}")
    latency_ms = (time.perf_counter() - started) * 1000.0
    if response.status_code != 200:
        return ProbeAnswer(
            ProbeOutcome.ERROR,
            latency_ms,
            detail=f"HTTP {response.status_code}: {response.text[:300]}",
        )
    try:
        text = response.json()["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return ProbeAnswer(ProbeOutcome.ERROR, latency_ms, detail="not a completion response")
    if not isinstance(text, str):
        return ProbeAnswer(ProbeOutcome.ERROR, latency_ms, detail="the completion has no text")
    return ProbeAnswer(ProbeOutcome.OK, latency_ms, text=text)


def engine_counters(url: str, *, timeout_seconds: float) -> tuple[float | None, float | None]:
    """The engine's count of finished requests and its requests running now, from its own
    /metrics (one read); None where unknown."""
    try:
        response = outbound.request("GET", f"{url}/metrics", timeout=timeout_seconds)
        if response.status_code != 200:
            return None, None
        total = running = None
        for family in text_string_to_metric_families(response.text):
            if family.name == COMPLETIONS_METRIC:
                total = sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif family.name == RUNNING_METRIC:
                running = sum(s.value for s in family.samples)
        return total, running
    except (httpx.HTTPError, ValueError):
        return None, None


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class _Check:
    replica: Replica
    endpoint: Endpoint
    engine_model_id: str
    completions: float | None = None
    running: float | None = None
    answer: ProbeAnswer | None = None
    answered_at: datetime | None = None  # when the probe's outcome was known


def _check(check: _Check, now: datetime) -> _Check:
    """Runs on a worker thread: reads the engine counter, then probes unless it may skip."""
    timeout = settings.HEALTH_PROBE_TIMEOUT_SECONDS
    replica = check.replica
    check.completions, check.running = engine_counters(
        check.endpoint.url, timeout_seconds=min(timeout, 2.0)
    )
    moved = (
        check.completions is not None
        and replica.completions_total is not None
        and check.completions > replica.completions_total
    )
    recently_probed = replica.last_ok_at is not None and (now - replica.last_ok_at) < timedelta(
        seconds=settings.HEALTH_PROBE_MAX_SKIP_SECONDS
    )
    last_moved = now if moved else replica.completions_moved_at
    recent_traffic = last_moved is not None and now - last_moved < timedelta(
        seconds=settings.HEALTH_PROBE_QUIET_SECONDS
    )
    if (
        recent_traffic
        and recently_probed
        and replica.state == Replica.State.HEALTHY
        and replica.consecutive_failures == 0
    ):
        check.answer = ProbeAnswer(ProbeOutcome.SKIPPED, detail="real requests completed")
        return check
    with_priority = check.replica.deployment.priority_scheduling
    answer = probe_endpoint(
        check.endpoint.url,
        check.engine_model_id,
        timeout_seconds=timeout,
        priority=_DEFAULT if with_priority else None,
    )
    if with_priority and _refuses_priority(answer):
        # The deployment says priority scheduling and its engine runs fcfs: vLLM's 400, on
        # every probe and every prioritised request. That is a wrong setting, not a sick
        # engine; restarting it would loop forever. Probe as fcfs and say what to fix.
        answer = probe_endpoint(
            check.endpoint.url, check.engine_model_id, timeout_seconds=timeout, priority=None
        )
        answer.detail = (
            f"{MISCONFIGURED_PRIORITY} {answer.detail}".strip()
            if answer.outcome == ProbeOutcome.OK
            else answer.detail
        )
        logger.warning(
            "health: %s answered 400 to a priority: %s", check.replica, MISCONFIGURED_PRIORITY
        )
    check.answer = answer
    check.answered_at = timezone.now()
    return check


MISCONFIGURED_PRIORITY = (
    "The engine refuses priorities (vLLM started without --scheduling-policy priority) while "
    "the deployment's priority_scheduling is on: turn it off, or restart the engine with "
    "priority scheduling."
)


def _refuses_priority(answer: ProbeAnswer) -> bool:
    return answer.outcome == ProbeOutcome.ERROR and (
        answer.detail.startswith("HTTP 400")
        and "Priority scheduling is not enabled" in answer.detail
    )


def probe_round(*, now: datetime | None = None) -> RoundResult:
    """Probe every replica of every deployment once, and act on what is found."""
    result = RoundResult()
    with exclusive(Lock.HEALTH_PROBES, timeout_seconds=300) as taken:
        if not taken:
            result.skipped_round = True
            return result
        now = now or timezone.now()
        ready_before = _ready_replicas()
        checks = []
        deployments = list(Deployment.objects.select_related("served_model").order_by("pk"))
        for deployment in deployments:
            try:
                endpoints, observed = list_replicas(deployment)
            except (ReplicaError, Exception) as error:  # noqa: BLE001 - one bad deployment
                result.errors.append(f"{deployment.name}: {error}")
                logger.warning("health: cannot list replicas of %s: %s", deployment.name, error)
                continue
            _store_observed(deployment, observed, now)
            listed = _sync_replicas(deployment, endpoints, now)
            checks.extend(listed)
            kept = {c.replica.key for c in listed if c.replica.state == Replica.State.DRAINING}
            if kept and observed is not None:
                # Drained for a scale-down, still ready: once it settled, one the platform
                # kept, serving again (capacity/actuation/drain.py).
                drain.serve_survivors(
                    deployment, listed_ready=kept, ready_replicas=observed.ready, now=now
                )
        if checks:
            with ThreadPoolExecutor(max_workers=min(MAX_PROBE_THREADS, len(checks))) as pool:
                done = list(pool.map(lambda c: _check(c, now), checks))
            for check in done:
                _record(check, now, result)
        ProbeResult.objects.filter(
            at__lt=now - timedelta(hours=settings.HEALTH_PROBE_HISTORY_HOURS)
        ).delete()
        if _ready_replicas() != ready_before:
            # Gateways route only to ready replicas: tell them now, not at the next tick; and
            # tick now, so admission lends the capacity that became ready (or stops lending
            # what went away) without waiting for the beat.
            gateway_state_changed("ready replicas changed")
            transaction.on_commit(
                lambda: tick_wanted(reason="ready replicas changed", debounce=False)
            )
    return result


def _store_observed(deployment: Deployment, observed: Observed | None, now: datetime) -> None:
    """What the data plane reports running, for the allocation snapshot's readiness (a
    replica the actuator was asked for counts as ready only once it is observed ready)."""
    if observed is None:
        return
    Deployment.objects.filter(pk=deployment.pk).update(
        observed_ready_replicas=observed.ready,
        observed_starting_replicas=observed.starting,
        observed_draining_replicas=observed.draining,
        replicas_observed_at=now,
    )


def _ready_replicas() -> set[tuple[int, str]]:
    """What gateways route to (capacity.publication): healthy replicas that answered."""
    return set(
        Replica.objects.filter(state=Replica.State.HEALTHY, last_ok_at__isnull=False).values_list(
            "deployment_id", "url"
        )
    )


def _sync_replicas(
    deployment: Deployment, endpoints: list[Endpoint], now: datetime
) -> list[_Check]:
    """Replica rows for what runs now. A healthy replica no longer listed is gone. An
    unhealthy one is being restarted: a pod comes back under a new name (so the old one is
    gone, and its incident waits for a replacement that serves), a process or an endpoint
    under the same key (so it is kept, for at most HEALTH_UNLISTED_GONE_SECONDS)."""
    existing = {replica.key: replica for replica in deployment.replicas.all()}
    listed = {endpoint.key for endpoint in endpoints}
    checks = []
    for endpoint in endpoints:
        replica = existing.get(endpoint.key)
        if replica is None:
            replica = Replica.objects.create(
                deployment=deployment, key=endpoint.key, url=endpoint.url
            )
        elif replica.url != endpoint.url or replica.state == Replica.State.GONE:
            replica.url = endpoint.url
            if replica.state == Replica.State.GONE:
                replica.state = Replica.State.HEALTHY
                replica.consecutive_failures = 0
                replica.failing_since = None
            replica.save(
                update_fields=[
                    "url",
                    "state",
                    "consecutive_failures",
                    "failing_since",
                    "updated_at",
                ]
            )
        replica.deployment = deployment
        checks.append(_Check(replica, endpoint, deployment.served_model.engine_model_id))
    Replica.objects.filter(
        deployment=deployment, state__in=[Replica.State.HEALTHY, Replica.State.DRAINING]
    ).exclude(key__in=listed).update(
        state=Replica.State.GONE, consecutive_failures=0, failing_since=None, updated_at=now
    )
    give_up = timedelta(seconds=settings.HEALTH_UNLISTED_GONE_SECONDS)
    for replica in existing.values():
        if replica.key in listed or replica.state != Replica.State.UNHEALTHY:
            continue
        in_place = not replica.key.startswith("pod:")
        if in_place and replica.unhealthy_since and now - replica.unhealthy_since < give_up:
            continue
        replica.state = Replica.State.GONE
        replica.save(update_fields=["state", "updated_at"])
        if in_place:
            # Restarted in place but never listed again (scaled away, or never came back).
            incident = Incident.objects.filter(replica=replica, ended_at__isnull=True).first()
            if incident is not None:
                incident.ended_at = now
                incident.save(update_fields=["ended_at"])
                IncidentStep.objects.create(
                    incident=incident,
                    step=IncidentStep.Step.GONE,
                    at=now,
                    detail="no longer listed by the data plane",
                )
    return checks


def _compare_with_fingerprint(check: _Check, now: datetime) -> ProbeAnswer:
    answer = check.answer
    deployment = check.replica.deployment
    fingerprint = DeploymentFingerprint.objects.filter(deployment=deployment).first()
    if fingerprint is None:
        # The first good answer is the reference: a deployment is assumed good when first
        # probed. Planners reset it after a model change (admin, or the API).
        DeploymentFingerprint.objects.create(
            deployment=deployment,
            prompt=PROBE_PROMPT,
            answer=answer.text,
            answer_sha256=_sha256(answer.text),
            recorded_at=now,
            recorded_from=check.replica.key,
        )
        return answer
    if _sha256(answer.text) != fingerprint.answer_sha256:
        return ProbeAnswer(
            ProbeOutcome.WRONG_OUTPUT,
            answer.latency_ms,
            text=answer.text,
            detail=f"answered {answer.text[:80]!r}; known good: {fingerprint.answer[:80]!r}",
        )
    return answer


@transaction.atomic
def _record(check: _Check, now: datetime, result: RoundResult) -> None:
    """`now` is when the round started (the probe's time); the replica's state changes at
    the moment the outcome was known, so incidents time detection and readiness truly."""
    replica = Replica.objects.select_for_update().get(pk=check.replica.pk)
    known_at = check.answered_at or now
    answer = check.answer
    if answer.outcome == ProbeOutcome.OK:
        answer = _compare_with_fingerprint(check, now)
    if check.completions is not None:
        if replica.completions_total is None or check.completions != replica.completions_total:
            replica.completions_moved_at = now
        replica.completions_total = check.completions
    replica.running_requests = check.running
    metrics.HEALTH_PROBES.labels(answer.outcome).inc()
    if answer.outcome == ProbeOutcome.SKIPPED:
        result.skipped += 1
        replica.save(
            update_fields=[
                "completions_total",
                "completions_moved_at",
                "running_requests",
                "updated_at",
            ]
        )
        return
    result.probed += 1
    ProbeResult.objects.create(
        replica=replica,
        at=now,
        outcome=answer.outcome,
        latency_ms=answer.latency_ms,
        detail=answer.detail,
    )
    replica.last_probe_at = now
    replica.last_latency_ms = answer.latency_ms
    if answer.outcome == ProbeOutcome.OK:
        replica.last_ok_at = now
        replica.consecutive_failures = 0
        replica.failing_since = None
        replica.last_error = ""
        if replica.state == Replica.State.UNHEALTHY:
            _recovered(replica, known_at, result)
        _close_replaced(replica, known_at, result)
        replica.save()
        return
    result.failed += 1
    replica.consecutive_failures += 1
    replica.last_error = f"{answer.outcome}: {answer.detail}"
    if replica.failing_since is None:
        replica.failing_since = known_at
    if (
        replica.state == Replica.State.HEALTHY
        and replica.consecutive_failures >= settings.HEALTH_PROBE_FAILURES
    ):
        _mark_unhealthy(replica, answer, known_at, result)
    elif replica.state == Replica.State.UNHEALTHY:
        _retry_restart(replica, known_at)
    replica.save()


def _mark_unhealthy(replica: Replica, answer: ProbeAnswer, now: datetime, result) -> None:
    replica.state = Replica.State.UNHEALTHY
    replica.unhealthy_since = now
    incident = Incident.objects.create(
        replica=replica,
        deployment_id=replica.deployment_id,
        cause=answer.outcome,
        detail=answer.detail,
        detected_at=now,
    )
    IncidentStep.objects.bulk_create(
        [
            IncidentStep(
                incident=incident,
                step=IncidentStep.Step.FIRST_FAILURE,
                at=replica.failing_since or now,
                detail=replica.last_error,
            ),
            IncidentStep(
                incident=incident,
                step=IncidentStep.Step.DETECTED,
                at=now,
                detail=f"{replica.consecutive_failures} failed probes in a row",
            ),
        ]
    )
    metrics.HEALTH_INCIDENTS.labels(answer.outcome).inc()
    result.marked_unhealthy.append(str(replica))
    logger.warning("health: %s is unhealthy (%s)", replica, replica.last_error)
    _request_restart(replica, incident)


def _request_restart(replica: Replica, incident: Incident) -> None:
    # The actuator call is made inside the row lock on purpose: two probe rounds never race
    # to restart one replica (the round lock already prevents it; this is belt and braces).
    try:
        done = restart(replica.deployment, replica.key)
    except (ReplicaError, Exception) as error:  # noqa: BLE001 - recorded, retried later
        at = timezone.now()
        incident.restart_error = str(error)
        incident.save(update_fields=["restart_error"])
        IncidentStep.objects.create(
            incident=incident, step=IncidentStep.Step.RESTART_FAILED, at=at, detail=str(error)
        )
        logger.warning("health: restarting %s failed: %s", replica, error)
        return
    at = timezone.now()
    incident.restart_requested_at = at
    incident.save(update_fields=["restart_requested_at"])
    IncidentStep.objects.create(
        incident=incident, step=IncidentStep.Step.RESTART_REQUESTED, at=at, detail=done
    )


def _retry_restart(replica: Replica, now: datetime) -> None:
    """Still failing after a restart (or after a failed one): try again, at most every
    HEALTH_RESTART_RETRY_SECONDS."""
    incident = Incident.objects.filter(replica=replica, ended_at__isnull=True).first()
    if incident is None:
        return
    last = (
        incident.steps.filter(
            step__in=[IncidentStep.Step.RESTART_REQUESTED, IncidentStep.Step.RESTART_FAILED]
        )
        .order_by("-at")
        .first()
    )
    retry_after = timedelta(seconds=settings.HEALTH_RESTART_RETRY_SECONDS)
    # Step times are wall-clock times (timezone.now()), so they are compared with one.
    if last is None or timezone.now() - last.at >= retry_after:
        _request_restart(replica, incident)


def _recovered(replica: Replica, now: datetime, result) -> None:
    replica.state = Replica.State.HEALTHY
    replica.unhealthy_since = None
    incident = Incident.objects.filter(replica=replica, ended_at__isnull=True).first()
    if incident is not None:
        incident.ready_at = incident.ended_at = now
        incident.save(update_fields=["ready_at", "ended_at"])
        IncidentStep.objects.create(
            incident=incident,
            step=IncidentStep.Step.READY,
            at=now,
            detail=f"answered as known good in {replica.last_latency_ms or 0:.0f} ms",
        )
        metrics.HEALTH_SECONDS_TO_READY.observe(incident.seconds_to_ready or 0.0)
    result.recovered.append(str(replica))
    logger.info("health: %s serves again", replica)


def _close_replaced(replica: Replica, now: datetime, result) -> None:
    """A replica first seen after a gone replica's restart, now serving, replaced it."""
    for incident in Incident.objects.filter(
        deployment_id=replica.deployment_id,
        ended_at__isnull=True,
        replica__state=Replica.State.GONE,
        restart_requested_at__lte=replica.first_seen_at,
    ).select_related("replica")[:1]:
        incident.ready_at = incident.ended_at = now
        incident.save(update_fields=["ready_at", "ended_at"])
        IncidentStep.objects.create(
            incident=incident,
            step=IncidentStep.Step.REPLACED,
            at=now,
            detail=f"{replica.key} serves in its place",
        )
        metrics.HEALTH_SECONDS_TO_READY.observe(incident.seconds_to_ready or 0.0)
        result.recovered.append(str(incident.replica))


def unhealthy_replicas_by_deployment() -> dict[int, int]:
    """How many replicas of each deployment are unhealthy now (the allocation snapshot)."""
    return dict(
        Replica.objects.filter(state=Replica.State.UNHEALTHY)
        .values("deployment_id")
        .annotate(n=Count("id"))
        .values_list("deployment_id", "n")
    )
