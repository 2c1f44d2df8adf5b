"""The event loop: arrivals, routing, replicas with continuous batching, cold starts, ticks.

A replica follows the engine emulator exactly (dataplane/emulator/engine.py): each step
admits waiting requests in order while the batch has room (`max_num_seqs`), the KV budget
allows (prompt + output tokens reserved on admission) and the step's prompt budget
(`max_num_batched_tokens`, at least one request) lasts, lasts `step_seconds` (prefill of the
newly admitted prompts + base + per running sequence + per context token), and gives every
running sequence one token at its end; a request's first token comes at the end of its prefill
step.

Stepping event by event would cost one Python iteration per step per replica. Instead a replica
is advanced in closed form between the events that change its batch (an admission or a finish):
with n sequences running and context C at the segment start, step j (0-based) lasts
    D + q·j (+ the prefill P in step 0),  D = base + per_seq·n + per_ctx·C,  q = per_ctx·n,
so m steps end at t0 + P + m·D + q·m(m-1)/2. The next finish is a known number of steps away
and the step boundary after an arrival is the root of that quadratic, so each request costs a
handful of heap operations whatever its length.

Routing sends a request to the READY replica with the least outstanding work, in replica-seconds
of the ground-truth cost at a full batch (the router is given the true sizes; a live router
would estimate the output). Requests wait in a fleet queue while no replica is ready; a request
not admitted into a batch within `queue_timeout_seconds` of its arrival times out.

Admission (optional, `SimulationSettings.admission`) decides each request on arrival, in its
class (`SimulationResult.admission_class`); a refused request is resolved at once (REFUSED) and
shown to the next tick with its MU and the class it was refused in (`Observation.refused_mu`),
as a refused usage event shows it to the live tick.

Several deployments (`SimulationSettings.fleet`, a `DeploymentFleet`): each replica belongs to
one deployment and follows that deployment's profile (its steps, batch and KV cache), cold
start and GPUs per replica; the autoscaler's count is placed over the deployments
(`DeploymentFleet.place`) unless it sizes each deployment itself (`deployment_targets()`), and
each deployment scales apart. Routing sends a request to the ready replica with the least
outstanding work in that replica's own seconds, among those whose KV cache holds it (a request
no deployment's cache holds is refused). GPU-hours add up each deployment's replicas times its
GPUs per replica, and the result keeps each deployment's replicas over time
(`SimulationResult.deployment_replica_hours`). Without a fleet, one kind of replica, as ever.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .admission import BEST_EFFORT, GUARANTEED, REFUSED_GUARANTEED, Admission
from .autoscaling import Autoscaler, DeploymentReplicas, Observation
from .deployments import DeploymentFleet
from .profile import ModelConfig
from .traces import TraceRequest

SERVED, REFUSED, TIMED_OUT = 0, 1, 2
# The class admission let a request in (SimulationResult.admission_class): NOT_ADMITTED for a
# request refused (by admission, or too long for the KV cache) or run without admission.
NOT_ADMITTED, ADMITTED_GUARANTEED, ADMITTED_BEST_EFFORT = -1, 0, 1
_CLASS_CODES = {GUARANTEED: ADMITTED_GUARANTEED, BEST_EFFORT: ADMITTED_BEST_EFFORT}
_UNRESOLVED = -1
_STARTING, _READY, _DRAINING, _GONE = range(4)
_TICK, _REPLICA_READY, _BOUNDARY = range(3)


@dataclass(frozen=True)
class SimulationSettings:
    model: ModelConfig
    gpus_per_replica: int = 1
    cold_start_seconds: float | None = None  # None: the model's own
    tick_seconds: float = 15.0
    queue_timeout_seconds: float = 60.0
    ttft_slo_seconds: float = 2.0
    initial_replicas: int = 0  # ready at t = 0
    # Simulate at least until here (default: the last arrival); the run then goes on, tick by
    # tick, until every request is resolved, and ends on a tick.
    horizon_s: float | None = None
    request_mu: Callable[[TraceRequest], float] | None = None
    admission: Admission | None = None
    # Stop as soon as more than `max_misses` of the requests from index `misses_from` on (in
    # the order given) miss the TTFT SLO: refused, timed out, or a first token later than the
    # SLO. A search in the simulator only needs to know that a fleet misses its objective.
    max_misses: int | None = None
    misses_from: int = 0
    # The model's several deployments (None: one kind of replica, `model` above). Each
    # deployment's profile, cold start and GPUs then replace `model`, `cold_start_seconds` and
    # `gpus_per_replica`, and `initial_replicas` is placed as the autoscaler's counts are.
    fleet: DeploymentFleet | None = None


@dataclass(frozen=True)
class SimulationResult:
    # Per request, in the order given; times in seconds, NaN where it does not apply.
    arrival_s: np.ndarray
    start_s: np.ndarray  # admitted into a batch
    first_token_s: np.ndarray
    finish_s: np.ndarray  # last token (served) or the timeout (timed out)
    outcome: np.ndarray  # int8: SERVED, REFUSED, TIMED_OUT
    ttft_s: np.ndarray
    tpot_s: np.ndarray  # (finish - first token) / (output - 1); NaN for one-token outputs
    # The fleet: replicas holding GPUs (starting + ready + draining) from each time on.
    replica_change_s: np.ndarray
    replicas_after_change: np.ndarray
    end_s: float
    gpu_hours: float
    ttft_slo_seconds: float
    scale_events: int  # ticks whose target differed from the previous tick's
    gpus_per_replica: int = 1
    scale_event_s: np.ndarray | None = None  # when each scale event happened
    # Per request: the class admission let it in (ADMITTED_GUARANTEED, ADMITTED_BEST_EFFORT or
    # NOT_ADMITTED), and its MU (NaN without `request_mu`).
    admission_class: np.ndarray | None = None
    request_mu: np.ndarray | None = None
    # Stopped at `end_s` on its `max_misses`: requests not resolved by then count as misses
    # (their outcome is -1), and GPU-hours stop there.
    stopped: bool = False
    # A fleet of several deployments: each one's replicas after each change (one column per
    # deployment, in the fleet's order) and its GPUs per replica; None and () otherwise.
    deployment_replicas_after_change: np.ndarray | None = None
    deployment_gpus_per_replica: tuple[int, ...] = ()

    def deployment_replica_hours(self) -> tuple[float, ...]:
        """Replica-hours of each deployment (a fleet of one kind: its one count)."""
        times = np.append(self.replica_change_s, self.end_s)
        durations = np.diff(times)
        if self.deployment_replicas_after_change is None:
            return (float(np.sum(durations * self.replicas_after_change)) / 3600.0,)
        by_deployment = self.deployment_replicas_after_change
        return tuple(
            float(np.sum(durations * by_deployment[:, column])) / 3600.0
            for column in range(by_deployment.shape[1])
        )

    def since(self, from_s: float, first_request: int) -> SimulationResult:
        """The part of the run from `from_s` on: requests from `first_request` on (in the order
        given), GPU-hours and scale events from `from_s` to the end."""
        change_s, alive = self.replica_change_s, self.replicas_after_change
        # Replicas alive at from_s, then every change after it.
        before = np.searchsorted(change_s, from_s, side="right") - 1
        times = np.concatenate(([from_s], change_s[before + 1 :], [self.end_s]))
        counts = np.concatenate(([alive[before] if before >= 0 else 0], alive[before + 1 :]))
        replica_seconds = float(np.sum(np.diff(times) * counts))
        gpu_hours = replica_seconds * self.gpus_per_replica / 3600.0
        by_deployment = self.deployment_replicas_after_change
        if by_deployment is not None:
            first_row = (
                by_deployment[before]
                if before >= 0
                else np.zeros(by_deployment.shape[1], dtype=by_deployment.dtype)
            )
            by_deployment = np.vstack(([first_row], by_deployment[before + 1 :]))
            gpus = np.asarray(self.deployment_gpus_per_replica, dtype=float)
            gpu_hours = float(np.sum(np.diff(times)[:, None] * by_deployment * gpus)) / 3600.0
        events = self.scale_event_s
        part = slice(first_request, None)
        return replace(
            self,
            arrival_s=self.arrival_s[part],
            start_s=self.start_s[part],
            first_token_s=self.first_token_s[part],
            finish_s=self.finish_s[part],
            outcome=self.outcome[part],
            ttft_s=self.ttft_s[part],
            tpot_s=self.tpot_s[part],
            replica_change_s=times[:-1],
            replicas_after_change=counts.astype(np.int32),
            gpu_hours=gpu_hours,
            deployment_replicas_after_change=by_deployment,
            scale_events=(
                int(np.count_nonzero(events >= from_s)) if events is not None else self.scale_events
            ),
            scale_event_s=None if events is None else events[events >= from_s],
            admission_class=None if self.admission_class is None else self.admission_class[part],
            request_mu=None if self.request_mu is None else self.request_mu[part],
        )

    @property
    def served(self) -> int:
        return int(np.count_nonzero(self.outcome == SERVED))

    @property
    def refused(self) -> int:
        return int(np.count_nonzero(self.outcome == REFUSED))

    @property
    def timed_out(self) -> int:
        return int(np.count_nonzero(self.outcome == TIMED_OUT))

    @property
    def slo_attainment(self) -> float:
        """Share of all requests (refused and timed out count as misses) with TTFT ≤ the SLO."""
        if len(self.outcome) == 0:
            return 1.0
        met = (self.outcome == SERVED) & (self.ttft_s <= self.ttft_slo_seconds)
        return float(np.count_nonzero(met)) / len(self.outcome)

    def ttft_ms(self, percentile: float) -> float:
        return _percentile_ms(self.ttft_s[self.outcome == SERVED], percentile)

    def tpot_ms(self, percentile: float) -> float:
        return _percentile_ms(self.tpot_s[self.outcome == SERVED], percentile)

    def summary(self) -> dict[str, float]:
        return {
            "requests": len(self.outcome),
            "served": self.served,
            "refused": self.refused,
            "timed_out": self.timed_out,
            "gpu_hours": self.gpu_hours,
            "slo_attainment": self.slo_attainment,
            "ttft_p50_ms": self.ttft_ms(50),
            "ttft_p95_ms": self.ttft_ms(95),
            "ttft_p99_ms": self.ttft_ms(99),
            "tpot_p95_ms": self.tpot_ms(95),
            "scale_events": self.scale_events,
        }


class _Stopped(Exception):
    """Raised inside the event loop when the run has missed more than its `max_misses`."""

    def __init__(self, t_s: float):
        self.t_s = t_s


def _percentile_ms(values_s: np.ndarray, percentile: float) -> float:
    values_s = values_s[~np.isnan(values_s)]
    return float(np.percentile(values_s, percentile)) * 1000.0 if len(values_s) else math.nan


class _Replica:
    __slots__ = (
        "state",
        "group",  # the deployment it belongs to (its index in the fleet; 0 without one)
        "running",  # heap of (finish step number, request index)
        "waiting",  # deque of request indices, in arrival order
        "blocked",  # the head of `waiting` did not fit at the last boundary
        "budget_spent",  # the last boundary's admissions used up the step's prompt budget
        "context_tokens",
        "kv_tokens",
        "steps_done",  # steps completed up to the current segment's start
        "seg_start_s",
        "seg_prefill_s",
        "seg_step_s",  # D above
        "seg_growth_s",  # q above
        # Steps into the segment of the scheduled boundary; 0: none; -1: a start, now.
        "event_steps",
        "version",  # bumped when the scheduled boundary changes; older heap entries are stale
        "outstanding_s",
    )

    def __init__(self, state: int, group: int = 0):
        self.state = state
        self.group = group
        self.running: list[tuple[int, int]] = []
        self.waiting: deque[int] = deque()
        self.blocked = self.budget_spent = False
        self.context_tokens = self.kv_tokens = self.steps_done = 0
        self.seg_start_s = self.seg_prefill_s = self.seg_step_s = self.seg_growth_s = 0.0
        self.event_steps = self.version = 0
        self.outstanding_s = 0.0

    def time_after(self, steps: int) -> float:
        return (
            self.seg_start_s
            + self.seg_prefill_s
            + steps * self.seg_step_s
            + self.seg_growth_s * steps * (steps - 1) / 2
        )

    def steps_until(self, t_s: float) -> int:
        """The first step boundary of the segment at or after t_s, in steps (≥ 1)."""
        x = t_s - self.seg_start_s - self.seg_prefill_s
        if x <= self.seg_step_s:
            return 1
        half_q = self.seg_growth_s / 2
        b = self.seg_step_s - half_q
        if half_q > 0:
            steps = math.ceil((-b + math.sqrt(b * b + 4 * half_q * x)) / (2 * half_q))
        else:
            steps = math.ceil(x / b)
        steps = max(1, steps)
        # The root is rounded; settle on the exact boundary.
        while self.time_after(steps) < t_s:
            steps += 1
        while steps > 1 and self.time_after(steps - 1) >= t_s:
            steps -= 1
        return steps


def simulate(
    requests: Sequence[TraceRequest], settings: SimulationSettings, autoscaler: Autoscaler
) -> SimulationResult:
    """Serve `requests` with the fleet `autoscaler` sizes, tick by tick (the module docstring)."""
    return _Fleet(requests, settings, autoscaler).run()


# One group of replicas per deployment: (profile, cold start, GPUs per replica).
_Group = tuple[ModelConfig, float, int]


def _replica_groups(settings: SimulationSettings) -> list[_Group]:
    """The fleet's groups of replicas (one without a fleet: the settings' model), checked."""
    model = settings.model
    fleet = settings.fleet
    groups: list[_Group]
    if fleet is None:
        cold_start_s = (
            model.cold_start_seconds
            if settings.cold_start_seconds is None
            else settings.cold_start_seconds
        )
        groups = [(model, cold_start_s, settings.gpus_per_replica)]
    else:
        groups = [(d.model, d.cold_start_seconds, d.gpus_per_replica) for d in fleet.deployments]
    for group_model, _, _ in groups:
        if group_model.decode_step_base_seconds + group_model.decode_seconds_per_sequence <= 0:
            raise ValueError("a decode step must take time (base + per-sequence > 0)")
    if settings.tick_seconds <= 0:
        raise ValueError("tick_seconds must be > 0")
    if settings.admission is not None and settings.request_mu is None:
        raise ValueError("admission charges MU: give request_mu too")
    return groups


def _routing_costs_s(
    models: Sequence[ModelConfig], inputs: list[int], outputs: list[int]
) -> list[list[float]]:
    """Per deployment, each request's routing weight: the ground-truth cost at a full batch
    (ground_truth_replica_seconds) on that deployment's replicas."""
    ins, outs = np.asarray(inputs, float), np.asarray(outputs, float)
    return [
        (
            m.prefill_seconds_per_token * ins
            + outs * (m.decode_step_base_seconds / m.max_num_seqs)
            + outs * m.decode_seconds_per_sequence
            + m.decode_seconds_per_context_token * (ins * outs + outs * outs / 2)
        ).tolist()
        for m in models
    ]


class _Fleet:
    def __init__(
        self, requests: Sequence[TraceRequest], settings: SimulationSettings, autoscaler: Autoscaler
    ):
        groups = _replica_groups(settings)
        fleet = settings.fleet
        self.requests = requests
        self.settings = settings
        self.fleet = fleet
        self.models = [group[0] for group in groups]
        self.cold_starts_s = [group[1] for group in groups]
        self.gpus_per_replica = [group[2] for group in groups]
        self.autoscaler = autoscaler
        # The largest and smallest KV cache: a request longer than the largest is refused, one
        # longer than the smallest may run only on some replicas.
        self.max_kv_tokens = max(m.kv_cache_tokens for m in self.models)
        self.min_kv_tokens = min(m.kv_cache_tokens for m in self.models)
        n = len(requests)
        self.arrival = [r.arrival_s for r in requests]
        self.inputs = [r.input_tokens for r in requests]
        # An engine emits at least one token, whatever max_tokens says.
        self.outputs = [max(1, r.output_tokens) for r in requests]
        self.order = sorted(range(n), key=self.arrival.__getitem__)
        self.cost_s = _routing_costs_s(self.models, self.inputs, self.outputs)
        nan = math.nan
        # Each request's MU, priced once: admission charges it on arrival, usage on finish.
        request_mu = settings.request_mu
        self.mu = [request_mu(r) for r in requests] if request_mu is not None else [nan] * n
        self.admission_class = [NOT_ADMITTED] * n
        self.start = [nan] * n
        self.first = [nan] * n
        self.finish = [nan] * n
        self.outcome = [_UNRESOLVED] * n
        self.unresolved = n
        # (time, sequence, kind, replica or None for a tick, replica version)
        self.heap: list[tuple[float, int, int, _Replica | None, int]] = []
        self.sequence = 0  # tie-breaker: equal-time events run in the order scheduled
        self.replicas: list[_Replica] = []  # every replica not gone
        self.ready: list[_Replica] = []
        self.pending: deque[int] = deque()
        self.alive = 0
        self.alive_by_group = [0] * len(groups)
        self.alive_gpus = 0
        self.alive_since_s = 0.0
        self.gpu_seconds = 0.0
        self.change_s: list[float] = [0.0]
        self.change_alive: list[int] = [0]
        self.change_alive_by_group: list[list[int]] = [[0] * len(groups)]
        self.window = [0, 0, 0, 0]  # arrived, completed, refused, timed out
        self.mu_by_client: dict[str, float] = {}
        self.completed_mu: list[tuple[str, float, float]] = []
        self.completed_ttft_s: list[float] = []
        self.refused_mu: list[tuple[str, float, float, bool]] = []
        self.last_target: int | tuple[int, ...] | None = None
        self.misses = 0
        self.max_misses = settings.max_misses
        self.stopped = False
        self.scale_events = 0
        self.scale_event_times: list[float] = []

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> SimulationResult:
        settings = self.settings
        initial: tuple[int, ...]
        if self.fleet is None:
            initial = (settings.initial_replicas,)
        else:
            initial = self.fleet.place(settings.initial_replicas)
        for group, count in enumerate(initial):
            for _ in range(count):
                self.ready.append(self._add_replica(_READY, 0.0, group))
        self._push(0.0, _TICK, None, 0)
        horizon_s = settings.horizon_s
        if horizon_s is None:
            horizon_s = self.arrival[self.order[-1]] if self.order else 0.0
        try:
            end_s = self._loop(horizon_s)
        except _Stopped as stop:
            end_s, self.stopped = stop.t_s, True
        self._count_alive(end_s, 0)
        return self._result(end_s)

    def _loop(self, horizon_s: float) -> float:
        settings = self.settings
        arrival, order, heap = self.arrival, self.order, self.heap
        position, count = 0, len(order)
        while True:
            next_arrival_s = arrival[order[position]] if position < count else math.inf
            if heap[0][0] < next_arrival_s:
                t_s, _, kind, replica, version = heapq.heappop(heap)
                if kind == _BOUNDARY:
                    assert replica is not None  # only ticks are pushed without a replica
                    if version == replica.version and replica.state != _GONE:
                        self._boundary(replica, t_s)
                elif kind == _REPLICA_READY:
                    assert replica is not None  # only ticks are pushed without a replica
                    if replica.state == _STARTING:
                        replica.state = _READY
                        self.ready.append(replica)
                        self._dispatch_pending(t_s)
                else:
                    self._tick(t_s)
                    if position >= count and self.unresolved == 0 and t_s >= horizon_s:
                        return t_s
                    self._push(t_s + settings.tick_seconds, _TICK, None, 0)
            else:
                self._arrive(order[position], next_arrival_s)
                position += 1

    def _push(self, t_s: float, kind: int, replica: _Replica | None, version: int) -> None:
        self.sequence += 1
        heapq.heappush(self.heap, (t_s, self.sequence, kind, replica, version))

    # --- requests --------------------------------------------------------------------------

    def _arrive(self, index: int, t_s: float) -> None:
        self.window[0] += 1
        request = self.requests[index]
        settings = self.settings
        too_long = self.inputs[index] + self.outputs[index] > self.max_kv_tokens
        refused = too_long
        if not refused and settings.admission is not None:
            mu = self.mu[index]
            admission_class = settings.admission.decide(request, mu, t_s)
            code = _CLASS_CODES.get(admission_class)
            if code is None:
                refused = True
                # Demand turned away, by the class it was refused in (fed back to the ticks).
                self.refused_mu.append(
                    (request.client, t_s, mu, admission_class == REFUSED_GUARANTEED)
                )
            else:
                self.admission_class[index] = code
        if refused:
            self.outcome[index] = REFUSED
            self.unresolved -= 1
            self.window[2] += 1
            if self.max_misses is not None:
                self._missed(index, t_s)
        elif not (self.ready and self._route(index, t_s)):
            self.pending.append(index)

    def _route(self, index: int, t_s: float) -> bool:
        """Send the request to a ready replica; False when none can hold it (it waits)."""
        candidates = self.ready
        need = self.inputs[index] + self.outputs[index]
        if need > self.min_kv_tokens:
            # Only the replicas whose KV cache holds it (some deployment's does).
            candidates = [r for r in self.ready if need <= self.models[r.group].kv_cache_tokens]
            if not candidates:
                return False
        replica = min(candidates, key=_outstanding)
        replica.outstanding_s += self.cost_s[replica.group][index]
        replica.waiting.append(index)
        if not replica.running:
            if replica.event_steps == 0:
                # Idle: a step starts now, with whatever else arrives at this same instant
                # (arrivals run before events of equal time), as the engine's loop would.
                replica.version += 1
                replica.event_steps = -1
                self._push(t_s, _BOUNDARY, replica, replica.version)
        elif not replica.blocked:
            steps = replica.steps_until(t_s)
            if steps < replica.event_steps:
                self._schedule(replica, steps)
        return True

    def _dispatch_pending(self, t_s: float) -> None:
        held: deque[int] = deque()  # those no ready replica can hold, in their order
        while self.pending:
            index = self.pending.popleft()
            if not self._expired(index, t_s) and not self._route(index, t_s):
                held.append(index)
        self.pending = held

    def _expired(self, index: int, t_s: float) -> bool:
        """Time the request out if it waited past the timeout; True if it did."""
        deadline_s = self.arrival[index] + self.settings.queue_timeout_seconds
        if t_s <= deadline_s:
            return False
        self.outcome[index] = TIMED_OUT
        self.finish[index] = deadline_s
        self.unresolved -= 1
        self.window[3] += 1
        if self.max_misses is not None:
            self._missed(index, t_s)
        return True

    def _missed(self, index: int, t_s: float) -> None:
        if index >= self.settings.misses_from:
            self.misses += 1
            if self.max_misses is not None and self.misses > self.max_misses:
                raise _Stopped(t_s)

    # --- replicas --------------------------------------------------------------------------

    def _boundary(self, replica: _Replica, t_s: float) -> None:
        """A step boundary: advance the segment, finish, admit, and start the next segment."""
        model = self.models[replica.group]
        steps = replica.event_steps
        if replica.running and steps > 0:
            replica.steps_done += steps
            replica.context_tokens += len(replica.running) * steps
        running, done = replica.running, replica.steps_done
        while running and running[0][0] <= done:
            _, index = heapq.heappop(running)
            self._finish(replica, index, t_s)
        prefill_tokens, admitted = self._admit(replica, t_s)
        n = len(running)
        replica.version += 1
        replica.event_steps = 0
        if n:
            replica.seg_start_s = t_s
            replica.seg_prefill_s = model.prefill_seconds_per_token * prefill_tokens
            replica.seg_step_s = (
                model.decode_step_base_seconds
                + model.decode_seconds_per_sequence * n
                + model.decode_seconds_per_context_token * replica.context_tokens
            )
            replica.seg_growth_s = model.decode_seconds_per_context_token * n
            first_s = replica.time_after(1)
            for index in admitted:
                self.first[index] = first_s
            if self.max_misses is not None:
                slo_s = self.settings.ttft_slo_seconds
                for index in admitted:
                    if first_s - self.arrival[index] > slo_s:
                        self._missed(index, t_s)
            # Held back only by the prompt budget, the queue moves on at the very next step.
            self._schedule(replica, 1 if replica.budget_spent else running[0][0] - done)
        elif replica.state == _DRAINING and not replica.waiting:
            self._remove(replica, t_s)

    def _admit(self, replica: _Replica, t_s: float) -> tuple[int, list[int]]:
        model, waiting, running = self.models[replica.group], replica.waiting, replica.running
        prefill_tokens = 0
        replica.budget_spent = False
        admitted: list[int] = []
        while waiting and len(running) < model.max_num_seqs:
            index = waiting[0]
            if self._expired(index, t_s):
                waiting.popleft()
                replica.outstanding_s -= self.cost_s[replica.group][index]
                continue
            need = self.inputs[index] + self.outputs[index]
            if replica.kv_tokens + need > model.kv_cache_tokens:
                break
            if admitted and prefill_tokens + self.inputs[index] > model.max_num_batched_tokens:
                # The step's prompt budget is spent: the rest start at the next step.
                replica.budget_spent = True
                break
            waiting.popleft()
            replica.kv_tokens += need
            replica.context_tokens += self.inputs[index]
            prefill_tokens += self.inputs[index]
            heapq.heappush(running, (replica.steps_done + self.outputs[index], index))
            self.start[index] = t_s
            admitted.append(index)
        replica.blocked = bool(waiting) and not replica.budget_spent
        return prefill_tokens, admitted

    def _finish(self, replica: _Replica, index: int, t_s: float) -> None:
        replica.kv_tokens -= self.inputs[index] + self.outputs[index]
        replica.context_tokens -= self.inputs[index] + self.outputs[index]
        replica.outstanding_s -= self.cost_s[replica.group][index]
        self.finish[index] = t_s
        self.outcome[index] = SERVED
        self.unresolved -= 1
        self.window[1] += 1
        if self.settings.request_mu is not None:
            request = self.requests[index]
            mu = self.mu[index]
            self.mu_by_client[request.client] = self.mu_by_client.get(request.client, 0.0) + mu
            self.completed_mu.append((request.client, self.arrival[index], mu))
            self.completed_ttft_s.append(self.first[index] - self.arrival[index])

    def _schedule(self, replica: _Replica, steps: int) -> None:
        replica.version += 1
        replica.event_steps = steps
        self._push(replica.time_after(steps), _BOUNDARY, replica, replica.version)

    def _add_replica(self, state: int, t_s: float, group: int) -> _Replica:
        replica = _Replica(state, group)
        self.replicas.append(replica)
        self._count_alive(t_s, +1, group)
        return replica

    def _remove(self, replica: _Replica, t_s: float) -> None:
        replica.state = _GONE
        replica.version += 1
        self.replicas.remove(replica)
        if replica in self.ready:
            self.ready.remove(replica)
        self._count_alive(t_s, -1, replica.group)

    def _count_alive(self, t_s: float, delta: int, group: int = 0) -> None:
        """Integrate GPU time up to t_s, then change the number of replicas holding GPUs."""
        self.gpu_seconds += self.alive_gpus * (t_s - self.alive_since_s)
        self.alive_since_s = t_s
        if delta:
            self.alive += delta
            self.alive_by_group[group] += delta
            self.alive_gpus += delta * self.gpus_per_replica[group]
            if self.change_s[-1] == t_s:
                self.change_alive[-1] = self.alive
                self.change_alive_by_group[-1] = list(self.alive_by_group)
            else:
                self.change_s.append(t_s)
                self.change_alive.append(self.alive)
                self.change_alive_by_group.append(list(self.alive_by_group))

    def _scale(self, target: int, t_s: float, group: int = 0) -> None:
        """Scale one deployment's replicas (without a fleet: every replica) to `target`.
        Up: revive draining replicas, then start new ones. Down: cancel starting ones (newest
        first), then stop idle ready ones, then drain the least loaded."""
        mine = [r for r in self.replicas if r.group == group]
        ready = [r for r in self.ready if r.group == group]
        starting = [r for r in mine if r.state == _STARTING]
        draining = [r for r in mine if r.state == _DRAINING]
        excess = len(starting) + len(ready) - target
        while excess < 0 and draining:
            replica = draining.pop()
            replica.state = _READY
            self.ready.append(replica)
            excess += 1
        for _ in range(-excess):
            replica = self._add_replica(_STARTING, t_s, group)
            self._push(t_s + self.cold_starts_s[group], _REPLICA_READY, replica, 0)
        while excess > 0 and starting:
            self._remove(starting.pop(), t_s)
            excess -= 1
        for replica in reversed(ready):
            if excess > 0 and not replica.running and not replica.waiting:
                self._remove(replica, t_s)
                excess -= 1
        if excess > 0:
            still_ready = [r for r in ready if r.state == _READY]
            for replica in sorted(still_ready, key=_outstanding)[:excess]:
                replica.state = _DRAINING
                self.ready.remove(replica)

    def _tick(self, t_s: float) -> None:
        timeout_s = self.settings.queue_timeout_seconds
        while self.pending and self.arrival[self.pending[0]] + timeout_s < t_s:
            self._expired(self.pending.popleft(), t_s)
        running = sum(len(r.running) for r in self.replicas)
        waiting = len(self.pending) + sum(len(r.waiting) for r in self.replicas)
        starting = sum(1 for r in self.replicas if r.state == _STARTING)
        arrived, completed, refused, timed_out = self.window
        deployments: tuple[DeploymentReplicas, ...] = ()
        if self.fleet is not None:
            deployments = tuple(self._replicas_of(group) for group in range(len(self.models)))
        observation = Observation(
            timestamp_s=t_s,
            window_s=self.settings.tick_seconds,
            arrived_requests=arrived,
            completed_requests=completed,
            refused_requests=refused,
            timed_out_requests=timed_out,
            mu_used_by_client=self.mu_by_client,
            completed_mu=self.completed_mu,
            completed_ttft_s=self.completed_ttft_s,
            refused_mu=self.refused_mu,
            pending_requests=len(self.pending),
            current_replicas=starting + len(self.ready),
            ready_replicas=len(self.ready),
            starting_replicas=starting,
            draining_replicas=len(self.replicas) - starting - len(self.ready),
            running_requests=running,
            waiting_requests=waiting,
            deployments=deployments,
        )
        self.window = [0, 0, 0, 0]
        self.mu_by_client = {}
        self.completed_mu = []
        self.completed_ttft_s = []
        self.refused_mu = []
        target = max(0, int(self.autoscaler.decide(observation)))
        if self.fleet is None:
            targets: int | tuple[int, ...] = target
        else:
            own = getattr(self.autoscaler, "deployment_targets", None)
            chosen = own() if own is not None else None
            targets = (
                tuple(max(0, int(t)) for t in chosen)
                if chosen is not None
                else self.fleet.place(target)
            )
        if self.last_target is not None and targets != self.last_target:
            self.scale_events += 1
            self.scale_event_times.append(t_s)
        self.last_target = targets
        if isinstance(targets, int):
            self._scale(targets, t_s)
        else:
            for group, count in enumerate(targets):
                self._scale(count, t_s, group)
        if self.ready and self.pending:
            self._dispatch_pending(t_s)

    def _replicas_of(self, group: int) -> DeploymentReplicas:
        mine = [r for r in self.replicas if r.group == group]
        starting = sum(1 for r in mine if r.state == _STARTING)
        ready = sum(1 for r in mine if r.state == _READY)
        return DeploymentReplicas(
            current=starting + ready,
            ready=ready,
            starting=starting,
            draining=len(mine) - starting - ready,
        )

    def _result(self, end_s: float) -> SimulationResult:
        arrival = np.asarray(self.arrival, float)
        first = np.asarray(self.first, float)
        finish = np.asarray(self.finish, float)
        outcome = np.asarray(self.outcome, np.int8)
        served = outcome == SERVED
        outputs = np.asarray(self.outputs, float)
        ttft = np.where(served, first - arrival, np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(served & (outputs > 1), (finish - first) / (outputs - 1), np.nan)
        return SimulationResult(
            arrival_s=arrival,
            start_s=np.asarray(self.start, float),
            first_token_s=first,
            finish_s=finish,
            outcome=outcome,
            ttft_s=ttft,
            tpot_s=tpot,
            replica_change_s=np.asarray(self.change_s, float),
            replicas_after_change=np.asarray(self.change_alive, np.int32),
            end_s=end_s,
            gpu_hours=self.gpu_seconds / 3600.0,
            gpus_per_replica=self.settings.gpus_per_replica,
            scale_event_s=np.asarray(self.scale_event_times, float),
            ttft_slo_seconds=self.settings.ttft_slo_seconds,
            scale_events=self.scale_events,
            admission_class=np.asarray(self.admission_class, np.int8),
            request_mu=np.asarray(self.mu, float),
            stopped=self.stopped,
            deployment_replicas_after_change=(
                None
                if self.fleet is None
                else np.asarray(self.change_alive_by_group, np.int32).reshape(
                    len(self.change_s), len(self.models)
                )
            ),
            deployment_gpus_per_replica=(
                () if self.fleet is None else tuple(self.gpus_per_replica)
            ),
        )


def _outstanding(replica: _Replica) -> float:
    return replica.outstanding_s
