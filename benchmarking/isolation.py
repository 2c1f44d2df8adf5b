"""A benchmark measures replicas that serve no customer traffic (issue 21).

Chosen: the run **holds extra replicas** (`Deployment.benchmark_held_replicas`) rather than
borrowing ones that serve customers. The tick adds the held count to the deployment's target
(capacity/allocation/snapshot.py `with_holds`) and plans customers' capacity without them, so
customers keep what the policy gives them, a deployment at zero gets its benchmark replicas
started for the run (and stopped after), and drift correction never scales them away. Taking
replicas out of rotation instead would shrink the customers' capacity during the run and
could not benchmark a deployment at zero. docs/benchmarking.md says the same.

Once held replicas serve, the run takes the lowest-numbered ones not yet taken (`process:0`
first: the supervisor removes the highest indices on a scale-down, a ReplicaSet the pods the
drain marks, never a held one), marks them `held_by_benchmark_run_id`, and republishes the
gateways' documents, which leave held replicas out of every model's rotation. It waits for
the requests customers had in flight on them to end (the engine's own running count), then
measures only those endpoints. At the end, in all cases, the replicas return to the rotation
and the hold is released, so the next tick scales the extra ones away.

Only deployments whose replicas can be told apart can be isolated: the process supervisor,
and Kubernetes with a `pod_selector`. An endpoint-only deployment (a webhook, a Kubernetes
Service) is refused with a clear error: benchmark one replica's own URL instead.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Greatest
from django.utils import timezone

from capacity.allocation.tick import allocation_tick
from capacity.allocation.wake import request_tick
from capacity.health.probes import engine_counters
from capacity.models import ActuatorKind, AllocationDecision, Deployment, Replica
from capacity.publication.publish import publish_gateway_state
from core.audit import audit_record
from core.errors import DomainError

logger = logging.getLogger(__name__)

# How long customers' requests already on a taken replica may take to end before measuring.
QUIESCE_SECONDS = 30.0
# At least this long after the republication before measuring: a gateway re-reads its
# documents every GATEWAY_REFRESH_SECONDS (1 s by default), and may route one more request
# to the taken replica until it does.
GATEWAY_REFRESH_GRACE_SECONDS = 2.0
# ... and the replicas' engines must have counted no request for this long.
IDLE_SECONDS = 1.0
_INDEX = re.compile(r"(\d+)$")


class IsolationError(Exception):
    """The held replicas did not come up in time; the message says what was seen."""


def isolation_refusal(deployment: Deployment) -> str:
    """Why this deployment's replicas cannot be benchmarked apart from customers, or ""."""
    config = deployment.actuator_config if isinstance(deployment.actuator_config, dict) else {}
    if deployment.actuator_kind == ActuatorKind.PROCESS:
        return ""
    if deployment.actuator_kind == ActuatorKind.KUBERNETES and config.get("pod_selector"):
        return ""
    kind = deployment.actuator_kind
    if kind == ActuatorKind.KUBERNETES:
        kind = "kubernetes without pod_selector"
    return (
        f"deployment {deployment.name}'s replicas cannot be told apart (actuator kind {kind}): "
        "a benchmark would share its endpoint with customers' traffic. Benchmark one "
        "replica's own endpoint_url without a deployment, or give the deployment a "
        "pod_selector."
    )


def _order(replica: Replica) -> tuple[int, str]:
    match = _INDEX.search(replica.key)
    return (int(match.group(1)) if match else 1 << 30, replica.key)


@transaction.atomic
def hold(*, run_id: int, deployment_id: int, replicas: int) -> None:
    Deployment.objects.filter(pk=deployment_id).update(
        benchmark_held_replicas=F("benchmark_held_replicas") + replicas
    )
    deployment = Deployment.objects.get(pk=deployment_id)
    audit_record(
        actor=f"system:benchmark run {run_id}",
        action="deployment.benchmark_hold",
        obj=deployment,
        after={"benchmark_held_replicas": deployment.benchmark_held_replicas},
        reason=f"{replicas} replica(s) held for benchmark run {run_id}",
    )
    # The tick that starts them now, not at the next beat.
    transaction.on_commit(lambda: request_tick(reason="benchmark hold", debounce=False))


@transaction.atomic
def release(*, run_id: int, deployment_id: int, replicas: int) -> None:
    """Give the replicas back and drop the hold; safe to call twice (the reaper may too)."""
    returned = Replica.objects.filter(held_by_benchmark_run_id=run_id).update(
        held_by_benchmark_run_id=None
    )
    released = Deployment.objects.filter(pk=deployment_id).update(
        benchmark_held_replicas=Greatest(F("benchmark_held_replicas") - replicas, 0)
    )
    if released:
        audit_record(
            actor=f"system:benchmark run {run_id}",
            action="deployment.benchmark_release",
            obj=Deployment.objects.get(pk=deployment_id),
            after={"returned_to_rotation": returned},
            reason=f"benchmark run {run_id} ended",
        )
    transaction.on_commit(lambda: publish_gateway_state(reason="benchmark replicas released"))
    transaction.on_commit(lambda: request_tick(reason="benchmark release", debounce=False))


def _take(run_id: int, deployment_id: int, replicas: int, held_at) -> list[Replica]:
    """The run's replicas, taking more once a tick has planned the hold and every replica
    of that plan serves (before, a free replica may be one customers still need)."""
    with transaction.atomic():
        mine = list(Replica.objects.filter(held_by_benchmark_run_id=run_id))
        wanted = replicas - len(mine)
        if wanted <= 0:
            return sorted(mine, key=_order)
        planned = (
            AllocationDecision.objects.filter(deployment_id=deployment_id, created_at__gte=held_at)
            .order_by("-created_at", "-id")
            .first()
        )
        if planned is None or "benchmark_hold" not in {r.get("code") for r in planned.reasons}:
            return sorted(mine, key=_order)
        free = list(
            Replica.objects.select_for_update().filter(
                deployment_id=deployment_id,
                state=Replica.State.HEALTHY,
                last_ok_at__isnull=False,
                held_by_benchmark_run_id__isnull=True,
            )
        )
        others_held = Replica.objects.filter(
            deployment_id=deployment_id, held_by_benchmark_run_id__isnull=False
        ).count()
        if len(free) + others_held >= planned.target_replicas:
            chosen = sorted(free, key=_order)[:wanted]
            Replica.objects.filter(pk__in=[r.pk for r in chosen]).update(
                held_by_benchmark_run_id=run_id
            )
            mine += chosen
    return sorted(mine, key=_order)


@contextmanager
def held_replicas(
    *,
    run_id: int,
    deployment: Deployment,
    replicas: int,
    wait_seconds: float,
    progress: Callable[[str], None],
    beat: Callable[[], bool],
) -> Iterator[list[str]]:
    """Hold `replicas` replicas of the deployment for the run; yields their endpoint URLs."""
    refusal = isolation_refusal(deployment)
    if refusal:
        raise DomainError(refusal, field="deployment")
    held_at = timezone.now()
    hold(run_id=run_id, deployment_id=deployment.pk, replicas=replicas)
    try:
        deadline = time.monotonic() + wait_seconds
        taken: list[Replica] = []
        while True:
            taken = _take(run_id, deployment.pk, replicas, held_at)
            if len(taken) >= replicas:
                break
            if time.monotonic() > deadline:
                raise IsolationError(
                    f"{len(taken)} of {replicas} benchmark replica(s) of {deployment.name} "
                    f"were serving after {wait_seconds:.0f} s (its cold start is "
                    f"{deployment.cold_start_seconds} s)"
                )
            progress(f"waiting for {replicas - len(taken)} benchmark replica(s) to serve")
            if not beat():
                raise IsolationError("the run was ended while it waited for its replicas")
            # Tick from here too: a worker whose only slot runs this benchmark would wait for
            # a tick it can never run. The tick's lock makes a concurrent one skip.
            allocation_tick()
            time.sleep(1.0)
        urls = [replica.url.rstrip("/") for replica in taken]
        # Out of the rotation now: the gateways re-read their documents within a second.
        publish_gateway_state(reason=f"benchmark run {run_id} took {len(urls)} replica(s)")
        _quiesce(urls, progress)
        # From here no customer request may reach them (the usage events name the replica).
        progress(f"measuring {len(urls)} held replica(s)")
        yield urls
    finally:
        release(run_id=run_id, deployment_id=deployment.pk, replicas=replicas)
        allocation_tick()  # the extra replicas go now, not at the next beat


def _quiesce(urls: list[str], progress: Callable[[str], None]) -> None:
    """Wait until the taken replicas are idle: no request running and none finished for a
    second, and at least GATEWAY_REFRESH_GRACE_SECONDS since the republication (a gateway
    that has not re-read its documents yet still routes there, and its requests show in the
    engines' own counters)."""
    started = time.monotonic()
    deadline = started + QUIESCE_SECONDS
    last: list | None = None
    quiet_since = started
    while time.monotonic() < deadline:
        counters = [engine_counters(url, timeout_seconds=2.0) for url in urls]
        now = time.monotonic()
        if counters != last:
            last, quiet_since = counters, now
        idle = all(running is not None and running == 0 for _, running in counters)
        if (
            idle
            and now - quiet_since >= IDLE_SECONDS
            and now - started >= GATEWAY_REFRESH_GRACE_SECONDS
        ):
            return
        progress("waiting for customers' requests on the benchmark replicas to end")
        time.sleep(0.25)
    logger.warning("benchmark replicas %s were still busy after %.0f s", urls, QUIESCE_SECONDS)
