"""Run several autoscaling policies over one trace and compare their cost, latency and refusals.

`compare(requests, model=..., policies=[...], slo_ttft_ms=...)` builds one `PolicyContext`
from the trace summary and the model, runs `simulate` once per policy (static-peak first: it is
the reference for `savings_vs_static`) and returns

    {"policies": {NAME: {gpu_hours, savings_vs_static, slo_attainment, ttft_p50_ms,
                         ttft_p95_ms, ttft_p99_ms, tpot_p95_ms, guaranteed_refused,
                         scale_events, refused_guaranteed_share, refused_best_effort_share,
                         refused_within_reservation_share, within_reservation_refused,
                         guaranteed_slo_attainment, admitted_slo_attainment, static_replicas,
                         savings_vs_static_slo, oracle_slo_savings_share, forecast_mape,
                         forecast_fitted}}}

A request's cost in MU is `mu_of` its ground-truth replica-seconds at a full batch (× R / 60),
so one saturated replica mints R = 100 MU/min. `slo_attainment` is over every request (refused
and timed-out ones miss); `guaranteed_refused` counts the requests of customers with a
reservation that were not served (refused or timed out).

Admission (default on; `admission=False` lets every request in): every policy runs behind the
live admission rule, the one GCRA bucket rule (`capacity.admission.bucket`, through
`admission.TokenBucketAdmission`): each customer's guaranteed rate is its reservation, its
best-effort rate the allowance the live policy (`capacity.allocation.policy.decide`) gives it
at every tick, from the replicas observed ready. For modelunit those are the allowances of the
very decision that sizes its fleet, and the demand admission refused is fed back to it by class
(`modelunit.LiveDemand`). The baselines (static-peak, kpa, hpa-rps, oracle) are admitted the
same way: at each tick their ready replicas and the recorded demand (refusals included) go
through `decide()`, whose allowances are used and whose replica counts are not
(`modelunit.LiveAllowances`), so every policy meets the same rule and the same allowance code;
the baselines themselves never read refused demand, as none of them does live. The refusal
figures (`admission.refusal_figures`): the share of guaranteed traffic (customers with a
reservation) and of best-effort traffic refused, the share and count of the requests within the
reservation (the customer's admitted MU over the minute before, plus the request's own, within
its reservation) refused, and the SLO attainment of the requests admitted in the guaranteed
class and of every admitted request. A share of no traffic is NaN.

Warm-up (default on): the trace is played backwards, then forwards, and only the forward pass
is scored (requests, GPU-hours, scale events), so that every policy meets the trace with the
history a running control plane would have. Policies also start with the replicas they ask for
before the trace (`initial_replicas()`, 0 if they do not say): static-peak its whole fleet, the
oracle what it needs within the first cold start, and the reactive policies (kpa, hpa-rps,
modelunit) that same opening fleet (`PolicyContext.warm_replicas`; hpa-rps at least one).

Fleet cap (`max_replicas`, optional): no policy may hold more replicas than this. It lowers the
context's `max_replicas` (what the reactive policies and the oracle plan within, like a
deployment's limit) and clamps every policy's decisions and opening fleet, static-peak's
included; the what-if page uses it to ask whether a fleet sized for the sold reservations at
some overcommit still meets the SLO. Without it nothing changes.

Progress (`on_policy`, optional): called as `on_policy(name, done, total)` after each policy's
simulation; it does not change the results.

Policies: static-peak, kpa, hpa-rps, oracle (`baselines`, `oracle`) and modelunit, the live
allocation policy (`simulation.engine.modelunit.ModelUnitAutoscaler`), imported by name
when asked for; if it cannot be imported it is left out with the reason
(`unavailable_policies`). Beside it, modelunit-reactive, the same policy with prediction off
(rule 3c: the live policy before issue 36), and modelunit-clairvoyant, the live policy given
the exact demand of the next cold start (`ClairvoyantModelUnitAutoscaler`; it reads the
future, as the oracle does): the limit of what a forecast's lift can save.

The forecaster's accuracy (the live policies'; NaN and False for the others):
`forecast_mape` is the mean absolute percentage error of the policy's demand one cold start
ahead (the measured level plus the forecast's lift; the level alone, persistence, with
prediction off) against the demand of the minute it fell in, over the scored part's minutes
with demand (NaN without one); `forecast_fitted` whether a Holt-Winters forecast was ever
fitted (it needs two days of history).

Two more are found by search in the simulator (`oracle_slo`), each run as every policy is
(behind admission, capped, scored after the warm-up): static-slo, the cheapest static fleet
that keeps the TTFT objective (`oracle_slo.SLO_TARGET` of the scored requests within
`slo_ttft_ms`), searched from static-peak's size (whose run it reuses); and oracle-slo, the
hindsight trajectory that keeps it (the old oracle's schedule is one of its candidates: its
run is reused when oracle ran first, else made). `static_replicas` is a static
policy's fleet (NaN for the others); `savings_vs_static_slo` is 1 - GPU-hours / static-slo's
and `oracle_slo_savings_share` a policy's saving over static-slo divided by oracle-slo's (NaN
unless both ran; oracle-slo's is 1).

A model of several deployments (`fleet`, a `DeploymentFleet`): every policy runs over all of
them. The live policy sizes each deployment as it does live (cheapest $/MU first, within each
one's max replicas and its pool's GPUs, a pool shared by several counted once); the others
size the fleet in replicas of its unit deployment (the cheapest MU's: `replica_mu_per_minute`,
`gpus_per_replica`, the model and its cold start are that deployment's), which the fleet places
the same way (`DeploymentFleet.place`). The fleet caps `max_replicas` at what it holds, and a
given `cold_start_seconds` replaces every deployment's. The result adds, per policy, its
`cost_usd` (GPU-hours at each deployment's GPU price) and, under `deployments`, each
deployment's `replica_hours`, `gpu_hours` and `cost_usd` (what the scored part held of it):

    {"policies": {...}, "deployments": {POLICY: {DEPLOYMENT: {replica_hours, gpu_hours,
                                                             cost_usd}}}}

A fleet of one deployment is simulated exactly as that deployment's replica alone, and only
adds its costs.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NotRequired, Protocol, Required, TypedDict, cast

import numpy as np

from capacity.admission.bucket import DEFAULT_BURST_SECONDS
from capacity.allocation.slo import SLO_GAIN
from capacity.pricing.features import REPLICA_MU_PER_MINUTE, mu_of, replica_seconds_of

from .admission import refusal_figures, within_reservation
from .autoscaling import Autoscaler, Observation
from .baselines import (
    HPARpsAutoscaler,
    KPAAutoscaler,
    StaticPeakAutoscaler,
    replicas_for,
    static_peak_replicas,
)
from .deployments import DeploymentFleet
from .fleet import (
    ADMITTED_GUARANTEED,
    NOT_ADMITTED,
    REFUSED,
    SERVED,
    SimulationResult,
    SimulationSettings,
    simulate,
)
from .modelunit import (
    DEFAULT_STABILISATION_SECONDS,
    ClairvoyantModelUnitAutoscaler,
    ModelUnitAutoscaler,
    behind_admission,
)
from .oracle import OracleAutoscaler, ScheduleAutoscaler, required_replicas
from .oracle_slo import (
    SLO_TARGET,
    Scored,
    StaticFleet,
    WindowSearch,
    cheapest_static,
    oracle_slo,
)
from .policy_context import PolicyContext
from .profile import ModelConfig, ground_truth_replica_seconds
from .traces import TraceRequest, summarise

REFERENCE = "static-peak"
# A deployment's idle window before scale to zero, unless the caller gives its own.
DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS = 600.0
MODELUNIT = "modelunit"
# The live policy with prediction off (rule 3c): what a model gets with its planners' switch
# off or too little history, and the live policy before issue 36.
MODELUNIT_REACTIVE = "modelunit-reactive"
# The live policy given the exact demand of the next cold start (it reads the future, as the
# oracle does): the limit of what its forecast's lift could save.
MODELUNIT_CLAIRVOYANT = "modelunit-clairvoyant"
LIVE_POLICIES = (MODELUNIT, MODELUNIT_REACTIVE, MODELUNIT_CLAIRVOYANT)
# Found by search in the simulator (oracle_slo): the cheapest static fleet that keeps the SLO,
# and the hindsight reference at the SLO.
STATIC_SLO = "static-slo"
ORACLE_SLO = "oracle-slo"
SEARCHED = (STATIC_SLO, ORACLE_SLO)
MODELUNIT_PATH = "simulation.engine.modelunit:ModelUnitAutoscaler"
METRICS = (
    "gpu_hours",
    "savings_vs_static",
    "slo_attainment",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "ttft_p99_ms",
    "tpot_p95_ms",
    "guaranteed_refused",
    "scale_events",
    "refused_guaranteed_share",
    "refused_best_effort_share",
    "refused_within_reservation_share",
    "within_reservation_refused",
    "guaranteed_slo_attainment",
    "admitted_slo_attainment",
    "static_replicas",
    "savings_vs_static_slo",
    "oracle_slo_savings_share",
    "forecast_mape",
    "forecast_fitted",
)

_BUILT_IN: dict[str, Callable[[PolicyContext], Autoscaler]] = {
    "static-peak": StaticPeakAutoscaler,
    "kpa": KPAAutoscaler,
    "hpa-rps": HPARpsAutoscaler,
    "oracle": OracleAutoscaler,
}


class _ModelUnitFactory(Protocol):
    """The modelunit policy's constructor, which also takes the stabilisation window and the
    SLO correction's gain."""

    def __call__(
        self, context: PolicyContext, /, *, stabilisation_seconds: float, slo_gain: float
    ) -> Autoscaler: ...


class _SettingsKwargs(TypedDict):
    """The SimulationSettings every policy shares (`compare` adds the opening fleet)."""

    model: ModelConfig
    gpus_per_replica: int
    cold_start_seconds: float
    tick_seconds: float
    ttft_slo_seconds: float
    request_mu: Callable[[TraceRequest], float]
    fleet: DeploymentFleet | None


# A deployment's share of a policy's run: replica_hours, gpu_hours, cost_usd.
DeploymentShare = dict[str, float]


class Comparison(TypedDict):
    """compare()'s result (the module docstring)."""

    policies: Required[dict[str, dict[str, float]]]
    deployments: NotRequired[dict[str, dict[str, DeploymentShare]]]


class PolicyError(ValueError):
    """An unknown or unavailable policy name."""


def _load_modelunit() -> tuple[Callable[[PolicyContext], Autoscaler] | None, str | None]:
    module_name, _, class_name = MODELUNIT_PATH.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, class_name), None
    except (ImportError, AttributeError) as exc:
        return None, f"{MODELUNIT} policy unavailable (cannot import {MODELUNIT_PATH}: {exc})"


class _Capped:
    """A policy whose fleet never exceeds `cap` replicas (its decisions and opening fleet)."""

    def __init__(self, autoscaler: Autoscaler, cap: int):
        self.autoscaler = autoscaler
        self.cap = cap

    def initial_replicas(self) -> int:
        initial = getattr(self.autoscaler, "initial_replicas", None)
        return min(self.cap, int(initial()) if initial else 0)

    def decide(self, observation: Observation) -> int:
        return min(self.cap, self.autoscaler.decide(observation))

    def deployment_targets(self) -> tuple[int, ...] | None:
        """A policy that sizes each deployment itself plans within the cap (its context's
        `max_replicas`, placed): its targets pass as they are."""
        own = getattr(self.autoscaler, "deployment_targets", None)
        targets: tuple[int, ...] | None = own() if own is not None else None
        return targets


def policy_registry() -> tuple[dict[str, Callable[[PolicyContext], Autoscaler]], dict[str, str]]:
    """(name -> factory, name -> why it is missing). The modelunit policy is imported here."""
    registry = dict(_BUILT_IN)
    missing: dict[str, str] = {}
    # The searched policies have no factory: compare runs their searches.
    factory, reason = _load_modelunit()
    if factory is not None:
        registry[MODELUNIT] = factory
        # The modelunit factory is ModelUnitAutoscaler, which takes `prediction`.
        registry[MODELUNIT_REACTIVE] = functools.partial(
            cast(Callable[..., Autoscaler], factory), prediction=False
        )
        registry[MODELUNIT_CLAIRVOYANT] = ClairvoyantModelUnitAutoscaler
    else:
        missing[MODELUNIT] = reason or f"{MODELUNIT} policy unavailable"
    return registry, missing


def known_policies() -> tuple[str, ...]:
    """Every policy name compare() accepts."""
    return (*_BUILT_IN, *LIVE_POLICIES, *SEARCHED)


def request_mu_of_model(model: ModelConfig) -> Callable[[TraceRequest], float]:
    # Traces repeat their sizes (rate windows draw them from a real trace), so each size is
    # priced once.
    """A request's MU at the model's ground truth, at a full batch."""
    priced: dict[tuple[int, int], float] = {}

    def cost_mu(request: TraceRequest) -> float:
        size = (request.input_tokens, request.output_tokens)
        mu = priced.get(size)
        if mu is None:
            mu = priced[size] = mu_of(
                ground_truth_replica_seconds(
                    model,
                    request.input_tokens,
                    max(1, request.output_tokens),
                    batch_size=model.max_num_seqs,
                )
            )
        return mu

    return cost_mu


def request_mu_of_weights(
    weights_replica_seconds: Mapping[str, float],
    replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE,
) -> Callable[[TraceRequest], float]:
    """A request's MU as a cost model prices it (capacity.pricing.features), as usage is
    metered live; a trace's input tokens are all uncached."""
    weights = dict(weights_replica_seconds)
    priced: dict[tuple[int, int], float] = {}

    def cost_mu(request: TraceRequest) -> float:
        size = (request.input_tokens, request.output_tokens)
        mu = priced.get(size)
        if mu is None:
            replica_seconds = replica_seconds_of(
                weights, input_tokens=request.input_tokens, output_tokens=request.output_tokens
            )
            mu = priced[size] = mu_of(replica_seconds, replica_mu_per_minute)
        return mu

    return cost_mu


def build_context(
    requests: Sequence[TraceRequest],
    *,
    model: ModelConfig,
    cold_start_seconds: float,
    target_utilisation: float,
    tick_seconds: float,
    reservations: dict[str, float] | None = None,
    keep_warm: bool = False,
    future: bool = False,
    ttft_slo_seconds: float = 2.0,
    max_replicas: int | None = None,
    request_mu: Callable[[TraceRequest], float] | None = None,
    replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE,
    scale_to_zero_after_seconds: float | None = DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS,
    fleet: DeploymentFleet | None = None,
) -> PolicyContext:
    """The context every policy is built from; `future=True` adds the requests (oracle only).

    `max_replicas`, if given, caps the fleet below what the trace and reservations would allow.
    `request_mu` prices a request (default: the model's ground truth at a full batch) and a
    replica serves `replica_mu_per_minute` of such MU (default R). `fleet`: the model's
    several deployments (the counts are then in replicas of its unit deployment).
    """
    request_mu = request_mu or request_mu_of_model(model)
    summary = summarise(requests)
    mean_mu = float(np.mean([request_mu(r) for r in requests])) if requests else 0.0
    peak_mu_per_minute = summary.peak_rate_req_per_s_1min * 60.0 * mean_mu
    reservations = dict(reservations or {})
    base = PolicyContext(
        replica_mu_per_minute=replica_mu_per_minute,
        scale_to_zero_after_seconds=scale_to_zero_after_seconds,
        request_mu=request_mu,
        max_replicas=1,
        max_num_seqs=model.max_num_seqs,
        cold_start_seconds=cold_start_seconds,
        tick_seconds=tick_seconds,
        target_utilisation=target_utilisation,
        reservations_mu_per_minute=reservations,
        keep_warm=keep_warm,
        clients=summary.clients,
        ttft_slo_seconds=ttft_slo_seconds,
        peak_rate_req_per_s=summary.peak_rate_req_per_s_1min,
        mean_request_mu=mean_mu,
        future_requests=tuple(requests) if future else (),
        fleet=fleet,
    )
    top = max(4 * peak_mu_per_minute, sum(reservations.values()))
    cap = max_replicas
    max_replicas = max(1, replicas_for(top, base))
    if cap is not None:
        max_replicas = max(1, min(max_replicas, int(cap)))
    base = replace(base, max_replicas=max_replicas)
    # The warm fleet: what the demand needs before a replica started at t = 0 could be ready
    # (the oracle's own opening fleet), and the reservations.
    opening = required_replicas(replace(base, future_requests=tuple(requests)))
    warm = max(
        int(opening[: int(math.ceil(cold_start_seconds)) + 1].max(initial=0)),
        replicas_for(sum(reservations.values()), base),
    )
    return replace(base, warm_replicas=min(warm, max_replicas))


def compare(
    requests: Sequence[TraceRequest],
    *,
    model: ModelConfig,
    policies: list[str],
    slo_ttft_ms: float,
    gpus_per_replica: int = 1,
    cold_start_seconds: float | None = None,
    target_utilisation: float = 0.8,
    reservations: dict[str, float] | None = None,
    keep_warm: bool = False,
    tick_seconds: float = 15,
    warm_up: bool = True,
    max_replicas: int | None = None,
    on_policy: Callable[[str, int, int], None] | None = None,
    stabilisation_seconds: float | None = None,
    slo_gain: float | None = None,
    admission: bool = True,
    burst_seconds: float = DEFAULT_BURST_SECONDS,
    request_mu: Callable[[TraceRequest], float] | None = None,
    replica_mu_per_minute: float = REPLICA_MU_PER_MINUTE,
    scale_to_zero_after_seconds: float | None = DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS,
    reference: bool = True,
    fleet: DeploymentFleet | None = None,
) -> Comparison:
    """Simulate each policy over `requests` (see the module docstring for the result).

    `reference=False` leaves static-peak out unless asked for (a caller that runs it in another
    call; `savings_vs_static` is then NaN).

    `stabilisation_seconds`: the modelunit policy's scale-down stabilisation window, the live
    tick's setting (ALLOCATION_STABILISATION_SECONDS), which the caller reads; None: the
    setting's default. `slo_gain`: the live policies' SLO correction gain (PolicySettings
    .slo_gain; None: capacity.allocation.slo.SLO_GAIN), which the bench's leave-one-scenario-out
    run fits. `admission`: run every policy behind the live admission (default);
    False lets every request in, as a fleet without a gateway. `burst_seconds`: the buckets'
    burst, the live setting ADMISSION_BURST_SECONDS, which the caller reads.

    A fleet of a real deployment (the what-if): `request_mu` prices requests as its cost model
    does (`request_mu_of_weights`), `replica_mu_per_minute` is what one of its replicas serves
    of such MU (R on the reference GPU type, the exchange rate on another), and
    `scale_to_zero_after_seconds` is its idle window (None: never to zero). By default requests
    are priced at the model's ground truth, R per replica, 600 s.

    A model's several deployments (`fleet`): see the module docstring; their replicas, GPUs,
    cold starts and idle windows replace `model`, `gpus_per_replica`, `replica_mu_per_minute`
    and `scale_to_zero_after_seconds` (those of its unit deployment)."""
    # Long only by its signature and this docstring (the what-if's, the simulate command's and
    # the bench's arguments); the body is the named steps below.
    if max_replicas is not None and max_replicas < 1:
        raise ValueError(f"max_replicas must be at least 1, got {max_replicas}")
    if not 0 < target_utilisation <= 1:
        raise ValueError(f"target_utilisation must be in (0, 1], got {target_utilisation}")
    if slo_ttft_ms <= 0:
        raise ValueError(f"slo_ttft_ms must be > 0, got {slo_ttft_ms}")
    registry = _registry_for(policies)
    unit = _unit_of(
        fleet,
        model=model,
        gpus_per_replica=gpus_per_replica,
        replica_mu_per_minute=replica_mu_per_minute,
        scale_to_zero_after_seconds=scale_to_zero_after_seconds,
        cold_start_seconds=cold_start_seconds,
        max_replicas=max_replicas,
    )
    order = [REFERENCE] + [p for p in dict.fromkeys(policies) if p != REFERENCE]
    if not reference and REFERENCE not in policies:
        order.remove(REFERENCE)
    reservations = dict(reservations or {})
    runs = _runs_over(
        requests,
        unit=unit,
        reservations=reservations,
        target_utilisation=target_utilisation,
        keep_warm=keep_warm,
        tick_seconds=tick_seconds,
        ttft_slo_seconds=slo_ttft_ms / 1000.0,
        warm_up=warm_up,
        request_mu=request_mu,
        admission=admission,
        burst_seconds=burst_seconds,
    )
    scoring = _Scoring(
        guaranteed=np.asarray([r.client in reservations for r in requests], dtype=bool),
        replayed_clients=[r.client for r in runs.replayed],
        reservations=reservations,
        admission=admission,
        first_scored=runs.first_scored,
    )
    results: dict[str, dict[str, float]] = {}
    shares: dict[str, dict[str, DeploymentShare]] = {}
    for name in order:
        outcome = runs.outcome(
            name, registry, stabilisation_seconds=stabilisation_seconds, slo_gain=slo_gain
        )
        results[name] = scoring.row(outcome, static_replicas=runs.static_replicas.get(name))
        results[name].update(runs.forecasts.get(name, _NO_FORECAST))
        if unit.fleet_of_costs is not None:
            shares[name] = _shares(unit.fleet_of_costs, outcome.scored)
            results[name]["cost_usd"] = sum(share["cost_usd"] for share in shares[name].values())
        if on_policy is not None:
            on_policy(name, len(results), len(order))
    return _comparison(order, results, shares, costed=unit.fleet_of_costs is not None)


# A policy without a forecast (every one but the live policy's).
_NO_FORECAST: dict[str, float] = {"forecast_mape": math.nan, "forecast_fitted": False}


def _registry_for(policies: list[str]) -> dict[str, Callable[[PolicyContext], Autoscaler]]:
    """The factories of the policies asked for; PolicyError for one unknown or unavailable."""
    live = any(p in LIVE_POLICIES for p in policies)
    registry, missing = policy_registry() if live else (dict(_BUILT_IN), {})
    unknown = [p for p in policies if p not in registry and p not in missing and p not in SEARCHED]
    if unknown:
        raise PolicyError(f"unknown policy {unknown[0]!r} (known: {', '.join(known_policies())})")
    if live and MODELUNIT in missing:
        raise PolicyError(missing[MODELUNIT])
    return registry


@dataclass(frozen=True)
class _Unit:
    """The replica every policy is simulated in: the model's (compare's arguments), or a fleet's
    unit deployment's. `fleet` is the fleet simulated (None: one kind of replica) and
    `fleet_of_costs` the one costs are counted by (a fleet of one included)."""

    model: ModelConfig
    gpus_per_replica: int
    replica_mu_per_minute: float
    scale_to_zero_after_seconds: float | None
    cold_start_seconds: float
    max_replicas: int | None
    fleet: DeploymentFleet | None = None
    fleet_of_costs: DeploymentFleet | None = None


def _unit_of(
    fleet: DeploymentFleet | None,
    *,
    model: ModelConfig,
    gpus_per_replica: int,
    replica_mu_per_minute: float,
    scale_to_zero_after_seconds: float | None,
    cold_start_seconds: float | None,
    max_replicas: int | None,
) -> _Unit:
    """Without a fleet, the model's replica as given (its own cold start unless one is given).
    A model's several deployments: its unit deployment's replica, a given cold start in place
    of every deployment's, and the cap within what the fleet holds."""
    if fleet is None:
        return _Unit(
            model=model,
            gpus_per_replica=gpus_per_replica,
            replica_mu_per_minute=replica_mu_per_minute,
            scale_to_zero_after_seconds=scale_to_zero_after_seconds,
            cold_start_seconds=(
                model.cold_start_seconds if cold_start_seconds is None else cold_start_seconds
            ),
            max_replicas=max_replicas,
        )
    if cold_start_seconds is not None:
        fleet = fleet.with_cold_start(cold_start_seconds)
    unit = fleet.unit
    # Never more than the fleet holds (its deployments' max replicas, its pools' GPUs);
    # at least one replica, as a deployment alone always had.
    held = max(1, fleet.capacity_replicas)
    return _Unit(
        model=unit.model,
        gpus_per_replica=unit.gpus_per_replica,
        replica_mu_per_minute=unit.replica_mu_per_minute,
        scale_to_zero_after_seconds=unit.scale_to_zero_after_seconds,
        cold_start_seconds=unit.cold_start_seconds,
        max_replicas=held if max_replicas is None else min(max_replicas, held),
        # One kind of replica: simulated as ever, the fleet only counts its costs.
        fleet=None if len(fleet) == 1 else fleet,
        fleet_of_costs=fleet,
    )


def _replayed(
    requests: Sequence[TraceRequest], *, tick_seconds: float, warm_up: bool
) -> tuple[list[TraceRequest], float]:
    """(the requests replayed, when the scored pass starts).

    Warm-up: the trace is played backwards, then forwards, and only the forward pass is
    scored, so that every policy meets the trace with the history a running control plane
    would have, not from a cold start no live system pays. Backwards, the warm-up ends in
    the very demand the trace starts with (replaying it forwards twice would jump from the
    trace's end to its start). The scored pass starts on a whole minute."""
    if not (warm_up and requests):
        return list(requests), 0.0
    last_s = max(r.arrival_s for r in requests)
    scored_from_s = math.ceil((last_s + tick_seconds) / 60.0) * 60.0
    replayed = sorted(
        (replace(r, arrival_s=last_s - r.arrival_s) for r in requests),
        key=lambda r: r.arrival_s,
    ) + [replace(r, arrival_s=r.arrival_s + scored_from_s) for r in requests]
    return replayed, scored_from_s


def _runs_over(
    requests: Sequence[TraceRequest],
    *,
    unit: _Unit,
    reservations: dict[str, float],
    target_utilisation: float,
    keep_warm: bool,
    tick_seconds: float,
    ttft_slo_seconds: float,
    warm_up: bool,
    request_mu: Callable[[TraceRequest], float] | None,
    admission: bool,
    burst_seconds: float,
) -> _Runs:
    """The runs of every policy over `requests`: what each simulation shares (the replica, the
    ticks, the SLO, the price of a request) and the one context every policy is built from."""
    replayed, scored_from_s = _replayed(requests, tick_seconds=tick_seconds, warm_up=warm_up)
    settings_kwargs: _SettingsKwargs = {
        "model": unit.model,
        "gpus_per_replica": unit.gpus_per_replica,
        "cold_start_seconds": unit.cold_start_seconds,
        "tick_seconds": tick_seconds,
        "ttft_slo_seconds": ttft_slo_seconds,
        "request_mu": request_mu or request_mu_of_model(unit.model),
        "fleet": unit.fleet,
    }
    # One context for every policy (building it prices the whole trace twice); the oracle's
    # adds the requests it will meet.
    context = build_context(
        requests,
        model=unit.model,
        cold_start_seconds=unit.cold_start_seconds,
        target_utilisation=target_utilisation,
        tick_seconds=tick_seconds,
        reservations=reservations,
        keep_warm=keep_warm,
        ttft_slo_seconds=ttft_slo_seconds,
        max_replicas=unit.max_replicas,
        request_mu=settings_kwargs["request_mu"],
        replica_mu_per_minute=unit.replica_mu_per_minute,
        scale_to_zero_after_seconds=unit.scale_to_zero_after_seconds,
        fleet=unit.fleet,
    )
    return _Runs(
        requests=requests,
        replayed=replayed,
        scored_from_s=scored_from_s,
        settings_kwargs=settings_kwargs,
        context=context,
        capped=unit.max_replicas is not None,
        admission=admission,
        burst_seconds=burst_seconds,
    )


class _Runs:
    """Each policy's simulation over the replayed trace, run as every policy is: capped, behind
    admission, with the opening fleet it asks for; scored after the warm-up.

    Runs feed later ones: static-peak's fleet and run are where static-slo's search starts, and
    the old oracle's schedule, simulated (when oracle runs before oracle-slo), is one of
    oracle-slo's candidates, which it simulates itself only if it could cost less."""

    def __init__(
        self,
        *,
        requests: Sequence[TraceRequest],
        replayed: list[TraceRequest],
        scored_from_s: float,
        settings_kwargs: _SettingsKwargs,
        context: PolicyContext,
        capped: bool,
        admission: bool,
        burst_seconds: float,
    ) -> None:
        self.requests = requests
        self.replayed = replayed
        self.scored_from_s = scored_from_s
        self.first_scored = len(replayed) - len(requests)
        self.settings_kwargs = settings_kwargs
        self.context = context
        self.capped = capped
        self.admission = admission
        self.burst_seconds = burst_seconds
        self.static_replicas: dict[str, int] = {}
        self.static_run: Scored | None = None
        self.oracle_run: tuple[OracleAutoscaler, Scored] | None = None
        # The live policies' forecast accuracy: forecast_mape, forecast_fitted.
        self.forecasts: dict[str, dict[str, float]] = {}

    def run(
        self, autoscaler: Autoscaler, policy: Autoscaler, *, max_misses: int | None = None
    ) -> Scored:
        """One policy's simulation and its scored part. With `max_misses`, it stops once more
        of the scored requests miss the SLO."""
        if self.capped:
            autoscaler = _Capped(autoscaler, self.context.max_replicas)
        initial = getattr(autoscaler, "initial_replicas", None)
        initial_replicas = int(initial()) if initial else 0
        gate = None
        if self.admission:
            autoscaler, gate = behind_admission(
                autoscaler,
                self.context,
                allowances_of=policy if isinstance(policy, ModelUnitAutoscaler) else None,
                initial_replicas=initial_replicas,
                burst_seconds=self.burst_seconds,
            )
        settings = SimulationSettings(
            **self.settings_kwargs,
            initial_replicas=initial_replicas,
            admission=gate,
            max_misses=max_misses,
            misses_from=self.first_scored,
        )
        full = simulate(self.replayed, settings, autoscaler)
        scored = full.since(self.scored_from_s, self.first_scored) if self.scored_from_s else full
        return Scored(full, scored)

    def run_static(self, replicas: int, *, search: bool = True) -> Scored:
        """A static fleet; in the search, stopped once it has surely missed the objective."""
        fleet = StaticFleet(replicas)
        allowed = int((1 - SLO_TARGET) * len(self.requests) + 1e-9) if search else None
        return self.run(fleet, fleet, max_misses=allowed)

    def outcome(
        self,
        name: str,
        registry: dict[str, Callable[[PolicyContext], Autoscaler]],
        *,
        stabilisation_seconds: float | None,
        slo_gain: float | None = None,
    ) -> Scored:
        """The policy `name`'s run: searched (static-slo, oracle-slo) or built and run."""
        if name == STATIC_SLO:
            return self._static_slo()
        if name == ORACLE_SLO:
            return self._oracle_slo()
        context = self.context
        if name in ("oracle", MODELUNIT_CLAIRVOYANT):
            context = replace(context, future_requests=tuple(self.replayed))
        if name in LIVE_POLICIES and (stabilisation_seconds is not None or slo_gain is not None):
            # The modelunit factory is ModelUnitAutoscaler, loaded by name (_load_modelunit).
            factory = cast(_ModelUnitFactory, registry[name])
            policy = factory(
                context,
                stabilisation_seconds=(
                    DEFAULT_STABILISATION_SECONDS
                    if stabilisation_seconds is None
                    else stabilisation_seconds
                ),
                slo_gain=SLO_GAIN if slo_gain is None else slo_gain,
            )
        else:
            policy = registry[name](context)
        outcome = self.run(policy, policy)
        if isinstance(policy, ModelUnitAutoscaler):
            self.forecasts[name] = self._forecast_accuracy(policy)
        if isinstance(policy, OracleAutoscaler):
            self.oracle_run = policy, outcome
        if name == REFERENCE:
            self.static_run = outcome
            self.static_replicas[name] = cast(StaticPeakAutoscaler, policy).replicas
        return outcome

    def _forecast_accuracy(self, policy: ModelUnitAutoscaler) -> dict[str, float]:
        """The live policy's next-cold-start demand (the level plus the forecast's lift; the
        level alone with prediction off) against the minute it fell in, over the scored part:
        the mean absolute percentage error of the minutes with demand (NaN without one), and
        whether a forecast was ever fitted."""
        demand = policy.demand
        first_minute = self.scored_from_s / 60.0
        errors = [
            abs(predicted - actual) / actual
            for (predicted, actual), minute in zip(
                demand.prediction_errors, demand.prediction_error_minutes, strict=True
            )
            if minute >= first_minute and actual > 0
        ]
        return {
            "forecast_mape": float(np.mean(errors)) if errors else math.nan,
            "forecast_fitted": demand.forecast is not None,
        }

    def _static_slo(self) -> Scored:
        """The cheapest static fleet that keeps the objective, searched from static-peak's."""
        peak = self.static_replicas.get(REFERENCE) or static_peak_replicas(self.context)
        if self.capped:
            peak = min(peak, self.context.max_replicas)
        replicas, outcome = cheapest_static(
            self.run_static,
            first_guess=peak,
            max_replicas=self.context.max_replicas,
            known={} if self.static_run is None else {peak: self.static_run},
        )
        self.static_replicas[STATIC_SLO] = replicas
        if outcome.full.stopped:  # no static fleet keeps the objective: the largest, whole
            outcome = self.run_static(replicas, search=False)
        return outcome

    def _oracle_slo(self) -> Scored:
        """The hindsight trajectory that keeps the objective (the old oracle's a candidate)."""
        future = replace(self.context, future_requests=tuple(self.replayed))
        search = WindowSearch(
            requests=self.replayed,
            settings=SimulationSettings(**self.settings_kwargs),
            context=future,
            burst_seconds=self.burst_seconds,
        )
        oracle_candidate: tuple[ScheduleAutoscaler, Scored | None] = (
            self.oracle_run if self.oracle_run is not None else (OracleAutoscaler(future), None)
        )
        _, outcome = oracle_slo(
            search,
            lambda schedule: self.run(schedule, schedule),
            scored_from_s=self.scored_from_s,
            candidates=[oracle_candidate],
        )
        return outcome


@dataclass(frozen=True)
class _Scoring:
    """What a policy's row is scored against: who reserved, and how requests were admitted."""

    guaranteed: np.ndarray  # per request: its customer holds a reservation
    replayed_clients: list[str]
    reservations: dict[str, float]
    admission: bool
    first_scored: int

    def row(self, outcome: Scored, *, static_replicas: int | None) -> dict[str, float]:
        """A policy's figures (before the savings, which need every policy's)."""
        full, result = outcome.full, outcome.scored
        within = _within_reservation(full, self.replayed_clients, self.reservations, self.admission)
        refused = self.guaranteed & (result.outcome != SERVED)
        return {
            "gpu_hours": result.gpu_hours,
            "slo_attainment": result.slo_attainment,
            "ttft_p50_ms": result.ttft_ms(50),
            "ttft_p95_ms": result.ttft_ms(95),
            "ttft_p99_ms": result.ttft_ms(99),
            "tpot_p95_ms": result.tpot_ms(95),
            "guaranteed_refused": int(np.count_nonzero(refused)),
            "scale_events": result.scale_events,
            "static_replicas": math.nan if static_replicas is None else static_replicas,
            **_refusals(result, self.guaranteed, within[self.first_scored :], self.admission),
        }


def _comparison(
    order: list[str],
    results: dict[str, dict[str, float]],
    shares: dict[str, dict[str, DeploymentShare]],
    *,
    costed: bool,
) -> Comparison:
    """Every policy's row with its savings against static-peak and static-slo, and its share
    of oracle-slo's saving; with `costed`, each policy's cost and each deployment's share."""
    reference_hours = results[REFERENCE]["gpu_hours"] if REFERENCE in results else math.nan
    static_slo_hours = results[STATIC_SLO]["gpu_hours"] if STATIC_SLO in results else math.nan
    oracle_slo_hours = results[ORACLE_SLO]["gpu_hours"] if ORACLE_SLO in results else math.nan
    out: dict[str, dict[str, float]] = {}
    for name in order:
        row = dict(results[name])
        hours = row["gpu_hours"]
        row["savings_vs_static"] = _saving(reference_hours, hours)
        row["savings_vs_static_slo"] = _saving(static_slo_hours, hours)
        headroom = static_slo_hours - oracle_slo_hours
        row["oracle_slo_savings_share"] = (
            (static_slo_hours - hours) / headroom if headroom > 0 else math.nan
        )
        out[name] = {key: row[key] for key in METRICS}
        if costed:
            out[name]["cost_usd"] = row["cost_usd"]
    if not costed:
        return {"policies": out}
    return {"policies": out, "deployments": {name: shares[name] for name in order}}


def _shares(fleet: DeploymentFleet, result: SimulationResult) -> dict[str, DeploymentShare]:
    """Each deployment's replica-hours, GPU-hours and cost in a run (its scored part)."""
    hours = result.deployment_replica_hours()
    shares: dict[str, DeploymentShare] = {}
    for deployment, replica_hours in zip(fleet.deployments, hours, strict=True):
        gpu_hours = replica_hours * deployment.gpus_per_replica
        if len(fleet) == 1:
            gpu_hours = result.gpu_hours  # the very figure the policy's row reports
        shares[deployment.name] = {
            "replica_hours": replica_hours,
            "gpu_hours": gpu_hours,
            "cost_usd": gpu_hours * deployment.gpu_hourly_cost_usd,
        }
    return shares


def _saving(reference_hours: float, hours: float) -> float:
    """1 - hours / reference_hours; NaN without a reference (or one of no GPU-hours)."""
    return 1.0 - hours / reference_hours if reference_hours > 0 else math.nan


def _admitted(result: SimulationResult, admission: bool) -> np.ndarray:
    """Per request: let in (without admission, every request that was not refused)."""
    if admission and result.admission_class is not None:
        return np.asarray(result.admission_class != NOT_ADMITTED)
    return np.asarray(result.outcome != REFUSED)


def _within_reservation(
    result: SimulationResult, clients: list[str], reservations: dict[str, float], admission: bool
) -> np.ndarray:
    mu = result.request_mu if result.request_mu is not None else np.zeros(len(clients))
    return within_reservation(
        clients=clients,
        arrival_s=result.arrival_s,
        mu=mu,
        admitted=_admitted(result, admission),
        reservations_mu_per_minute=reservations,
    )


def _refusals(
    result: SimulationResult, guaranteed: np.ndarray, within: np.ndarray, admission: bool
) -> dict[str, float]:
    admitted = _admitted(result, admission)
    if admission and result.admission_class is not None:
        admitted_guaranteed = np.asarray(result.admission_class == ADMITTED_GUARANTEED)
    else:
        admitted_guaranteed = admitted & guaranteed
    met = (result.outcome == SERVED) & (result.ttft_s <= result.ttft_slo_seconds)
    figures = refusal_figures(
        reserved=guaranteed,
        refused=result.outcome == REFUSED,
        admitted_guaranteed=admitted_guaranteed,
        admitted=admitted,
        within=within,
        met_slo=met,
    )
    return dict(figures.as_dict())
