"""Pushing one tick's targets to the actuators, concurrently and each within the push deadline
(ALLOCATION_PUSH_DEADLINE_SECONDS): the tick, which holds the lock, never waits for a hanging
actuator, and an answer that comes after the deadline is dropped."""

import queue
import threading
import time
from dataclasses import replace

from capacity.actuation.base import Actuator, ActuatorResult, ScaleRequest

ACTUATOR_THREADS = 16


class Abandoned(Exception):
    """The tick gave up on this push at its deadline."""


# Kinds whose config carries a per-request `timeout_seconds` (capacity/actuation/config.py),
# with the actuator's default.
_TIMEOUT_KINDS = {"webhook": 5.0, "kubernetes": 5.0}


class BoundedActuator(Actuator):
    """An actuator whose every attempt ends by the push's deadline: the attempt's HTTP timeout
    is what remains of it, so the client gives up (and closes the connection) before the tick
    moves on, never after; no attempt starts once the push is abandoned."""

    def __init__(self, inner: Actuator, deadline_at: float, abandoned: threading.Event):
        self.inner, self.deadline_at, self.abandoned = inner, deadline_at, abandoned
        self.kind = inner.kind

    def apply(self, request: ScaleRequest) -> int | None:
        remaining = self.deadline_at - time.monotonic()
        if self.abandoned.is_set() or remaining < 0.1:
            raise Abandoned
        if self.kind in _TIMEOUT_KINDS:
            configured = float(request.config.get("timeout_seconds") or _TIMEOUT_KINDS[self.kind])
            timeout = max(0.1, min(configured, remaining))
            request = replace(request, config={**request.config, "timeout_seconds": timeout})
        return self.inner.apply(request)


def push_all(work: list, push, deadline: float) -> list[ActuatorResult]:
    """push(item, abandoned) for every item, at most ACTUATOR_THREADS at a time, each in its
    own daemon thread. A push still running `deadline` seconds after it started is recorded as
    failed and abandoned: the tick does not wait for it, its thread may start no new attempt
    (`abandoned` is set) and whatever it answers later is dropped, never recorded or applied.
    An abandoned push frees its slot, so one hanging actuator never stalls the others."""
    results: dict[int, ActuatorResult] = {}
    finished: queue.SimpleQueue = queue.SimpleQueue()
    waiting = list(enumerate(work))
    running: dict[int, tuple[float, threading.Event]] = {}

    def run(index, item, abandoned):
        finished.put((index, push(item, abandoned)))

    while waiting or running:
        while waiting and len(running) < ACTUATOR_THREADS:
            index, item = waiting.pop(0)
            abandoned = threading.Event()
            running[index] = (time.monotonic(), abandoned)
            threading.Thread(
                target=run, args=(index, item, abandoned), name="actuator-push", daemon=True
            ).start()
        first_deadline = min(started for started, _ in running.values()) + deadline
        try:
            index, outcome = finished.get(timeout=max(0.0, first_deadline - time.monotonic()))
            if running.pop(index, None) is not None:  # else: abandoned, the answer is dropped
                results[index] = outcome
        except queue.Empty:
            pass
        now = time.monotonic()
        for index, (started, abandoned) in list(running.items()):
            if now - started >= deadline:
                abandoned.set()
                del running[index]
                results[index] = ActuatorResult(
                    ok=False,
                    error=f"no answer within the push deadline of {deadline:g} s "
                    "(ALLOCATION_PUSH_DEADLINE_SECONDS); abandoned, the next tick decides afresh",
                )
    return [results[index] for index in range(len(work))]
