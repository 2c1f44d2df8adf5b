"""The allocation policy: a pure function from a snapshot of the fleet to decisions (DESIGN §2).

Plain data in, plain data out — no database, no clock, no network — so the live tick and the
fleet simulator run the very same code. Rules, in order:

1. Every deployment keeps its `min_replicas` (GPU inventory permitting).
2. Guaranteed first: for every model, enough hot capacity for the sum of its active
   reservations (a reserved customer may ramp to its reservation faster than a replica can
   cold-start, so that capacity must already run), spread over its deployments cheapest $/MU
   first, within the GPUs its pools have left.
3. Then best-effort demand (recent use above reservations, at its recent peak, plus the
   requests queued in the engines), the same way; for bursty traffic, never less in all than
   the rate that starts its sub-minute bursts within the TTFT SLO (`capacity.allocation.bursts`).
   A short pool therefore reclaims best-effort before guaranteed, and shortfalls are reported.
4. Capacity per replica counts at the deployment's target utilisation.
5. Scale up at once; scale down only to the highest recommendation inside the stabilisation
   window (default 120 s), and not at all while no tick has recommended inside it. Unknown
   load holds the current count rather than scaling down.
6. No demand and no reservation keeping the model warm: keep one replica until the model has
   been idle for its deployment's `scale_to_zero_after_seconds`, then none.
7. Never below min, never above max or the pool's inventory.

Admission allowances: each customer's guaranteed bucket is its reservation; best-effort gets
the hot capacity left over, split 80 % by recent best-effort demand and 20 % evenly.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

EPSILON = 1e-9
BEST_EFFORT_DEMAND_SHARE = 0.8
# The demand the policy is fed (by the live tick and the fleet simulator alike): the mean of
# the last RECENT_WINDOW, the busiest minute of the last PEAK_WINDOW, and the bursts of the
# last BURST_WINDOW.
RECENT_WINDOW_SECONDS = 300
PEAK_WINDOW_SECONDS = 300
BURST_WINDOW_SECONDS = 1800
BURSTY_RATIO = 1.5


@dataclass(frozen=True)
class PolicySettings:
    stabilisation_window_seconds: float = 120.0


@dataclass(frozen=True)
class CustomerDemand:
    customer_id: int
    reserved_mu_per_minute: float
    recent_mu_per_minute: float  # mean over the last few minutes
    peak_mu_per_minute: float  # busiest recent minute
    keep_warm: bool = False


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

    @property
    def effective_mu_per_minute_per_replica(self) -> float:
        return (self.mu_per_minute_per_replica or 0.0) * self.target_utilisation

    @property
    def usd_per_mu(self) -> float:
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
        return {"code": self.code, "message": self.message, "data": self.data}


@dataclass(frozen=True)
class DeploymentDecision:
    deployment_id: int
    model_id: int
    current_replicas: int
    recommended_replicas: int
    target_replicas: int
    reasons: tuple[Reason, ...]


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


@dataclass(frozen=True)
class Decisions:
    deployments: tuple[DeploymentDecision, ...]
    allowances: tuple[Allowance, ...]
    models: tuple[ModelOutcome, ...]

    def for_deployment(self, deployment_id: int) -> DeploymentDecision:
        return next(d for d in self.deployments if d.deployment_id == deployment_id)


def _demand(customer: CustomerDemand) -> float:
    """MU/min to plan for: the recent mean or the busiest recent minute, the higher."""
    return max(customer.recent_mu_per_minute, customer.peak_mu_per_minute)


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


def _fill(
    need_mu: float,
    deployments: Sequence[DeploymentState],
    replicas: dict[int, int],
    pool_free: dict[int, int],
    reasons: dict[int, list[Reason]],
    label: str,
) -> float:
    """Add replicas cheapest $/MU first until `need_mu` is covered; return what is missing."""
    for deployment in sorted(deployments, key=lambda d: (d.usd_per_mu, d.deployment_id)):
        if need_mu <= EPSILON:
            break
        per_replica = deployment.effective_mu_per_minute_per_replica
        if per_replica <= 0:
            continue
        wanted = math.ceil(need_mu / per_replica - EPSILON)
        room = deployment.max_replicas - replicas[deployment.deployment_id]
        fits = pool_free[deployment.pool_id] // deployment.gpus_per_replica
        added = max(0, min(wanted, room, fits))
        if added:
            replicas[deployment.deployment_id] += added
            pool_free[deployment.pool_id] -= added * deployment.gpus_per_replica
            need_mu -= added * per_replica
            reasons[deployment.deployment_id].append(
                Reason(
                    label,
                    f"+{added} replica(s) for {label.replace('_', '-')} demand "
                    f"(${deployment.usd_per_mu * 1000:.4f} per 1,000 MU)",
                    {"added": added, "mu_per_minute_per_replica": per_replica},
                )
            )
        limited_by = "max_replicas" if room <= fits else "pool"
        if wanted > added:
            reasons[deployment.deployment_id].append(
                Reason(
                    f"{label}_limited",
                    f"wanted {wanted} more for {label.replace('_', '-')} demand, "
                    f"limited by {'its max replicas' if limited_by == 'max_replicas' else 'free GPUs in its pool'}",  # noqa: E501
                    {"wanted": wanted, "added": added, "limited_by": limited_by},
                )
            )
    return max(0.0, need_mu)


def decide(snapshot: Snapshot) -> Decisions:
    pool_free = {pool.pool_id: pool.gpu_count for pool in snapshot.pools}
    replicas: dict[int, int] = {}
    reasons: dict[int, list[Reason]] = {}
    window = snapshot.settings.stabilisation_window_seconds

    # 1. Minimums.
    for model in snapshot.models:
        for d in model.deployments:
            reasons[d.deployment_id] = []
            fits = pool_free.get(d.pool_id, 0) // d.gpus_per_replica
            keep = min(d.min_replicas, fits)
            replicas[d.deployment_id] = keep
            pool_free[d.pool_id] = pool_free.get(d.pool_id, 0) - keep * d.gpus_per_replica
            if keep:
                reasons[d.deployment_id].append(
                    Reason("min_replicas", f"{keep} replica(s) are the minimum", {"min": keep})
                )
            if keep < d.min_replicas:
                reasons[d.deployment_id].append(
                    Reason(
                        "pool_short_of_min",
                        "its pool cannot hold even the minimum",
                        {"min": d.min_replicas, "placed": keep},
                    )
                )

    def planned(model: ModelSnapshot) -> float:
        return sum(
            replicas[d.deployment_id] * d.effective_mu_per_minute_per_replica
            for d in model.deployments
        )

    # 2. Guaranteed, across all models, before any best-effort.
    guaranteed_short: dict[int, float] = {}
    for model in snapshot.models:
        guaranteed = sum(c.reserved_mu_per_minute for c in model.customers)
        need = guaranteed - planned(model)
        guaranteed_short[model.model_id] = _fill(
            need, model.deployments, replicas, pool_free, reasons, "guaranteed"
        )

    # 3. Best-effort.
    best_effort_short: dict[int, float] = {}
    best_effort_demand: dict[int, float] = {}
    for model in snapshot.models:
        guaranteed = sum(c.reserved_mu_per_minute for c in model.customers)
        demand = model.waiting_mu + sum(
            max(0.0, _demand(c) - c.reserved_mu_per_minute) for c in model.customers
        )
        demand = max(demand, _binding_burst(model) - guaranteed)
        best_effort_demand[model.model_id] = demand
        need = guaranteed + demand - planned(model)
        best_effort_short[model.model_id] = _fill(
            need, model.deployments, replicas, pool_free, reasons, "best_effort"
        )

    decisions: list[DeploymentDecision] = []
    outcomes: list[ModelOutcome] = []
    allowances: list[Allowance] = []
    for model in snapshot.models:
        keep_warm = any(c.keep_warm and c.reserved_mu_per_minute > 0 for c in model.customers)
        demand_total = (
            model.waiting_mu
            + _binding_burst(model)
            + sum(max(_demand(c), c.reserved_mu_per_minute) for c in model.customers)
        )
        for d in model.deployments:
            recommended = replicas[d.deployment_id]
            why = reasons[d.deployment_id]
            if d.mu_per_minute_per_replica is None:
                why.append(
                    Reason(
                        "no_cost_model",
                        "no cost model for this GPU type: sized by its minimum only",
                        {},
                    )
                )
            # 6. Idle models: one replica until the idle window has passed.
            if demand_total <= EPSILON and recommended == 0 and d.current_replicas > 0:
                idle_window = d.scale_to_zero_after_seconds
                idle = model.idle_seconds
                if keep_warm:
                    recommended = max(1, recommended)
                    why.append(Reason("keep_warm", "a reservation keeps the model warm", {}))
                elif idle_window is None:
                    recommended = 1
                    why.append(Reason("never_scale_to_zero", "scale to zero is off", {}))
                elif idle is None or idle >= idle_window:
                    why.append(
                        Reason(
                            "scale_to_zero",
                            f"idle for over {idle_window:.0f} s",
                            {"idle_seconds": idle},
                        )
                    )
                else:
                    recommended = 1
                    why.append(
                        Reason(
                            "idle_wait",
                            f"idle {idle:.0f} s of {idle_window:.0f} s before scaling to zero",
                            {"idle_seconds": idle},
                        )
                    )
            recommended = min(max(recommended, d.min_replicas), d.max_replicas)

            # 5. Hysteresis and unknown load.
            target = recommended
            if recommended < d.current_replicas:
                if not model.load_known:
                    target = d.current_replicas
                    why.append(
                        Reason(
                            "load_unknown",
                            "load is unknown: holding the current count rather than scaling down",
                            {},
                        )
                    )
                else:
                    in_window = [r for age, r in d.recent_recommendations if age <= window]
                    # No tick inside the window (a fresh start, a long pause): no evidence that
                    # demand stayed low for the whole window, so the current count stands.
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
            elif recommended > d.current_replicas:
                why.append(
                    Reason("scale_up", f"up from {d.current_replicas} to {recommended} at once", {})
                )
            decisions.append(
                DeploymentDecision(
                    deployment_id=d.deployment_id,
                    model_id=model.model_id,
                    current_replicas=d.current_replicas,
                    recommended_replicas=recommended,
                    target_replicas=target,
                    reasons=tuple(why),
                )
            )

        # 7. Held replicas (stabilisation, unknown load) must still fit their pools.
        guaranteed = sum(c.reserved_mu_per_minute for c in model.customers)
        outcomes.append(
            ModelOutcome(
                model_id=model.model_id,
                guaranteed_mu_per_minute=guaranteed,
                best_effort_demand_mu_per_minute=best_effort_demand[model.model_id],
                planned_mu_per_minute=planned(model),
                guaranteed_shortfall_mu_per_minute=guaranteed_short[model.model_id],
                best_effort_shortfall_mu_per_minute=best_effort_short[model.model_id],
            )
        )
        allowances.extend(_allowances(model, guaranteed))

    decisions = _fit_pools(decisions, snapshot)
    return Decisions(tuple(decisions), tuple(allowances), tuple(outcomes))


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
            decision = DeploymentDecision(
                deployment_id=decision.deployment_id,
                model_id=decision.model_id,
                current_replicas=decision.current_replicas,
                recommended_replicas=decision.recommended_replicas,
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


def _allowances(model: ModelSnapshot, guaranteed: float) -> list[Allowance]:
    hot = sum(d.ready_replicas * d.effective_mu_per_minute_per_replica for d in model.deployments)
    slack = max(0.0, hot - guaranteed)
    extra = {
        c.customer_id: max(0.0, _demand(c) - c.reserved_mu_per_minute) for c in model.customers
    }
    total_extra = sum(extra.values())
    customers = len(model.customers) or 1
    result = []
    for c in model.customers:
        by_demand = (
            slack
            * BEST_EFFORT_DEMAND_SHARE
            * (extra[c.customer_id] / total_extra if total_extra > EPSILON else 1 / customers)
        )
        evenly = slack * (1 - BEST_EFFORT_DEMAND_SHARE) / customers
        result.append(
            Allowance(
                customer_id=c.customer_id,
                model_id=model.model_id,
                guaranteed_mu_per_minute=c.reserved_mu_per_minute,
                best_effort_mu_per_minute=by_demand + evenly,
            )
        )
    return result
