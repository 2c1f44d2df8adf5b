"""The allocation policy: a pure function from a snapshot of the fleet to decisions
(docs/design.md#the-tick).

Plain data in, plain data out — no database, no clock, no network — so the live tick and the
fleet simulator run the very same code. Rules, in order:

1. Every deployment keeps its `min_replicas` (GPU inventory permitting).
2. Guaranteed first: for every model, enough hot capacity for the reservations that are warm
   (a reserved customer may ramp to its reservation faster than a replica can cold-start, so
   that capacity must already run), spread over its deployments cheapest $/MU first, within
   the GPUs its pools have left. A reservation with keep-warm is warm at all times; one
   without it while its customer used the model (or the reservation started) within the
   model's idle window (its deployments' `scale_to_zero_after_seconds`): after that its
   capacity may go cold, and its next request waits a cold start at the gateway.
3. Then best-effort demand, the same way: recent use above the warm reservations at its recent
   peak, plus what admission refused (the refused requests' estimated MU: demand the fleet
   turned away, so best-effort traffic behind an obeying gateway can still grow the fleet),
   plus the requests waiting at the gateways for a model at zero (at the rate they arrived:
   their MU over the time the oldest has waited) and those queued in the engines; the
   engines' own MU/min (Prometheus) is a floor when metering lags. For bursty
   traffic, never less in all than the rate that starts its sub-minute bursts within the TTFT
   SLO (`capacity.allocation.bursts`). Best-effort is bounded by the model's best-effort
   ceiling (MU/min and replicas, set by planners). A short pool therefore reclaims
   best-effort before guaranteed, and shortfalls are reported.
3b. Cold start: when the demand's trend over the last minutes (capacity.allocation.trend),
   projected one cold start of the model's quickest deployment ahead, would pass the ready
   capacity at its full rate (the target utilisation's headroom takes smaller growth), the
   capacity for the projection is added now (reason `cold_start_lead`): a replica asked for
   once demand got there would come a cold start too late.
3c. Prediction, per model where planners leave it on and the model has a burst window of
   traffic (before that, rules 3 and 3b, and the reasons say so): the capacity is the level
   (the recent mean) or the burst headroom read from the traffic (the least rate that keeps the
   burst window's requests within the TTFT SLO but for a share of its error budget), the
   higher, plus the forecast's rise within the next cold start (capacity.allocation.forecast),
   at full rate over the capacity per replica corrected by the delivered SLO
   (capacity.allocation.slo); never below the warm reservations. A forecast that stays down
   for the hour releases replicas without the stabilisation window.
4. Capacity per replica counts at the deployment's target utilisation.
5. Scale up at once; scale down only to the highest recommendation inside the stabilisation
   window (default 120 s), and not at all while no tick has recommended inside it. Unknown
   load holds the current count rather than scaling down.
6. No demand and no reservation keeping the model warm: keep one replica until the model has
   been idle for its deployment's `scale_to_zero_after_seconds`, then none. Only a replica the
   policy planned is kept: when the last recommendation for the deployment was none, what
   runs there was never the customers' (a benchmark's held replicas, just released: the tick
   plans without them) and goes, scale to zero or not.
7. Never below min, never above max or the pool's inventory.

Admission allowances: each customer's guaranteed bucket is its reservation, always (a request
within it is never refused). Best-effort gets the ready capacity (replicas still loading are
never lent out) that reservations do not use right now, within the best-effort ceiling, split
80 % by recent best-effort demand (refused demand included) and 20 % over every customer
allowed on the model, history or not, in proportion to its tier's weight (accounts.Tier; the
80 % goes the same way when no one has best-effort demand). Lending reserved capacity while
it sits idle is what gives best-effort the slack within a tick of guaranteed traffic stopping;
when the reserved customer comes back its requests are admitted at once and run first in the
engines (vLLM priority 0 against best-effort's 1), and the next tick takes the loan back.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from capacity.allocation.slo import SLO_GAIN, SloCorrection, corrected

EPSILON = 1e-9
BEST_EFFORT_DEMAND_SHARE = 0.8
# The demand the policy is fed (by the live tick and the fleet simulator alike): the mean of
# the last RECENT_WINDOW, the busiest minute of the last PEAK_WINDOW, and the bursts of the
# last BURST_WINDOW.
RECENT_WINDOW_SECONDS = 300
PEAK_WINDOW_SECONDS = 300
BURST_WINDOW_SECONDS = 1800
BURSTY_RATIO = 1.5
# The shortest time over which the requests held at the gateways are read as a rate: Knative's
# panic window (a tenth of its 60 s stable window), the window its autoscaler reads a burst
# over, scale from zero included.
PANIC_WINDOW_SECONDS = 6.0
# Prediction (rule 3c) needs the burst window's worth of a model's traffic before it replaces
# the reactive rules: its headroom is read from that window.
PREDICTION_MIN_HISTORY_SECONDS = BURST_WINDOW_SECONDS


@dataclass(frozen=True)
class PolicySettings:
    stabilisation_window_seconds: float = 120.0
    # Rule 3c's SLO correction: the factor's move per unit of error-budget burn
    # (capacity.allocation.slo.SLO_GAIN; the bench's leave-one-scenario-out run fits it).
    slo_gain: float = SLO_GAIN


# Not frozen: the tick builds tens of thousands a tick, and a frozen dataclass sets each field
# through object.__setattr__ (about 2 µs a customer, a tenth of the tick at 1,000
# deployments). Nothing mutates one after the snapshot is built.
@dataclass(slots=True)
class CustomerDemand:
    customer_id: int
    reserved_mu_per_minute: float
    recent_mu_per_minute: float  # mean over the last few minutes
    peak_mu_per_minute: float  # busiest recent minute
    keep_warm: bool = False
    # Demand admission turned away over the recent window, as MU/min (the refused requests'
    # estimated MU), by the class the request was refused in.
    refused_guaranteed_mu_per_minute: float = 0.0
    refused_best_effort_mu_per_minute: float = 0.0
    # Seconds since the customer last used the model or its reservation started, whichever is
    # later; None: neither (a reservation without keep-warm is then cold).
    idle_seconds: float | None = None
    # MU/min used over the last minute (raw events; None: not measured): how much of its
    # reservation the customer uses right now, so the rest can be lent to best-effort.
    current_mu_per_minute: float | None = None
    # The customer's tier's weight (accounts.Tier.weight): its share of the part of the
    # best-effort slack that is not split by demand.
    tier_weight: float = 1.0

    @property
    def reserved_in_use_mu_per_minute(self) -> float:
        """The part of the reservation the customer uses now (what it used lately when now
        was not measured): it stays the customer's, never lent to best-effort."""
        now = self.current_mu_per_minute
        used = max(self.recent_mu_per_minute, self.peak_mu_per_minute) if now is None else now
        return min(self.reserved_mu_per_minute, used)

    @property
    def refused_mu_per_minute(self) -> float:
        """What admission turned away in both classes, MU/min."""
        return self.refused_guaranteed_mu_per_minute + self.refused_best_effort_mu_per_minute


@dataclass(frozen=True)
class DeploymentState:
    deployment_id: int
    name: str
    pool_id: int
    gpus_per_replica: int
    mu_per_minute_per_replica: float | None  # None: no cost model, cannot be sized
    current_replicas: int
    ready_replicas: int
    min_replicas: int
    max_replicas: int
    cold_start_seconds: float
    scale_to_zero_after_seconds: float | None
    target_utilisation: float
    cost_per_hour_usd: float  # per replica
    # (seconds before now, recommended replicas) of earlier ticks inside the window
    recent_recommendations: tuple[tuple[float, int], ...] = ()
    # Of current_replicas, as observed (never as requested): ready serve now (hot capacity),
    # starting are still loading; draining are leaving, finishing their requests.
    starting_replicas: int = 0
    draining_replicas: int = 0

    @property
    def effective_mu_per_minute_per_replica(self) -> float:
        """What a replica is planned to serve: its rate at the target utilisation (0 without
        a cost model)."""
        return (self.mu_per_minute_per_replica or 0.0) * self.target_utilisation

    @property
    def usd_per_mu(self) -> float:
        """A replica's cost per MU at its full rate, the order `_fill` places replicas in
        (infinite without a rate: placed last)."""
        mu = self.mu_per_minute_per_replica
        return self.cost_per_hour_usd / (mu * 60) if mu else math.inf


@dataclass(frozen=True)
class ModelSnapshot:
    model_id: int
    name: str
    customers: tuple[CustomerDemand, ...]
    deployments: tuple[DeploymentState, ...]
    idle_seconds: float | None  # since the last metered request; None: never used
    load_known: bool = True
    # MU of the requests queued in the engines (not yet in a batch). Usage is metered when a
    # request finishes, so a fleet too small for its demand caps what usage shows; the queue
    # is the demand it hides, planned for as a rate that clears it within a minute.
    waiting_mu: float = 0.0
    # Over the last BURST_WINDOW, for the model's requests (all customers together): the rate
    # that starts every sub-minute burst within the TTFT SLO, and the busiest minute
    # (capacity.allocation.bursts; 0: not measured). Bursts a minute's average hides are what break
    # a
    # TTFT SLO; where they bind, the model's capacity never plans below them.
    burst_mu_per_minute: float = 0.0
    burst_window_busiest_minute_mu: float = 0.0
    # MU of the requests held at the gateways for a model without a ready replica
    # (gw:v1:waiting), planned for at the rate they arrived (`gateway_waiting_mu_per_minute`).
    gateway_waiting_mu: float = 0.0
    # What the engines themselves served, MU/min (Prometheus); None: not measured. A floor on
    # the metered demand, so a fleet whose usage events lag is not scaled down on a gap.
    engine_mu_per_minute: float | None = None
    # The demand's trend over the last minutes, MU/min gained per second (0: flat or falling).
    demand_trend_mu_per_minute_per_second: float = 0.0
    # Planners' bound on best-effort capacity (None: unbounded): MU/min and replicas.
    best_effort_ceiling_mu_per_minute: float | None = None
    best_effort_ceiling_replicas: int | None = None
    # How long the oldest of the requests held at the gateways has waited, seconds (0: not
    # known): they arrived over that time. Last, so positional snapshots keep their meaning.
    gateway_waiting_seconds: float = 0.0
    # Prediction (rule 3c), off unless the snapshot turns it on: the planners' switch per model
    # (ServedModel.prediction_enabled; False: turned off, said in the reasons), None where the
    # snapshot's builder does not predict at all. `history_seconds`: how long the model's demand
    # has been recorded.
    prediction_enabled: bool | None = None
    history_seconds: float = 0.0
    # The delivered SLO (capacity.allocation.slo): the objective, the share of the SLO window's
    # requests within it (None: not measured) and how many there were; and the correction in
    # force since the last tick.
    slo_target: float = 0.99
    delivered_slo_attainment: float | None = None
    delivered_requests: int = 0
    slo_correction_in_force: float = 1.0
    # The fitted forecast (capacity.allocation.forecast.figures), evaluated by the snapshot's
    # builder: demand when the measured level stands for (half its window ago), the highest
    # within the next cold start, and the highest within the next hour (None: no forecast, too
    # little history or prediction off).
    forecast_now_mu_per_minute: float | None = None
    forecast_ahead_mu_per_minute: float | None = None
    forecast_next_hour_peak_mu_per_minute: float | None = None


@dataclass(frozen=True)
class PoolState:
    pool_id: int
    name: str
    gpu_count: int


@dataclass(frozen=True)
class Snapshot:
    models: tuple[ModelSnapshot, ...]
    pools: tuple[PoolState, ...]
    settings: PolicySettings = field(default_factory=PolicySettings)


@dataclass(frozen=True)
class Reason:
    code: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The reason as stored on the decision (`AllocationDecision.reasons`)."""
        return {"code": self.code, "message": self.message, "data": self.data}


@dataclass(frozen=True)
class DeploymentDecision:
    deployment_id: int
    model_id: int
    current_replicas: int
    recommended_replicas: int
    target_replicas: int
    reasons: tuple[Reason, ...]
    # As the snapshot observed them (DeploymentState).
    ready_replicas: int = 0
    starting_replicas: int = 0
    draining_replicas: int = 0
    # The bounds an outside autoscaler (an HPA) may move between ticks: at least what the
    # minimum and the warm reservations need, at most the max replicas within the model's
    # best-effort ceiling (Kubernetes' hpa-bounds mode, capacity/actuation/kubernetes.py).
    floor_replicas: int = 0
    ceiling_replicas: int = 0


@dataclass(frozen=True)
class Allowance:
    customer_id: int
    model_id: int
    guaranteed_mu_per_minute: float
    best_effort_mu_per_minute: float


@dataclass(frozen=True)
class ModelOutcome:
    model_id: int
    guaranteed_mu_per_minute: float
    best_effort_demand_mu_per_minute: float
    planned_mu_per_minute: float
    guaranteed_shortfall_mu_per_minute: float
    best_effort_shortfall_mu_per_minute: float
    # Of the demand: warm reservations, what admission refused by class, what waited at the
    # gateways, and what the cold-start lead added for the trend.
    warm_guaranteed_mu_per_minute: float = 0.0
    refused_guaranteed_mu_per_minute: float = 0.0
    refused_best_effort_mu_per_minute: float = 0.0
    gateway_waiting_mu: float = 0.0
    cold_start_lead_mu_per_minute: float = 0.0
    ready_mu_per_minute: float = 0.0
    # Prediction (rule 3c): whether it sized the model, the SLO correction it applied, the burst
    # headroom and the forecast's lift it planned for (MU/min), and which part set the target
    # ("reservation", "forecast", "burst_headroom", "demand"; "" when reactive).
    predictive: bool = False
    slo_correction: float = 1.0
    slo_code: str = ""
    burst_headroom_mu_per_minute: float = 0.0
    forecast_lift_mu_per_minute: float = 0.0
    set_by: str = ""


@dataclass(frozen=True)
class Decisions:
    deployments: tuple[DeploymentDecision, ...]
    allowances: tuple[Allowance, ...]
    models: tuple[ModelOutcome, ...]

    def for_deployment(self, deployment_id: int) -> DeploymentDecision:
        """The decision for one deployment (StopIteration when it was not in the snapshot)."""
        return next(d for d in self.deployments if d.deployment_id == deployment_id)


def _demand(customer: CustomerDemand) -> float:
    """MU/min to plan for: the recent mean or the busiest recent minute, the higher, plus what
    admission refused (it would have run had there been capacity)."""
    return (
        max(customer.recent_mu_per_minute, customer.peak_mu_per_minute)
        + customer.refused_mu_per_minute
    )


def idle_window_seconds(model: ModelSnapshot) -> float | None:
    """How long a reservation without keep-warm stays warm after its last use: the longest
    `scale_to_zero_after_seconds` of the model's deployments; None when one never scales to
    zero (then every reservation stays warm)."""
    windows = [d.scale_to_zero_after_seconds for d in model.deployments]
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def warm_reserved(customer: CustomerDemand, idle_window: float | None) -> float:
    """The part of a customer's reservation the fleet keeps hot now (rule 2)."""
    if customer.reserved_mu_per_minute <= 0:
        return 0.0
    if customer.keep_warm or idle_window is None:
        return customer.reserved_mu_per_minute
    if customer.idle_seconds is not None and customer.idle_seconds < idle_window:
        return customer.reserved_mu_per_minute
    return 0.0


def cold_start_lead_seconds(model: ModelSnapshot) -> float:
    """The cold start of the quickest deployment that can add capacity."""
    leads = [
        d.cold_start_seconds
        for d in model.deployments
        if d.effective_mu_per_minute_per_replica > 0 and d.max_replicas > 0
    ]
    return min(leads, default=0.0)


def gateway_waiting_mu_per_minute(model: ModelSnapshot) -> float:
    """The requests held at the gateways for a model at zero as the rate the woken fleet must
    serve, MU/min: they arrived over the time the oldest has waited (15 MU held after 6 s is
    150 MU/min, not 15). Read over at least the panic window, or the model's cold start when
    shorter: over less, a request or two would read as a flood; over more, the replicas the
    rate needs would be asked for after the first is ready, when the requests held already
    meet a fleet too small. Read over at most a minute: never less than the rate that serves
    them all within one, which is all there is when the wait is not known."""
    mu = model.gateway_waiting_mu
    waited = model.gateway_waiting_seconds
    if mu <= EPSILON or waited <= 0:
        return max(0.0, mu)
    shortest = min(PANIC_WINDOW_SECONDS, cold_start_lead_seconds(model)) or PANIC_WINDOW_SECONDS
    return mu * 60.0 / min(60.0, max(waited, shortest))


def _binding_burst(model: ModelSnapshot) -> float:
    """The burst rate as MU/min to plan at the target utilisation, where bursts bind; else 0.

    The burst rate already holds its latency headroom, so it needs full replicas, not replicas
    at the target utilisation: counted at the target, it plans just that. Bursts bind when,
    over the same window, they need BURSTY_RATIO times what its busiest minute plans at the
    target. Below that (smooth traffic: Azure's conversation trace measures 1.02) the minute
    plan absorbs them, and the long burst window must not hold capacity after demand has
    fallen; above it (Azure's code trace: 2.8 to 3.5) bursts recur, and only capacity kept
    for them serves them within the SLO, since a replica cannot start within a burst.
    """
    utilisation = max((d.target_utilisation for d in model.deployments), default=1.0)
    burst = model.burst_mu_per_minute * utilisation
    bursty = burst > BURSTY_RATIO * model.burst_window_busiest_minute_mu + EPSILON
    return burst if bursty else 0.0


@dataclass(slots=True)
class _Plan:
    """What `decide`'s steps build, in the rules' order: the replicas placed so far per
    deployment, the GPUs each pool has left, and the reasons each deployment is given. Each
    step reads what the steps before it placed (guaranteed fills on top of the minimums,
    best-effort on top of both), so the three travel together."""

    replicas: dict[int, int]
    pool_free: dict[int, int]
    reasons: dict[int, list[Reason]]

    def planned_mu(self, model: ModelSnapshot) -> float:
        """MU/min the replicas placed so far give the model, at the target utilisation."""
        return sum(
            self.replicas[d.deployment_id] * d.effective_mu_per_minute_per_replica
            for d in model.deployments
        )


@dataclass(slots=True)
class _ModelPlan:
    """One model's figures as the steps find them, read again by the decisions and the
    outcome. `demands` and `warms`: each customer's `_demand` and `warm_reserved`, in the
    model's order, computed once (the steps read them three times, for tens of thousands of
    customers); `warm_mu` is their reservations' warm total."""

    demands: list[float]
    warms: list[float]
    warm_mu: float
    guaranteed_short_mu: float = 0.0
    best_effort_demand_mu: float = 0.0
    best_effort_short_mu: float = 0.0
    cold_start_lead_mu: float = 0.0
    # Rule 3c's figures (see ModelOutcome), and whether the forecast sees a long valley.
    predictive: bool = False
    correction: SloCorrection | None = None
    headroom_mu: float = 0.0
    lift_mu: float = 0.0
    set_by: str = ""
    valley: bool = False


_LABELS = {
    "guaranteed": "guaranteed",
    "best_effort": "best-effort",
    "cold_start_lead": "the demand's trend within one cold start",
    "predicted": "predicted",
}


def _fill(
    need_mu: float,
    deployments: Sequence[DeploymentState],
    plan: _Plan,
    label: str,
    max_added: int | None = None,
) -> tuple[float, int]:
    """Add replicas cheapest $/MU first until `need_mu` is covered, at most `max_added` in all;
    return (what is missing, replicas added)."""
    replicas, pool_free, reasons = plan.replicas, plan.pool_free, plan.reasons
    total_added = 0
    for deployment in sorted(deployments, key=lambda d: (d.usd_per_mu, d.deployment_id)):
        if need_mu <= EPSILON:
            break
        per_replica = deployment.effective_mu_per_minute_per_replica
        if per_replica <= 0:
            continue
        wanted = math.ceil(need_mu / per_replica - EPSILON)
        room = deployment.max_replicas - replicas[deployment.deployment_id]
        fits = pool_free[deployment.pool_id] // deployment.gpus_per_replica
        ceiling = max_added - total_added if max_added is not None else wanted
        added = max(0, min(wanted, room, fits, ceiling))
        total_added += added
        if added:
            replicas[deployment.deployment_id] += added
            pool_free[deployment.pool_id] -= added * deployment.gpus_per_replica
            need_mu -= added * per_replica
            reasons[deployment.deployment_id].append(
                Reason(
                    label,
                    f"+{added} replica(s) for {_LABELS[label]} demand "
                    f"(${deployment.usd_per_mu * 1000:.4f} per 1,000 MU)",
                    {"added": added, "mu_per_minute_per_replica": per_replica},
                )
            )
        if wanted > added:
            if max_added is not None and ceiling <= min(room, fits):
                limited_by, by_what = "best_effort_ceiling", "the model's best-effort ceiling"
            elif room <= fits:
                limited_by, by_what = "max_replicas", "its max replicas"
            else:
                limited_by, by_what = "pool", "free GPUs in its pool"
            reasons[deployment.deployment_id].append(
                Reason(
                    f"{label}_limited",
                    f"wanted {wanted} more for {_LABELS[label]} demand, limited by {by_what}",
                    {"wanted": wanted, "added": added, "limited_by": limited_by},
                )
            )
    return max(0.0, need_mu), total_added


def _last_recommendation(deployment: DeploymentState) -> int | None:
    """The newest recommendation inside the window the snapshot gave, None without one."""
    if not deployment.recent_recommendations:
        return None
    return min(deployment.recent_recommendations)[1]


def decide(snapshot: Snapshot) -> Decisions:
    """The fleet's decisions for a snapshot: the module's rules, in order. Every model's
    minimums and warm reservations are placed before any best-effort, so a short pool gives
    up best-effort first; then each deployment's count is settled (idle models, hysteresis)
    and the held replicas are fitted back into their pools."""
    plan = _Plan(
        replicas={},
        pool_free={pool.pool_id: pool.gpu_count for pool in snapshot.pools},
        reasons={},
    )
    window = snapshot.settings.stabilisation_window_seconds
    _place_minimums(snapshot, plan)
    models = _place_guaranteed(snapshot, plan)
    # What an outside autoscaler may never go below: the minimums and the warm reservations.
    floors = dict(plan.replicas)
    _place_best_effort(snapshot, plan, models)

    decisions: list[DeploymentDecision] = []
    outcomes: list[ModelOutcome] = []
    allowances: list[Allowance] = []
    for model in snapshot.models:
        model_plan = models[model.model_id]
        keep_warm = any(c.keep_warm and c.reserved_mu_per_minute > 0 for c in model.customers)
        demand_total = _demand_total(model, model_plan)
        if model.prediction_enabled is not None:
            reason = _prediction_reason(model, model_plan)
            for d in model.deployments:
                plan.reasons[d.deployment_id].append(reason)
        for d in model.deployments:
            decisions.append(
                _deployment_decision(
                    model, d, plan, floors, demand_total, keep_warm, window, model_plan.valley
                )
            )
        outcomes.append(_outcome(model, model_plan, plan))
        allowances.extend(_allowances(model, model_plan.demands))

    # 7. Held replicas (stabilisation, unknown load) must still fit their pools.
    decisions = _fit_pools(decisions, snapshot)
    return Decisions(tuple(decisions), tuple(allowances), tuple(outcomes))


def _place_minimums(snapshot: Snapshot, plan: _Plan) -> None:
    """Rule 1: every deployment's `min_replicas`, as far as its pool's GPUs go, before any
    demand is planned; a pool that cannot hold the minimum says so."""
    for model in snapshot.models:
        for d in model.deployments:
            plan.reasons[d.deployment_id] = []
            fits = plan.pool_free.get(d.pool_id, 0) // d.gpus_per_replica
            keep = min(d.min_replicas, fits)
            plan.replicas[d.deployment_id] = keep
            plan.pool_free[d.pool_id] = plan.pool_free.get(d.pool_id, 0) - keep * d.gpus_per_replica
            if keep:
                plan.reasons[d.deployment_id].append(
                    Reason("min_replicas", f"{keep} replica(s) are the minimum", {"min": keep})
                )
            if keep < d.min_replicas:
                plan.reasons[d.deployment_id].append(
                    Reason(
                        "pool_short_of_min",
                        "its pool cannot hold even the minimum",
                        {"min": d.min_replicas, "placed": keep},
                    )
                )


def _place_guaranteed(snapshot: Snapshot, plan: _Plan) -> dict[int, _ModelPlan]:
    """Rule 2: hot capacity for the warm reservations, across all models before any
    best-effort (a reserved customer may ramp faster than a replica cold-starts). Returns
    each model's customer figures, computed here once, with what its reservations miss."""
    models: dict[int, _ModelPlan] = {}
    for model in snapshot.models:
        idle_window = idle_window_seconds(model)
        warms = [warm_reserved(c, idle_window) for c in model.customers]
        model_plan = _ModelPlan(
            demands=[_demand(c) for c in model.customers], warms=warms, warm_mu=sum(warms)
        )
        models[model.model_id] = model_plan
        need = model_plan.warm_mu - plan.planned_mu(model)
        model_plan.guaranteed_short_mu, _ = _fill(need, model.deployments, plan, "guaranteed")
    return models


def _place_best_effort(snapshot: Snapshot, plan: _Plan, models: dict[int, _ModelPlan]) -> None:
    """Rule 3 and 3b: best-effort demand on top of the warm reservations (never less than the
    binding bursts), within the model's best-effort ceiling; then the capacity the demand's
    trend will need within one cold start, within what the ceiling leaves. Rule 3c, where it
    applies, corrects the demand first."""
    for model in snapshot.models:
        model_plan = models[model.model_id]
        guaranteed = model_plan.warm_mu
        demand = _best_effort_demand(model, model_plan.demands, model_plan.warms)
        demand = max(demand, _binding_burst(model) - guaranteed)
        label = "best_effort"
        if _predictive(model):
            demand = (
                _predicted_demand(model, model_plan, guaranteed + demand, snapshot.settings)
                - guaranteed
            )
            label = "predicted"
        demand = max(0.0, demand)
        if model.best_effort_ceiling_mu_per_minute is not None:
            demand = min(demand, model.best_effort_ceiling_mu_per_minute)
        model_plan.best_effort_demand_mu = demand
        need = guaranteed + demand - plan.planned_mu(model)
        model_plan.best_effort_short_mu, added = _fill(
            need,
            model.deployments,
            plan,
            label,
            max_added=model.best_effort_ceiling_replicas,
        )
        # With a forecast, its rise is the lead; the trend's is for models without one.
        lead = 0.0 if model_plan.lift_mu > EPSILON else _cold_start_lead(model, guaranteed + demand)
        if model.best_effort_ceiling_mu_per_minute is not None:
            lead = min(lead, max(0.0, model.best_effort_ceiling_mu_per_minute - demand))
        model_plan.cold_start_lead_mu = lead
        if lead > EPSILON:
            room = model.best_effort_ceiling_replicas
            _fill(
                guaranteed + demand + lead - plan.planned_mu(model),
                model.deployments,
                plan,
                "cold_start_lead",
                max_added=None if room is None else max(0, room - added),
            )


def _predictive(model: ModelSnapshot) -> bool:
    """Rule 3c applies: prediction is on for the model and its traffic has been recorded for
    the burst window (less: the reactive rules, and the reasons say so)."""
    return bool(model.prediction_enabled) and (
        model.history_seconds >= PREDICTION_MIN_HISTORY_SECONDS
    )


def _forecast_lift(model: ModelSnapshot) -> float:
    """What the forecast adds within the next cold start, MU/min: its highest value there over
    its value when the measured level stands for (the forecast's own level error cancels; the
    measured level carries it)."""
    now, ahead = model.forecast_now_mu_per_minute, model.forecast_ahead_mu_per_minute
    if now is None or ahead is None:
        return 0.0
    return max(0.0, ahead - now)


def _predicted_demand(
    model: ModelSnapshot, model_plan: _ModelPlan, reactive: float, settings: PolicySettings
) -> float:
    """Rule 3c: the model's demand (MU/min, planned at the target utilisation), from
    `reactive` (rule 3's: the warm reservations, the use and refusals above them, the binding
    bursts read from the traffic), plus the forecast's rise within the next cold start, over the
    capacity per replica corrected by the delivered SLO. Records what it found in
    `model_plan`."""
    correction = corrected(
        model.slo_correction_in_force,
        model.delivered_slo_attainment,
        model.delivered_requests,
        model.slo_target,
        gain=settings.slo_gain,
    )
    utilisation = max((d.target_utilisation for d in model.deployments), default=1.0)
    lift = _forecast_lift(model)
    need = (reactive + lift) / correction.factor
    burst = _binding_burst(model)
    guaranteed = model_plan.warm_mu
    model_plan.predictive = True
    model_plan.correction = correction
    model_plan.headroom_mu = burst / utilisation if utilisation else 0.0
    model_plan.lift_mu = lift
    if guaranteed >= need - EPSILON:
        model_plan.set_by = "reservation"
    elif lift >= 0.1 * need:
        model_plan.set_by = "forecast"
    elif burst > 0 and burst >= reactive - EPSILON:
        model_plan.set_by = "burst_headroom"
    else:
        model_plan.set_by = "demand"
    peak_hour = model.forecast_next_hour_peak_mu_per_minute
    now = model.forecast_now_mu_per_minute
    model_plan.valley = peak_hour is not None and now is not None and peak_hour <= now + EPSILON
    return need


# Rule 3c's `set_by` codes (ModelOutcome.set_by), as the reasons and the planner word them.
SET_BY_LABELS = {
    "reservation": "the warm reservations",
    "forecast": "the forecast's rise within one cold start",
    "burst_headroom": "the burst headroom",
    "demand": "the demand's level",
}


def _prediction_reason(model: ModelSnapshot, model_plan: _ModelPlan) -> Reason:
    """What rule 3c did for the model, or why it did not apply."""
    if not model.prediction_enabled:
        return Reason(
            "prediction_off", "prediction is off for this model: the reactive rules size it", {}
        )
    if not model_plan.predictive:
        minutes = model.history_seconds / 60
        needed = PREDICTION_MIN_HISTORY_SECONDS / 60
        return Reason(
            "prediction_warming_up",
            f"{minutes:.0f} of the {needed:.0f} minutes of traffic prediction needs: the "
            "reactive rules size it until then",
            {"history_seconds": model.history_seconds},
        )
    correction = model_plan.correction
    assert correction is not None
    forecast = (
        "no forecast yet (under two days of history)"
        if model.forecast_now_mu_per_minute is None
        else f"forecast {model.forecast_now_mu_per_minute:.0f} MU/min now, "
        f"+{model_plan.lift_mu:.0f} within one cold start"
    )
    return Reason(
        "predicted",
        f"target set by {SET_BY_LABELS[model_plan.set_by]}; burst headroom "
        f"+{model_plan.headroom_mu:.0f} MU/min over the level; {forecast}; "
        f"{correction.message}",
        {
            "set_by": model_plan.set_by,
            "burst_headroom_mu_per_minute": model_plan.headroom_mu,
            "forecast_lift_mu_per_minute": model_plan.lift_mu,
            "forecast_now_mu_per_minute": model.forecast_now_mu_per_minute,
            "slo_correction": correction.factor,
            "slo_code": correction.code,
            "delivered_slo_attainment": model.delivered_slo_attainment,
        },
    )


def _demand_total(model: ModelSnapshot, model_plan: _ModelPlan) -> float:
    """Everything that would keep the model's replicas (rule 6 reads it: none at all is an
    idle model): the queues, the gateways' waiting requests, binding bursts, each customer's
    demand or warm reservation (the higher) and what metering missed."""
    return (
        model.waiting_mu
        + gateway_waiting_mu_per_minute(model)
        + _binding_burst(model)
        + sum(map(max, model_plan.demands, model_plan.warms))
        + _unmetered(model)
    )


def _deployment_decision(
    model: ModelSnapshot,
    d: DeploymentState,
    plan: _Plan,
    floors: dict[int, int],
    demand_total: float,
    keep_warm: bool,
    window: float,
    valley: bool = False,
) -> DeploymentDecision:
    """One deployment's recommendation (what was placed, an idle model's warm replica, within
    min and max) and its target (the recommendation held by hysteresis and unknown load)."""
    recommended = plan.replicas[d.deployment_id]
    why = plan.reasons[d.deployment_id]
    if d.mu_per_minute_per_replica is None:
        why.append(
            Reason(
                "no_cost_model",
                "no cost model for this GPU type: sized by its minimum only",
                {},
            )
        )
    if demand_total <= EPSILON and recommended == 0 and d.current_replicas > 0:
        recommended = _idle_recommendation(model, d, keep_warm, why)
    recommended = min(max(recommended, d.min_replicas), d.max_replicas)
    target = _stabilised_target(model, d, recommended, window, why, valley)
    return DeploymentDecision(
        deployment_id=d.deployment_id,
        model_id=model.model_id,
        current_replicas=d.current_replicas,
        recommended_replicas=recommended,
        target_replicas=target,
        reasons=tuple(why),
        ready_replicas=d.ready_replicas,
        starting_replicas=d.starting_replicas,
        draining_replicas=d.draining_replicas,
        floor_replicas=floors[d.deployment_id],
        ceiling_replicas=_ceiling(d, floors[d.deployment_id], model),
    )


def _idle_recommendation(
    model: ModelSnapshot, d: DeploymentState, keep_warm: bool, why: list[Reason]
) -> int:
    """Rule 6, for a deployment of a model without demand that still runs replicas and was
    given none: one replica while a reservation keeps the model warm or until the idle window
    has passed, none after it, and none where the last plan had none for customers."""
    idle_window = d.scale_to_zero_after_seconds
    idle = model.idle_seconds
    if keep_warm:
        why.append(Reason("keep_warm", "a reservation keeps the model warm", {}))
        return 1
    if idle_window is not None and (idle is None or idle >= idle_window):
        why.append(
            Reason("scale_to_zero", f"idle for over {idle_window:.0f} s", {"idle_seconds": idle})
        )
        return 0
    if _last_recommendation(d) == 0:
        why.append(
            Reason(
                "not_planned",
                "the last plan had no replica here for customers (those running "
                "were not theirs: a benchmark's, just released): none is kept warm",
                {},
            )
        )
        return 0
    if idle_window is None:
        why.append(Reason("never_scale_to_zero", "scale to zero is off", {}))
        return 1
    why.append(
        Reason(
            "idle_wait",
            f"idle {idle:.0f} s of {idle_window:.0f} s before scaling to zero",
            {"idle_seconds": idle},
        )
    )
    return 1


def _stabilised_target(
    model: ModelSnapshot,
    d: DeploymentState,
    recommended: int,
    window: float,
    why: list[Reason],
    valley: bool = False,
) -> int:
    """Rule 5: up at once; down only to the highest recommendation inside the stabilisation
    window, and not while no tick recommended inside it; unknown load holds the count. Under
    rule 3c, a forecast that stays at or below demand now for the next hour (a long valley)
    releases at once: the window guards against demand coming back, which the forecast rules
    out. (A forecast rise within the cold start is in the recommendation already.)"""
    if recommended > d.current_replicas:
        why.append(Reason("scale_up", f"up from {d.current_replicas} to {recommended} at once", {}))
        return recommended
    if recommended == d.current_replicas:
        return recommended
    if not model.load_known:
        why.append(
            Reason(
                "load_unknown",
                "load is unknown: holding the current count rather than scaling down",
                {},
            )
        )
        return d.current_replicas
    if valley:
        why.append(
            Reason(
                "forecast_valley",
                f"down to {recommended} at once: the forecast does not rise within the hour",
                {},
            )
        )
        return recommended
    in_window = [r for age, r in d.recent_recommendations if age <= window]
    # No tick inside the window (a fresh start, a long pause): no evidence that demand stayed
    # low for the whole window, so the current count stands.
    highest = max([recommended, *in_window]) if in_window else d.current_replicas
    target = min(d.current_replicas, highest)
    if target > recommended:
        why.append(
            Reason(
                "stabilising",
                f"scale-down held at {target}: the "
                f"highest recommendation of the last {window:.0f} s",
                {"highest": highest, "window_seconds": window},
            )
        )
    else:
        why.append(Reason("scale_down", f"down to {target}", {}))
    return target


def _outcome(model: ModelSnapshot, model_plan: _ModelPlan, plan: _Plan) -> ModelOutcome:
    """What the model was sold, asked for and given, and what it is short of (the planner's
    pages and the sellability re-check read it)."""
    return ModelOutcome(
        model_id=model.model_id,
        guaranteed_mu_per_minute=sum(c.reserved_mu_per_minute for c in model.customers),
        best_effort_demand_mu_per_minute=model_plan.best_effort_demand_mu,
        planned_mu_per_minute=plan.planned_mu(model),
        guaranteed_shortfall_mu_per_minute=model_plan.guaranteed_short_mu,
        best_effort_shortfall_mu_per_minute=model_plan.best_effort_short_mu,
        warm_guaranteed_mu_per_minute=model_plan.warm_mu,
        refused_guaranteed_mu_per_minute=sum(
            c.refused_guaranteed_mu_per_minute for c in model.customers
        ),
        refused_best_effort_mu_per_minute=sum(
            c.refused_best_effort_mu_per_minute for c in model.customers
        ),
        gateway_waiting_mu=model.gateway_waiting_mu,
        cold_start_lead_mu_per_minute=model_plan.cold_start_lead_mu,
        ready_mu_per_minute=_ready_mu(model),
        predictive=model_plan.predictive,
        slo_correction=(
            model_plan.correction.factor
            if model_plan.correction is not None
            else model.slo_correction_in_force
        ),
        slo_code=model_plan.correction.code if model_plan.correction is not None else "",
        burst_headroom_mu_per_minute=model_plan.headroom_mu,
        forecast_lift_mu_per_minute=model_plan.lift_mu,
        set_by=model_plan.set_by,
    )


def _ceiling(deployment: DeploymentState, floor: int, model: ModelSnapshot) -> int:
    if model.best_effort_ceiling_replicas is None:
        return deployment.max_replicas
    return min(deployment.max_replicas, floor + model.best_effort_ceiling_replicas)


def _unmetered(model: ModelSnapshot) -> float:
    """What the engines served beyond what was metered (usage events lag, or a gateway posts
    none): counted as demand, never as a reason to scale down."""
    if model.engine_mu_per_minute is None:
        return 0.0
    metered = sum(c.recent_mu_per_minute for c in model.customers)
    return max(0.0, model.engine_mu_per_minute - metered)


def _best_effort_demand(model: ModelSnapshot, demands: list[float], warms: list[float]) -> float:
    """MU/min beyond the warm reservations: customers' use and refusals above them, the
    gateways' waiting requests, the engines' queues and what metering missed. `demands` and
    `warms`: each customer's `_demand` and `warm_reserved`, in the model's order."""
    return (
        model.waiting_mu
        + gateway_waiting_mu_per_minute(model)
        + _unmetered(model)
        + sum(max(0.0, d - w) for d, w in zip(demands, warms, strict=True))
    )


def _ready_mu(model: ModelSnapshot) -> float:
    return sum(d.ready_replicas * d.effective_mu_per_minute_per_replica for d in model.deployments)


def _cold_start_lead(model: ModelSnapshot, demand: float) -> float:
    """MU/min to add now for the trend: what demand gains within one cold start, when that
    would pass the ready capacity (a replica asked for once it has would come a cold start
    too late); else 0."""
    slope = max(0.0, model.demand_trend_mu_per_minute_per_second)
    if slope <= EPSILON:
        return 0.0
    # The recent mean sits in the middle of its window: project it to one cold start from now.
    mean = sum(c.recent_mu_per_minute + c.refused_mu_per_minute for c in model.customers)
    projected = mean + slope * (RECENT_WINDOW_SECONDS / 2 + cold_start_lead_seconds(model))
    # The ready capacity at its full rate: the target utilisation's headroom is there to take
    # growth within a cold start, so only growth beyond it needs a replica now.
    ready_full = sum(
        d.ready_replicas * (d.mu_per_minute_per_replica or 0.0) for d in model.deployments
    )
    if projected <= max(demand, ready_full) + EPSILON:
        return 0.0
    return projected - demand


def _fit_pools(decisions: list[DeploymentDecision], snapshot: Snapshot) -> list[DeploymentDecision]:
    """Trim replicas held above their recommendation until every pool fits its inventory."""
    by_id = {d.deployment_id: d for m in snapshot.models for d in m.deployments}
    used: dict[int, int] = {}
    for decision in decisions:
        state = by_id[decision.deployment_id]
        used[state.pool_id] = used.get(state.pool_id, 0) + (
            decision.target_replicas * state.gpus_per_replica
        )
    capacity = {pool.pool_id: pool.gpu_count for pool in snapshot.pools}
    result = []
    for decision in decisions:
        state = by_id[decision.deployment_id]
        over = used[state.pool_id] - capacity.get(state.pool_id, 0)
        if over > 0 and decision.target_replicas > decision.recommended_replicas:
            held = decision.target_replicas - decision.recommended_replicas
            trim = min(held, math.ceil(over / state.gpus_per_replica))
            used[state.pool_id] -= trim * state.gpus_per_replica
            decision = replace(
                decision,
                target_replicas=decision.target_replicas - trim,
                reasons=(
                    *decision.reasons,
                    Reason(
                        "pool_full",
                        f"{trim} held replica(s) released: the pool's GPUs are needed elsewhere",
                        {"released": trim},
                    ),
                ),
            )
        result.append(decision)
    return result


def _allowances(model: ModelSnapshot, demands: list[float]) -> list[Allowance]:
    """`demands`: each customer's `_demand`, in the model's order."""
    # Ready capacity only: a replica still loading its weights serves nothing yet; and what
    # reservations use now stays theirs.
    in_use = sum(c.reserved_in_use_mu_per_minute for c in model.customers)
    slack = max(0.0, _ready_mu(model) - in_use)
    if model.best_effort_ceiling_mu_per_minute is not None:
        slack = min(slack, model.best_effort_ceiling_mu_per_minute)
    # One pass per sum, in the customers' order (the same floats as ever); tens of thousands of
    # customers a tick, so the loop below does no more than it must.
    extra = [
        max(0.0, d - c.reserved_mu_per_minute)
        for c, d in zip(model.customers, demands, strict=True)
    ]
    total_extra = sum(extra)
    total_weight = sum(max(0.0, c.tier_weight) for c in model.customers)
    customers = len(model.customers) or 1
    by_weight = total_weight > EPSILON
    by_extra = total_extra > EPSILON
    demand_slack = slack * BEST_EFFORT_DEMAND_SHARE
    even_slack = slack * (1 - BEST_EFFORT_DEMAND_SHARE)
    model_id = model.model_id
    result: list[Allowance] = []
    append = result.append
    for c, customer_extra in zip(model.customers, extra, strict=True):
        # Tiers all weighted 0 would give no one the slack: split it evenly then.
        weighted = max(0.0, c.tier_weight) / total_weight if by_weight else 1 / customers
        by_demand = demand_slack * (customer_extra / total_extra if by_extra else weighted)
        evenly = even_slack * weighted
        append(Allowance(c.customer_id, model_id, c.reserved_mu_per_minute, by_demand + evenly))
    return result
