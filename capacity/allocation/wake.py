"""A tick now, not at the next 15 s beat: a gateway holding requests for a model without a
ready replica asks for one (`POST /api/v1/allocation/wake`), and so does a probe round that
finds replicas newly ready (allowances follow the capacity that can serve).

Asked at most once a second (a Redis key set with NX and a one-second life), so a storm of
waiting requests or gateways costs one tick a second. The tick runs on the `allocation`
queue; one that finds another tick running waits for it and runs after it, since that one
may have read the fleet before the demand that asked arrived.
"""

from __future__ import annotations

import logging
import time

import redis
from celery import current_app

from capacity.admission.gate import buckets
from capacity.allocation.tick import allocation_tick

logger = logging.getLogger(__name__)

# The woken tick's task (capacity.tasks.allocation_wake): on the loop worker's queue, and
# dropped unstarted after a few seconds (the beat's next tick comes anyway).
WAKE_TASK = "capacity.allocation_wake"
WAKE_QUEUE = "allocation"
WAKE_EXPIRES_SECONDS = 10
DEBOUNCE_KEY = "controlplane:allocation-wake"
DEBOUNCE_MS = 1000
# A woken tick that finds the lock taken tries again this often, for at most this long.
RETRY_SECONDS = 0.25
RETRY_FOR_SECONDS = 10.0


def request_tick(*, reason: str, debounce: bool = True) -> bool:
    """Queue a tick unless one was queued within the last second; True when queued.

    `debounce=False` always queues: for a change the tick must see (replicas newly ready,
    whose allowances gateways wait for), which a gateway's wake-up a moment earlier must not
    swallow; such changes come at most once per probe round."""
    first = True
    try:
        if debounce:
            first = buckets().client.set(DEBOUNCE_KEY, reason[:200], nx=True, px=DEBOUNCE_MS)
        else:
            buckets().client.set(DEBOUNCE_KEY, reason[:200], px=DEBOUNCE_MS)
    except redis.RedisError as error:
        logger.warning("allocation wake not debounced (%s); queueing a tick anyway", error)
    if not first:
        return False
    try:
        # By name (capacity.tasks registers it): the task module sits above the rooms that ask.
        current_app.send_task(
            WAKE_TASK,
            kwargs={"reason": reason[:200]},
            queue=WAKE_QUEUE,
            expires=WAKE_EXPIRES_SECONDS,
        )
    except Exception:  # the broker down: the beat's next tick comes anyway
        logger.exception("allocation wake: could not queue a tick")
        return False
    return True


def run_woken_tick(*, reason: str) -> dict:
    """The woken tick: run it, after the one that holds the lock if one does."""
    deadline = time.monotonic() + RETRY_FOR_SECONDS
    while True:
        result = allocation_tick()
        if not result.skipped or time.monotonic() >= deadline:
            return {"reason": reason, "tick_id": result.tick_id, "skipped": result.skipped,
                    "seconds": result.seconds}  # fmt: skip
        time.sleep(RETRY_SECONDS)
