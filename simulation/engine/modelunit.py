"""The live allocation policy (`capacity.allocation.policy.decide`) as a simulator autoscaler, and
the admission allowances it gives.

The very same pure function the allocation tick runs is called every simulated tick, with a
snapshot built the way the live tick builds it (`capacity.allocation.tick`), from what it could
observe live and nothing from the future (`LiveDemand`):

- per customer, the MU its completed requests used (usage events), rolled up per whole minute:
  `recent` is the mean of the last RECENT_WINDOW's whole minutes, `peak` the busiest whole
  minute of the last PEAK_WINDOW (the minute in progress is left out, as the live tick leaves
  out a minute whose rollup is not complete);
- per customer, the MU admission refused (refused usage events' estimated MU), by the class it
  was refused in, as the mean of the same whole minutes as `recent`;
- bursts (`capacity.allocation.bursts`) of all requests by the second they started (usage
  events' `started_at`) over the last BURST_WINDOW: the completed ones at their MU, the refused
  ones at theirs (a refused event's estimated MU). Counting refused requests matters: behind
  admission, a burst the allowance turns away would otherwise vanish from the burst signal,
  and the fleet would stop planning for the bursts it refuses (on Azure's code trace: 4 % fewer
  GPU-hours and 97.7 % SLO attainment instead of 99 %);
- the requests waiting in the engines (vLLM's `num_requests_waiting`) and those held for want
  of a ready replica (the gateways' `gw:v1:waiting`), each priced at the mean request's MU;
- the replicas asked for and those observed ready, starting and draining, the customers'
  reservations, and the previous ticks' recommendations (the scale-down stabilisation window);
- the customers: every client allowed on the model (the trace's clients, as entitlements),
  with or without a reservation or history.

Not fed: the engines' own MU/min (Prometheus), a floor for when metering lags, since the
simulator's metering never lags (it would equal the metered MU); and the demand's trend, whose
live computation the tick does not define yet (the cold-start lead stays off).

A model of several deployments (`PolicyContext.fleet`): the snapshot holds every deployment,
each with its own replica capacity, GPUs per replica and their price, cold start and idle
window, the replicas observed of it and its own recent recommendations, its limit its share of
the fleet's cap (`DeploymentFleet.place`: all it holds without a cap), and the pools' GPUs,
shared by the deployments on them; the policy spreads the demand over them cheapest $/MU first
as it does live, and `ModelUnitAutoscaler.deployment_targets()` gives the fleet its target for
each.

Admission allowances: `ModelUnitAutoscaler.allowances` holds those of its latest decision (the
policy's, from the replicas observed ready). `LiveAllowances` gives the same allowances for a
fleet some other policy sizes: it builds the same snapshot with that fleet's observed replicas
and reads the allowances of `decide()`, so every policy is admitted under the policy's own
allowance code, never a copy of it.
"""

from collections import defaultdict, deque
from collections.abc import Callable, Sequence

from capacity.admission.bucket import DEFAULT_BURST_SECONDS
from capacity.allocation.bursts import Bursts, bursts
from capacity.allocation.policy import (
    BURST_WINDOW_SECONDS,
    PEAK_WINDOW_SECONDS,
    RECENT_WINDOW_SECONDS,
    CustomerDemand,
    Decisions,
    DeploymentDecision,
    DeploymentState,
    ModelSnapshot,
    PolicySettings,
    PoolState,
    Snapshot,
    decide,
)
from capacity.allocation.trend import TREND_MINUTES, demand_trend_mu_per_minute_per_second
from simulation.engine.admission import TokenBucketAdmission
from simulation.engine.autoscaling import Autoscaler, DeploymentReplicas, Observation
from simulation.engine.deployments import DeploymentFleet
from simulation.engine.policy_context import PolicyContext

# The live tick's windows.
RECENT_MINUTES = RECENT_WINDOW_SECONDS // 60
PEAK_MINUTES = PEAK_WINDOW_SECONDS // 60
# The live tick's scale-down stabilisation is a setting (ALLOCATION_STABILISATION_SECONDS in
# controlplane.settings): the caller passes it in; this is that setting's default.
DEFAULT_STABILISATION_SECONDS = 120.0

# The client's rates for admission: (guaranteed, best-effort) MU/min.
Rates = tuple[dict[str, float], dict[str, float]]
# Per deployment of a fleet: (seconds before now, recommended replicas) of earlier ticks.
Recommendations = tuple[tuple[float, int], ...]


def observed_replicas(
    fleet: DeploymentFleet, observation: Observation
) -> tuple[DeploymentReplicas, ...]:
    """Each deployment's replicas in the observation; an observation that only counts them
    (a fleet sized in replicas of the unit: the searches' and the opening fleet's) has them
    placed as the fleet places a policy's count."""
    if observation.deployments:
        return observation.deployments
    ready = fleet.place(observation.ready_replicas)
    current = fleet.place(observation.current_replicas)
    return tuple(
        DeploymentReplicas(current=max(c, r), ready=r, starting=max(0, c - r), draining=0)
        for c, r in zip(current, ready, strict=True)
    )


class LiveDemand:
    """What the live tick reads of a model, recorded from the simulator's observations."""

    def __init__(self, context: PolicyContext, *, track_bursts: bool = True) -> None:
        self.context = context
        # Bursts are for sizing; allowances do not read them (LiveAllowances skips them).
        self.track_bursts = track_bursts
        # minute index -> {client: MU completed in that minute}
        self._minutes: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        # minute index -> {(client, refused in the guaranteed class): MU refused in that minute}
        self._refused: dict[int, dict[tuple[str, bool], float]] = defaultdict(
            lambda: defaultdict(float)
        )
        # second -> MU of the completed requests that started in that second
        self._starts: dict[int, float] = defaultdict(float)
        self._last_use_s: float | None = None
        # client -> when it last used the model; the reservations start with the simulation.
        self._client_last_use_s: dict[str, float] = {}
        self.start_s: float | None = None
        # Customer ids: the allowed clients and the reserved ones first, in name order, then
        # any other client in the order it appears.
        self._ids: dict[str, int] = {
            client: index
            for index, client in enumerate(
                sorted(set(context.clients) | set(context.reservations_mu_per_minute))
            )
        }
        self._clients: dict[int, str] = {index: client for client, index in self._ids.items()}

    def client_of(self, customer_id: int) -> str:
        return self._clients[customer_id]

    def _id(self, client: str) -> int:
        if client not in self._ids:
            index = len(self._ids)
            self._ids[client] = index
            self._clients[index] = client
        return self._ids[client]

    def record(self, observation: Observation) -> None:
        now = observation.timestamp_s
        if self.start_s is None:
            self.start_s = now
        # The window (now - window, now] lies in one minute when ticks divide the minute.
        minute = int((now - 1e-6) // 60)
        for client, mu in observation.mu_used_by_client.items():
            self._minutes[minute][client] += mu
            self._client_last_use_s[client] = now
            self._id(client)
        for client, arrival_s, mu, guaranteed in observation.refused_mu:
            self._refused[minute][(client, guaranteed)] += mu
            if self.track_bursts:
                # A refused burst is a burst the fleet did not serve: it counts at its MU.
                self._starts[int(arrival_s)] += mu
            # A refused request is still a request: the customer used (asked for) the model.
            self._client_last_use_s[client] = now
            self._id(client)
        if self.track_bursts:
            for _client, started_s, mu in observation.completed_mu:
                self._starts[int(started_s)] += mu
            for stale in [k for k in self._starts if k < now - BURST_WINDOW_SECONDS]:
                del self._starts[stale]
        if observation.mu_used_by_client or observation.refused_mu:
            self._last_use_s = now
        oldest = int(now // 60) - PEAK_MINUTES
        for series in (self._minutes, self._refused):
            for stale in [m for m in series if m < oldest]:
                del series[stale]

    def customers(self, now: float) -> tuple[CustomerDemand, ...]:
        start = self.start_s if self.start_s is not None else now
        whole = int(now // 60)  # the minute in progress; only earlier minutes are complete
        peak_minutes = [self._minutes.get(m, {}) for m in range(whole - PEAK_MINUTES, whole)]
        recent_minutes = peak_minutes[-RECENT_MINUTES:]
        refused_minutes = [self._refused.get(m, {}) for m in range(whole - RECENT_MINUTES, whole)]
        reservations = self.context.reservations_mu_per_minute
        return tuple(
            CustomerDemand(
                customer_id=index,
                reserved_mu_per_minute=reservations.get(client, 0.0),
                recent_mu_per_minute=sum(m.get(client, 0.0) for m in recent_minutes)
                / RECENT_MINUTES,
                peak_mu_per_minute=max(m.get(client, 0.0) for m in peak_minutes),
                keep_warm=self.context.keep_warm,
                refused_guaranteed_mu_per_minute=sum(
                    m.get((client, True), 0.0) for m in refused_minutes
                )
                / RECENT_MINUTES,
                refused_best_effort_mu_per_minute=sum(
                    m.get((client, False), 0.0) for m in refused_minutes
                )
                / RECENT_MINUTES,
                # As the live snapshot: since the last use or the reservation's start.
                idle_seconds=now - max(self._client_last_use_s.get(client, start), start),
            )
            for client, index in sorted(self._ids.items(), key=lambda item: item[1])
        )

    def trend(self, now: float) -> float:
        """The demand's trend as the live snapshot reads it (capacity.allocation.trend): the
        last TREND_MINUTES complete minutes of served plus refused MU."""
        whole = int(now // 60)
        minutes = range(whole - TREND_MINUTES, whole)
        return demand_trend_mu_per_minute_per_second(
            [
                sum(self._minutes.get(m, {}).values()) + sum(self._refused.get(m, {}).values())
                for m in minutes
            ]
        )

    def bursts(self, now: float) -> Bursts:
        start_s = int(now) - BURST_WINDOW_SECONDS
        bins = [0.0] * (BURST_WINDOW_SECONDS + 1)
        for second, mu in self._starts.items():
            if second >= start_s:
                bins[second - start_s] += mu
        return bursts(bins, self.context.ttft_slo_seconds)

    def snapshot(
        self,
        observation: Observation,
        *,
        recommendations: tuple[tuple[float, int], ...] = (),
        stabilisation_seconds: float = DEFAULT_STABILISATION_SECONDS,
        deployment_recommendations: Sequence[Recommendations] = (),
    ) -> Snapshot:
        """The live tick's snapshot of the simulated model at this observation: one
        deployment with the fleet's observed replicas (`recommendations` its recent ones), or
        every deployment of the context's fleet (`deployment_recommendations`, one each)."""
        now = observation.timestamp_s
        context = self.context
        if context.fleet is not None:
            deployments, pools = self._fleet_states(
                context.fleet, observation, deployment_recommendations
            )
        else:
            deployments, pools = self._single_states(observation, recommendations)
        idle = None if self._last_use_s is None else now - self._last_use_s
        recent_bursts = self.bursts(now) if self.track_bursts else Bursts(0.0, 0.0)
        held = min(observation.pending_requests, observation.waiting_requests)
        return Snapshot(
            models=(
                ModelSnapshot(
                    1,
                    "simulated",
                    self.customers(now),
                    deployments,
                    idle,
                    waiting_mu=(observation.waiting_requests - held) * context.mean_request_mu,
                    gateway_waiting_mu=held * context.mean_request_mu,
                    burst_mu_per_minute=recent_bursts.burst_mu_per_minute,
                    burst_window_busiest_minute_mu=recent_bursts.busiest_minute_mu,
                    demand_trend_mu_per_minute_per_second=self.trend(now),
                ),
            ),
            pools=pools,
            settings=PolicySettings(stabilisation_window_seconds=stabilisation_seconds),
        )

    def _fleet_states(
        self,
        fleet: DeploymentFleet,
        observation: Observation,
        recommendations: Sequence[Recommendations],
    ) -> tuple[tuple[DeploymentState, ...], tuple[PoolState, ...]]:
        context = self.context
        # Each deployment's limit: its share of the fleet's cap, or all it holds.
        if context.max_replicas >= fleet.capacity_replicas:
            limits = fleet.most
        else:
            limits = fleet.place(context.max_replicas)
        observed = observed_replicas(fleet, observation)
        states = tuple(
            DeploymentState(
                deployment_id=index + 1,
                name=d.name,
                pool_id=fleet.pool_id(d),
                gpus_per_replica=d.gpus_per_replica,
                mu_per_minute_per_replica=d.replica_mu_per_minute,
                current_replicas=seen.current,
                ready_replicas=seen.ready,
                starting_replicas=seen.starting,
                draining_replicas=seen.draining,
                min_replicas=0,
                max_replicas=limits[index],
                cold_start_seconds=d.cold_start_seconds,
                scale_to_zero_after_seconds=d.scale_to_zero_after_seconds,
                target_utilisation=context.target_utilisation,
                cost_per_hour_usd=d.replica_hourly_cost_usd,
                recent_recommendations=(
                    recommendations[index] if index < len(recommendations) else ()
                ),
            )
            for index, (d, seen) in enumerate(zip(fleet.deployments, observed, strict=True))
        )
        return states, fleet.pool_states()

    def _single_states(
        self, observation: Observation, recommendations: tuple[tuple[float, int], ...]
    ) -> tuple[tuple[DeploymentState, ...], tuple[PoolState, ...]]:
        context = self.context
        deployment = DeploymentState(
            deployment_id=1,
            name="simulated",
            pool_id=1,
            gpus_per_replica=1,
            mu_per_minute_per_replica=context.replica_mu_per_minute,
            current_replicas=observation.current_replicas,
            ready_replicas=observation.ready_replicas,
            starting_replicas=observation.starting_replicas,
            draining_replicas=observation.draining_replicas,
            min_replicas=0,
            max_replicas=context.max_replicas,
            cold_start_seconds=context.cold_start_seconds,
            scale_to_zero_after_seconds=context.scale_to_zero_after_seconds,
            target_utilisation=context.target_utilisation,
            cost_per_hour_usd=1.0,
            recent_recommendations=recommendations,
        )
        return (deployment,), (PoolState(1, "simulated", context.max_replicas),)

    def rates(self, decisions: Decisions) -> Rates:
        """The admission rates of the decisions' allowances, by client."""
        guaranteed: dict[str, float] = {}
        best_effort: dict[str, float] = {}
        for allowance in decisions.allowances:
            client = self.client_of(allowance.customer_id)
            guaranteed[client] = allowance.guaranteed_mu_per_minute
            best_effort[client] = allowance.best_effort_mu_per_minute
        return guaranteed, best_effort


class ModelUnitAutoscaler:
    def __init__(
        self,
        context: PolicyContext,
        *,
        stabilisation_seconds: float = DEFAULT_STABILISATION_SECONDS,
    ) -> None:
        self.context = context
        self.stabilisation_seconds = float(stabilisation_seconds)
        self.demand = LiveDemand(context)
        self._recommendations: deque[tuple[float, int]] = deque()
        # A fleet of several deployments: each one's recommendations, and its latest target.
        self._deployment_recommendations: deque[tuple[float, tuple[int, ...]]] = deque()
        self._targets: tuple[int, ...] | None = None
        self._started = False
        # The admission rates of the latest decision (the reservations until the first tick).
        self.allowances: Rates = (dict(context.reservations_mu_per_minute), {})
        # The policy's whole decision at the last tick, reasons included (what the demo's
        # history stores as the tick's AllocationDecision).
        self.last_decision: DeploymentDecision | None = None

    def initial_replicas(self) -> int:
        return self.context.warm_replicas

    def deployment_targets(self) -> tuple[int, ...] | None:
        """The latest decision's target for each deployment of the fleet (None without one)."""
        return self._targets

    def decide(self, observation: Observation) -> int:
        fleet = self.context.fleet
        if fleet is not None:
            return self._decide_deployments(fleet, observation)
        now = observation.timestamp_s
        if not self._started:
            # A running control plane has recommended the fleet it runs until now.
            self._started = True
            self._recommendations.append((now, observation.current_replicas))
        self.demand.record(observation)
        window = self.stabilisation_seconds
        while self._recommendations and now - self._recommendations[0][0] > window:
            self._recommendations.popleft()
        snapshot = self.demand.snapshot(
            observation,
            recommendations=tuple((now - t, r) for t, r in self._recommendations),
            stabilisation_seconds=window,
        )
        decisions = decide(snapshot)
        self.allowances = self.demand.rates(decisions)
        decision = decisions.deployments[0]
        self.last_decision = decision
        self._recommendations.append((now, decision.recommended_replicas))
        return decision.target_replicas

    def _decide_deployments(self, fleet: DeploymentFleet, observation: Observation) -> int:
        """As `decide`, over every deployment of the fleet: the replicas of all of them."""
        now = observation.timestamp_s
        recommended = self._deployment_recommendations
        if not self._started:
            self._started = True
            seen = observed_replicas(fleet, observation)
            recommended.append((now, tuple(d.current for d in seen)))
        self.demand.record(observation)
        window = self.stabilisation_seconds
        while recommended and now - recommended[0][0] > window:
            recommended.popleft()
        snapshot = self.demand.snapshot(
            observation,
            stabilisation_seconds=window,
            deployment_recommendations=[
                tuple((now - t, counts[index]) for t, counts in recommended)
                for index in range(len(fleet))
            ],
        )
        decisions = decide(snapshot)
        self.allowances = self.demand.rates(decisions)
        chosen = [decisions.for_deployment(index + 1) for index in range(len(fleet))]
        self.last_decision = chosen[0]
        recommended.append((now, tuple(d.recommended_replicas for d in chosen)))
        self._targets = tuple(d.target_replicas for d in chosen)
        return sum(self._targets)


class LiveAllowances:
    """The live policy's admission allowances for a fleet another policy sizes: each tick, the
    snapshot the live tick would read of that fleet (its observed ready replicas, the demand
    with refusals), through `decide()`, of which only the allowances are used."""

    def __init__(self, context: PolicyContext) -> None:
        self.demand = LiveDemand(context, track_bursts=False)

    def update(self, observation: Observation) -> Rates:
        self.demand.record(observation)
        return self.demand.rates(decide(self.demand.snapshot(observation)))


class AdmittedAutoscaler:
    """A policy behind the live admission: after each of its decisions, the admission's rates
    become the allowances `rates_of(observation)` gives (the live policy's, for this fleet)."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        admission: TokenBucketAdmission,
        rates_of: Callable[[Observation], Rates],
    ) -> None:
        self.autoscaler = autoscaler
        self.admission = admission
        self.rates_of = rates_of

    def initial_replicas(self) -> int:
        initial = getattr(self.autoscaler, "initial_replicas", None)
        return int(initial()) if initial else 0

    def deployment_targets(self) -> tuple[int, ...] | None:
        own = getattr(self.autoscaler, "deployment_targets", None)
        targets: tuple[int, ...] | None = own() if own is not None else None
        return targets

    def decide(self, observation: Observation) -> int:
        target = self.autoscaler.decide(observation)
        guaranteed, best_effort = self.rates_of(observation)
        self.admission.set_rates(guaranteed=guaranteed, best_effort=best_effort)
        return target


def behind_admission(
    autoscaler: Autoscaler,
    context: PolicyContext,
    *,
    allowances_of: ModelUnitAutoscaler | None = None,
    initial_replicas: int = 0,
    burst_seconds: float = DEFAULT_BURST_SECONDS,
) -> tuple[AdmittedAutoscaler, TokenBucketAdmission]:
    """`autoscaler` behind the live admission, and that admission (for SimulationSettings).

    The rates follow, tick by tick, the allowances of `allowances_of` (the live policy's own
    decision, when `autoscaler` is or wraps a ModelUnitAutoscaler), else the live policy's
    allowances for the fleet `autoscaler` runs (`LiveAllowances`). Until the first tick, the
    allowances of `initial_replicas` ready and no demand yet."""
    admission = TokenBucketAdmission(burst_seconds=burst_seconds)
    guaranteed, best_effort = _opening_rates(context, initial_replicas)
    admission.set_rates(guaranteed=guaranteed, best_effort=best_effort)
    rates_of: Callable[[Observation], Rates]
    if allowances_of is not None:
        modelunit = allowances_of

        def own(_observation: Observation) -> Rates:
            return modelunit.allowances

        rates_of = own
    else:
        rates_of = LiveAllowances(context).update
    return AdmittedAutoscaler(autoscaler, admission, rates_of), admission


def _opening_rates(context: PolicyContext, ready_replicas: int) -> Rates:
    """The allowances of the opening fleet, for the requests that arrive before the first
    tick: the live policy's, from those replicas ready and no demand recorded yet."""
    opening = Observation(
        timestamp_s=0.0,
        window_s=context.tick_seconds,
        arrived_requests=0,
        completed_requests=0,
        refused_requests=0,
        timed_out_requests=0,
        mu_used_by_client={},
        current_replicas=ready_replicas,
        ready_replicas=ready_replicas,
        starting_replicas=0,
        draining_replicas=0,
        running_requests=0,
        waiting_requests=0,
    )
    return LiveAllowances(context).update(opening)
