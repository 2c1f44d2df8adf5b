"""Two references found by search in the simulator, both at the TTFT objective.

oracle-slo
    A replica trajectory found with knowledge of the future that keeps the TTFT objective
    (at least `target`, 99 %, of the scored requests with their first token within the SLO;
    refused and timed-out requests miss) and honours cold starts. A reference, not a proven
    bound: what a planner that knew every request could run, a window at a time.

    1. Per window (`window_seconds`, 60 s: whole ticks), in time order: the fewest warm
       replicas that keep the objective for the window's requests in a simulation of that
       window alone: the fleet ready from the start, the requests of the `lead_in_seconds`
       before it replayed first (the backlog it inherits), every request behind the live
       admission with the allowances the live policy (`decide()`) gives that many ready
       replicas for the demand of the minutes before (the trace's own, by arrival), as
       `compare` runs every policy. Never below the replicas the reservations need (sold
       capacity is hot, as for the old oracle), nor none for a window with requests; at most
       `max_replicas`. The search starts from the previous window's answer and steps one
       replica at a time, since neighbouring windows need about as much; it also learns what
       one replica fewer would miss. A window simulation that has missed far more than its
       objective allows stops there (`SimulationSettings.max_misses`).
    1b. The objective is over the whole trace, not each window: one replica fewer where that
       costs the fewest extra misses (as the windows' simulations measured them), while the
       extra misses stay within `budget_share` of those the objective allows.
    2. Cold starts: the per-second schedule of those counts has every gap shorter than a cold
       start filled, layer by layer (`oracle.fill_short_gaps`: keeping a replica through such
       a gap costs less than releasing and restarting it), and each tick asks for the largest
       count over the next cold start and tick, so a replica is ready when its window begins
       (`oracle.ScheduleAutoscaler`, as the old oracle asks).
    3. Check: the whole trace is simulated under that schedule exactly as `compare` runs every
       policy (at most `checks` times). Where it keeps the objective with at least a quarter of
       the misses it allows to spare, step 1b again with part of what is left, on windows not
       relaxed yet; where it does not keep it, replicas back where the check missed most
       (`_repair`). The cheapest schedule that kept the objective wins; so does a candidate
       simulated already (the old oracle's schedule), if it kept the objective for less.

    The windows are simulated apart, so a window inherits the backlog of its lead-in at its
    own fleet size, not its predecessor's; the checks catch what that misses. The search costs
    about two simulations of the trace in short pieces, and the checks up to three whole ones.

static-slo
    The cheapest static fleet that keeps the objective, by search in the simulator: from a
    first guess (static-peak's size), one replica at a time down while it keeps the objective
    or up (doubling the step, then halving it) until it does. Assumes that more replicas never
    keep fewer requests within the SLO, which holds for the fleet's least-outstanding-work
    routing up to the noise of a few requests.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from capacity.allocation.policy import decide

from .admission import TokenBucketAdmission
from .autoscaling import Observation
from .baselines import replicas_for
from .fleet import SERVED, SimulationResult, SimulationSettings, simulate
from .modelunit import LiveDemand, Rates
from .oracle import ScheduleAutoscaler, fill_short_gaps, required_replicas
from .policy_context import PolicyContext
from .traces import TraceRequest

SLO_TARGET = 0.99
WINDOW_SECONDS = 60
LEAD_IN_SECONDS = 30.0
# Simulations of the whole trace (step 3): each relaxes further or repairs.
CHECKS = 3
# A check that kept the objective is relaxed again only with this share of the misses it
# allows still unspent.
RELAX_AGAIN_SHARE = 0.25
# The share of the misses the objective allows that the relaxation (step 1b) may plan for;
# the rest is margin for what simulating windows apart misses.
BUDGET_SHARE = 0.5
# A window's simulation stops once its misses pass what the objective allows by this share of
# its requests: a fleet that misses that many is neither its answer nor worth relaxing to.
RELAX_LIMIT_SHARE = 0.05
UNKNOWN = np.iinfo(np.int64).max // 4  # misses of a stopped run: past the limit
# The windows searched before the scored part begins (a warm-up pass is not scored; before
# this, the old oracle's schedule serves it).
SEARCH_BEFORE_SCORED_SECONDS = 300.0


@dataclass(frozen=True)
class Scored:
    """A simulation of the whole (replayed) trace and the part of it that is scored."""

    full: SimulationResult
    scored: SimulationResult


def attainment(result: SimulationResult) -> float:
    """The share of the run's requests that met the TTFT SLO (refused and timed-out ones miss)."""
    return result.slo_attainment


class StaticFleet:
    """`replicas` ready from the start, always on."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def initial_replicas(self) -> int:
        return self.replicas

    def decide(self, observation: Observation) -> int:
        return self.replicas


def cheapest_static(
    run: Callable[[int], Scored],
    *,
    first_guess: int,
    max_replicas: int,
    target: float = SLO_TARGET,
    known: dict[int, Scored] | None = None,
) -> tuple[int, Scored]:
    """The fewest static replicas (1 .. max_replicas) whose scored run keeps `target`, and that
    run; `max_replicas` and its run when none does. `run(n)` simulates n static replicas;
    `known` holds runs already made (static-peak's)."""
    runs: dict[int, Scored] = dict(known or {})

    def keeps(n: int) -> bool:
        if n not in runs:
            runs[n] = run(n)
        return attainment(runs[n].scored) >= target

    top = max(1, max_replicas)
    guess = min(top, max(1, first_guess))
    step = 1
    if keeps(guess):
        # Down, doubling the step, until a fleet misses (no replicas miss by definition).
        passing, failing = guess, 0
        while passing - step > 0:
            if not keeps(passing - step):
                failing = passing - step
                break
            passing -= step
            step *= 2
    else:
        # Up, doubling the step, until a fleet keeps the objective (or the cap misses).
        failing, passing = guess, 0
        while not passing:
            candidate = min(top, failing + step)
            if candidate == failing:
                return top, runs[top]
            if keeps(candidate):
                passing = candidate
            else:
                failing, step = candidate, step * 2
    # Bisect: `failing` misses (0 counts as missing), `passing` keeps.
    while passing - failing > 1:
        middle = (passing + failing) // 2
        if keeps(middle):
            passing = middle
        else:
            failing = middle
    return passing, runs[passing]


class _TraceAllowances:
    """The live policy's admission rates for a fleet of k ready replicas, from the trace's own
    demand before a moment (each request's MU in the tick it arrives in, as if served)."""

    def __init__(self, context: PolicyContext, requests: Sequence[TraceRequest]):
        self.context = context
        self.tick_s = context.tick_seconds
        self.demand = LiveDemand(context, track_bursts=False)
        self.requests = requests
        self.mu = [context.request_mu(r) for r in requests]
        self.position = 0
        self.next_tick_s = 0.0

    def advance(self, until_s: float) -> None:
        """Record every tick up to `until_s` (requests arrive in order)."""
        requests, mu = self.requests, self.mu
        while self.next_tick_s <= until_s + 1e-9:
            used: dict[str, float] = {}
            while (
                self.position < len(requests)
                and requests[self.position].arrival_s < self.next_tick_s
            ):
                client = requests[self.position].client
                used[client] = used.get(client, 0.0) + mu[self.position]
                self.position += 1
            self.demand.record(_observation(self.next_tick_s, self.tick_s, used, 0))
            self.next_tick_s += self.tick_s

    def rates(self, now_s: float, ready: int) -> Rates:
        snapshot = self.demand.snapshot(_observation(now_s, self.tick_s, {}, ready))
        return self.demand.rates(decide(snapshot))


def _observation(t_s: float, window_s: float, used: dict[str, float], ready: int) -> Observation:
    return Observation(
        timestamp_s=t_s,
        window_s=window_s,
        arrived_requests=0,
        completed_requests=0,
        refused_requests=0,
        timed_out_requests=0,
        mu_used_by_client=used,
        current_replicas=ready,
        ready_replicas=ready,
        starting_replicas=0,
        draining_replicas=0,
        running_requests=0,
        waiting_requests=0,
    )


@dataclass(frozen=True)
class WindowPlan:
    """Per window: replicas, requests, and the requests that miss the SLO at those replicas
    and at one fewer (-1: not known: not simulated, as at the floor, or stopped early)."""

    counts: np.ndarray
    requests: np.ndarray
    misses: np.ndarray
    misses_one_fewer: np.ndarray

    def relaxed(
        self, budget: float, windows: np.ndarray, counts: np.ndarray | None = None
    ) -> np.ndarray:
        """Step 1b: one replica fewer than planned in the `windows` (a mask) where it costs
        the fewest extra misses, while those stay within `budget`; from `counts` (default:
        the plan's)."""
        counts = (self.counts if counts is None else counts).copy()
        eligible = np.flatnonzero((self.misses_one_fewer >= 0) & windows)
        extra = (self.misses_one_fewer - self.misses)[eligible]
        order = np.argsort(extra, kind="stable")
        spent = 0.0
        for window, cost in zip(eligible[order], extra[order], strict=True):
            if spent + cost > budget:
                break
            spent += cost
            counts[window] = self.counts[window] - 1
        return counts


@dataclass
class WindowSearch:
    """Step 1: the fewest warm replicas per window (see the module docstring)."""

    requests: Sequence[TraceRequest]  # in arrival order
    settings: SimulationSettings  # model, cold start, tick, SLO, request_mu
    context: PolicyContext
    burst_seconds: float
    target: float = SLO_TARGET
    window_seconds: int = WINDOW_SECONDS
    lead_in_seconds: float = LEAD_IN_SECONDS
    simulations: int = 0  # window simulations run (for the report)

    def floor(self) -> int:
        context = self.context
        reserved = replicas_for(sum(context.reservations_mu_per_minute.values()), context)
        return max(reserved, 1 if context.keep_warm else 0)

    def plan(self, from_s: float = 0.0) -> WindowPlan:
        """Per window from window 0 to the last arrival's; windows before `from_s` are left at
        0 replicas (the caller fills them)."""
        requests = self.requests
        arrivals = [r.arrival_s for r in requests]
        width = self.window_seconds
        windows = int(arrivals[-1] // width) + 1 if arrivals else 0
        counts = np.zeros(windows, dtype=np.int64)
        sizes = np.zeros(windows, dtype=np.int64)
        misses = np.zeros(windows, dtype=np.int64)
        misses_one_fewer = np.full(windows, -1, dtype=np.int64)
        floor = self.floor()
        top = max(1, self.context.max_replicas)
        allowances = _TraceAllowances(self.context, requests)
        previous = max(1, floor)
        for window in range(int(from_s // width), windows):
            start_s, end_s = window * width, (window + 1) * width
            first = bisect.bisect_left(arrivals, start_s)
            last = bisect.bisect_left(arrivals, end_s)
            if first == last:
                counts[window] = floor
                continue
            lead = bisect.bisect_left(arrivals, start_s - self.lead_in_seconds)
            allowances.advance(start_s)
            offset_s = start_s - self.lead_in_seconds
            shifted = [
                TraceRequest(r.arrival_s - offset_s, r.input_tokens, r.output_tokens, r.client)
                for r in requests[lead:last]
            ]
            tried = self._fewest(
                shifted,
                first - lead,
                partial(allowances.rates, start_s),
                low=max(1, floor),
                top=top,
                guess=previous,
            )
            counts[window] = previous = best = min(
                (k for k, (missed, allowed) in tried.items() if missed <= allowed),
                default=top,
            )
            sizes[window] = last - first
            misses[window] = min(tried[best][0], last - first)
            if best - 1 in tried and tried[best - 1][0] != UNKNOWN:
                misses_one_fewer[window] = tried[best - 1][0]
        return WindowPlan(counts, sizes, misses, misses_one_fewer)

    def _fewest(
        self,
        shifted: list[TraceRequest],
        scored_from: int,
        rates_of: Callable[[int], Rates],
        *,
        low: int,
        top: int,
        guess: int,
    ) -> dict[int, tuple[int, float]]:
        """Replicas tried -> (misses, misses allowed), one replica at a time from `guess`
        until the fewest in [low, top] that keep the window is found (or top misses)."""
        tried: dict[int, tuple[int, float]] = {}

        def keeps(k: int) -> bool:
            tried[k] = self._misses(shifted, scored_from, k, rates_of(k))
            return tried[k][0] <= tried[k][1]

        k = min(top, max(low, guess))
        if keeps(k):
            while k > low and keeps(k - 1):
                k -= 1
        else:
            while k < top and not keeps(k + 1):
                k += 1
        return tried

    def _misses(
        self, shifted: list[TraceRequest], scored_from: int, k: int, rates: Rates
    ) -> tuple[int, float]:
        """(requests of the window that miss the SLO with k replicas, misses allowed). A run
        that misses far more than allowed is stopped early (it could be neither the answer
        nor worth relaxing to): then the misses are past RELAX_LIMIT."""
        requests = len(shifted) - scored_from
        allowed = (1 - self.target) * requests + 1e-9
        admission = TokenBucketAdmission(burst_seconds=self.burst_seconds)
        admission.set_rates(guaranteed=rates[0], best_effort=rates[1])
        settings = replace(
            self.settings,
            initial_replicas=k,
            admission=admission,
            max_misses=int(allowed + RELAX_LIMIT_SHARE * requests) + 1,
            misses_from=scored_from,
        )
        result = simulate(shifted, settings, StaticFleet(k))
        self.simulations += 1
        outcome = result.outcome[scored_from:]
        met = (outcome == SERVED) & (result.ttft_s[scored_from:] <= settings.ttft_slo_seconds)
        missed = requests - int(np.count_nonzero(met))
        return (UNKNOWN if result.stopped else missed), allowed


def window_schedule(counts: np.ndarray, window_seconds: int, cold_start_s: float) -> np.ndarray:
    """Step 2: per-second replicas from per-window counts, gaps shorter than a cold start
    filled."""
    return fill_short_gaps(np.repeat(counts, window_seconds), cold_start_s)


def window_attainment(
    result: SimulationResult, window_seconds: int, windows: int
) -> tuple[np.ndarray, np.ndarray]:
    """(requests, requests within the SLO) per window of arrival."""
    index = np.minimum((result.arrival_s // window_seconds).astype(np.int64), windows - 1)
    met = (result.outcome == SERVED) & (result.ttft_s <= result.ttft_slo_seconds)
    total = np.bincount(index, minlength=windows)
    within = np.bincount(index, weights=met.astype(np.float64), minlength=windows)
    return total, within


def oracle_slo(
    search: WindowSearch,
    run: Callable[[ScheduleAutoscaler], Scored],
    *,
    scored_from_s: float = 0.0,
    checks: int = CHECKS,
    budget_share: float = BUDGET_SHARE,
    candidates: Sequence[tuple[ScheduleAutoscaler, Scored | None]] = (),
) -> tuple[ScheduleAutoscaler, Scored]:
    """Steps 1-3: the schedule and its (checked) run; or the cheapest of the `candidates`
    (other schedules, such as the old oracle's, with their run if it was made) that keeps the
    objective, if it costs less. A candidate not run yet is run only if what it asks for could
    cost less than the best found."""
    context = search.context
    width = search.window_seconds
    search_from_s = max(0.0, scored_from_s - SEARCH_BEFORE_SCORED_SECONDS)
    plan = search.plan(search_from_s)
    first_searched = int(search_from_s // width)
    first_scored = int(math.ceil(scored_from_s / width))
    scored_requests = int(np.sum(plan.requests[first_scored:]))
    allowed = (1 - search.target) * scored_requests
    planned = float(np.sum(plan.misses[first_scored:]))
    relaxable = np.arange(len(plan.counts)) >= first_scored
    counts = plan.relaxed(budget_share * allowed - planned, relaxable)
    if first_searched:
        # Before the searched windows (a warm-up pass): the old oracle's need, by window.
        need = required_replicas(replace(context, future_requests=tuple(search.requests)))
        head = need[: first_searched * width]
        head = np.pad(head, (0, first_searched * width - len(head)))
        counts[:first_searched] = head.reshape(first_searched, width).max(axis=1)
    best: tuple[ScheduleAutoscaler, Scored] | None = None
    for _ in range(checks):
        schedule = window_schedule(counts, width, context.cold_start_seconds)
        autoscaler = ScheduleAutoscaler(
            schedule,
            cold_start_s=context.cold_start_seconds,
            tick_s=context.tick_seconds,
        )
        scored = run(autoscaler)
        total, within = window_attainment(scored.full, width, len(counts))
        missed = total - within
        spent = float(np.sum(missed[first_scored:]))
        if attainment(scored.scored) >= search.target:
            if best is None or scored.scored.gpu_hours < best[1].scored.gpu_hours:
                best = autoscaler, scored
            if allowed - spent < RELAX_AGAIN_SHARE * allowed:
                break  # little room left: not worth another simulation of the trace
            # Room left: relax the windows not relaxed yet with part of what is left.
            relaxable &= counts >= plan.counts
            changed = plan.relaxed(budget_share * (allowed - spent), relaxable, counts)
        else:
            changed = _repair(
                counts,
                plan,
                missed=missed,
                excess=spent - budget_share * allowed,
                first_searched=first_searched,
                top=max(1, context.max_replicas),
                target=search.target,
            )
            relaxable &= changed == counts  # what a repair gave back stays
        if np.array_equal(changed, counts):
            break
        counts = changed
    gpus = search.settings.gpus_per_replica
    for schedule_of, known in candidates:
        if known is None:
            tick_s = search.settings.tick_seconds
            last_s = max((r.arrival_s for r in search.requests), default=0.0)
            asked_s = schedule_of.asked_replica_seconds(scored_from_s, last_s, tick_s)
            # A fleet of several deployments places its replicas on GPUs of several sizes:
            # no such bound, the candidate is simulated.
            bounded = search.settings.fleet is None
            if bounded and best is not None and asked_s * gpus / 3600 >= best[1].scored.gpu_hours:
                continue
            known = run(schedule_of)
        keeps = attainment(known.scored) >= search.target
        if keeps and (best is None or known.scored.gpu_hours < best[1].scored.gpu_hours):
            best = schedule_of, known
    return best if best is not None else (autoscaler, scored)


def _repair(
    counts: np.ndarray,
    plan: WindowPlan,
    *,
    missed: np.ndarray,
    excess: float,
    first_searched: int,
    top: int,
    target: float,
) -> np.ndarray:
    """Step 3's repair: replicas back where the check missed most, until the misses it
    measured, less what the change should save, are back within the relaxation's budget
    (`excess` is how far past it they are). First the relaxed windows, most misses first (each
    should miss what its window's simulation did), then any window missing more than its
    share, one replica more (each should then miss about its share)."""
    counts = counts.copy()
    windows = np.arange(len(counts))
    relaxed = np.flatnonzero(counts < plan.counts)
    for window in relaxed[np.argsort(-missed[relaxed], kind="stable")]:
        if excess <= 0:
            return counts
        counts[window] = plan.counts[window]
        excess -= max(0.0, float(missed[window] - plan.misses[window]))
    share = (1 - target) * plan.requests
    over = np.flatnonzero((missed > share + 1e-9) & (windows >= first_searched))
    for window in over[np.argsort(-(missed - share)[over], kind="stable")]:
        if excess <= 0:
            break
        counts[window] = min(top, counts[window] + 1)
        excess -= float(missed[window] - share[window])
    return counts
