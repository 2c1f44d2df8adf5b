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
from dataclasses import replace

from capacity.admission.bucket import DEFAULT_BURST_SECONDS
from capacity.allocation.bursts import Bursts, bursts
from capacity.allocation.forecast import MIN_HISTORY_MINUTES, Forecast, ForecastFigures, figures
from capacity.allocation.forecast import fit as fit_forecast
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
from capacity.allocation.slo import SLO_GAIN, SLO_WINDOW_SECONDS
from capacity.allocation.trend import TREND_MINUTES, demand_trend_mu_per_minute_per_second
from simulation.engine.admission import TokenBucketAdmission
from simulation.engine.autoscaling import Autoscaler, DeploymentReplicas, Observation
from simulation.engine.deployments import DeploymentFleet
from simulation.engine.policy_context import PolicyContext

# The live tick's windows.
FORECAST_REFIT_SECONDS = 3600  # as the live schedule refits (capacity.demand_forecast_fit)
SLO_TARGET = 0.99
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

    def __init__(
        self,
        context: PolicyContext,
        *,
        track_bursts: bool = True,
        prediction: bool = False,
        scored: bool = False,
    ) -> None:
        self.context = context
        # Rule 3c's inputs (the live snapshot's): the demand per minute for the forecast, the
        # delivered SLO per tick, the fitted forecast and the predictions made, for its MAPE.
        self.prediction = prediction
        # `scored`: the demand per minute is recorded and the policy's predictions scored even
        # with prediction off (the reactive policy's prediction is the level: persistence).
        self.scored = prediction or scored
        self._demand_by_minute: dict[int, float] = defaultdict(float)
        self._slo_ticks: deque[tuple[float, int, int]] = deque()  # (time, met, requests)
        self.forecast: Forecast | None = None
        self._fitted_at: float | None = None
        # (minute predicted, MU/min predicted) of the next-horizon predictions, and their errors
        self._predictions: deque[tuple[int, float]] = deque()
        self.prediction_errors: list[tuple[float, float]] = []  # (predicted, actual)
        self.prediction_error_minutes: list[int] = []  # the minute of each error
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
        if self.scored:
            self._record_prediction_inputs(observation, minute)
        oldest = int(now // 60) - PEAK_MINUTES
        for series in (self._minutes, self._refused):
            for stale in [m for m in series if m < oldest]:
                del series[stale]

    def _record_prediction_inputs(self, observation: Observation, minute: int) -> None:
        now = observation.timestamp_s
        self._demand_by_minute[minute] += sum(observation.mu_used_by_client.values()) + sum(
            mu for _, _, mu, _ in observation.refused_mu
        )
        slo_s = self.context.ttft_slo_seconds
        met = sum(1 for ttft in observation.completed_ttft_s if ttft <= slo_s)
        asked = (
            observation.completed_requests
            + observation.refused_requests
            + observation.timed_out_requests
        )
        self._slo_ticks.append((now, met, asked))
        while self._slo_ticks and self._slo_ticks[0][0] <= now - SLO_WINDOW_SECONDS:
            self._slo_ticks.popleft()

    def delivered_slo(self) -> tuple[float | None, int]:
        """The share of the SLO window's requests within the TTFT SLO, and how many."""
        met = sum(m for _, m, _ in self._slo_ticks)
        asked = sum(a for _, _, a in self._slo_ticks)
        return (met / asked if asked else None), asked

    def refit(self, now: float) -> None:
        """Fit the forecast again, once a FORECAST_REFIT_SECONDS, on the whole minutes so far."""
        if self._fitted_at is not None and now - self._fitted_at < FORECAST_REFIT_SECONDS:
            return
        whole = int(now // 60)
        first = min(self._demand_by_minute, default=whole)
        if whole - first < MIN_HISTORY_MINUTES:
            return
        self._fitted_at = now
        series = [self._demand_by_minute.get(m, 0.0) for m in range(first, whole)]
        self.forecast = fit_forecast(series, end_s=whole * 60.0)

    def forecast_figures(self, now: float) -> ForecastFigures:
        """The forecast at this tick as the live snapshot reads it (its rise within the next
        cold start and tick, from when the measured level stands for)."""
        return figures(
            self.forecast,
            now,
            horizon_seconds=self.context.cold_start_seconds + self.context.tick_seconds,
            level_age_seconds=RECENT_WINDOW_SECONDS / 2,
        )

    def note_prediction(self, now: float, level: float, lift: float) -> None:
        """The policy's demand for one cold start ahead (the level plus the forecast's rise),
        scored against the minute it falls in once that minute is complete."""
        whole = int(now // 60)
        while self._predictions and self._predictions[0][0] < whole:
            minute, predicted = self._predictions.popleft()
            self.prediction_errors.append((predicted, self._demand_by_minute.get(minute, 0.0)))
            self.prediction_error_minutes.append(minute)
        ahead = int((now + self.context.cold_start_seconds) // 60)
        self._predictions.append((ahead, level + lift))

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

    def _burst_bins(self, now: float) -> list[float]:
        start_s = int(now) - BURST_WINDOW_SECONDS
        bins = [0.0] * (BURST_WINDOW_SECONDS + 1)
        for second, mu in self._starts.items():
            if second >= start_s:
                bins[second - start_s] += mu
        return bins

    def bursts(self, now: float) -> Bursts:
        return bursts(self._burst_bins(now), self.context.ttft_slo_seconds)

    def snapshot(
        self,
        observation: Observation,
        *,
        recommendations: tuple[tuple[float, int], ...] = (),
        stabilisation_seconds: float = DEFAULT_STABILISATION_SECONDS,
        deployment_recommendations: Sequence[Recommendations] = (),
        slo_correction: float = 1.0,
        slo_gain: float = SLO_GAIN,
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
        model = ModelSnapshot(
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
        )
        if self.prediction:
            model = self._with_prediction(model, now, slo_correction)
        return Snapshot(
            models=(model,),
            pools=pools,
            settings=PolicySettings(
                stabilisation_window_seconds=stabilisation_seconds, slo_gain=slo_gain
            ),
        )

    def _with_prediction(
        self, model: ModelSnapshot, now: float, correction: float
    ) -> ModelSnapshot:
        """Rule 3c's inputs, as the live snapshot reads them."""
        self.refit(now)
        attainment, asked = self.delivered_slo()
        seen = self.forecast_figures(now)
        return replace(
            model,
            prediction_enabled=True,
            history_seconds=now - (self.start_s if self.start_s is not None else now),
            slo_target=SLO_TARGET,
            delivered_slo_attainment=attainment,
            delivered_requests=asked,
            slo_correction_in_force=correction,
            forecast_now_mu_per_minute=seen.at_level_mu_per_minute,
            forecast_ahead_mu_per_minute=seen.ahead_mu_per_minute,
            forecast_next_hour_peak_mu_per_minute=seen.next_hour_peak_mu_per_minute,
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
        prediction: bool = True,
        slo_gain: float = SLO_GAIN,
    ) -> None:
        self.context = context
        self.slo_gain = slo_gain
        self.stabilisation_seconds = float(stabilisation_seconds)
        # Rule 3c, on as a live model's is by default (ServedModel.prediction_enabled); its
        # predictions are scored either way (`LiveDemand.prediction_errors`).
        self.demand = self._live_demand(context, prediction)
        # The SLO correction in force: the last decision's (capacity.allocation.slo).
        self.slo_correction = 1.0
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

    def _live_demand(self, context: PolicyContext, prediction: bool) -> LiveDemand:
        return LiveDemand(context, prediction=prediction, scored=True)

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
            slo_correction=self.slo_correction,
            slo_gain=self.slo_gain,
        )
        decisions = self._decide(snapshot, now)
        self.allowances = self.demand.rates(decisions)
        decision = decisions.deployments[0]
        self.last_decision = decision
        self._recommendations.append((now, decision.recommended_replicas))
        return decision.target_replicas

    def _decide(self, snapshot: Snapshot, now: float) -> Decisions:
        """`decide()`, keeping the SLO correction it reports for the next tick, and noting its
        next-horizon demand for the forecast's accuracy."""
        decisions = decide(snapshot)
        outcome = decisions.models[0]
        self.slo_correction = outcome.slo_correction
        if self.demand.scored:
            model = snapshot.models[0]
            level = sum(c.recent_mu_per_minute + c.refused_mu_per_minute for c in model.customers)
            self.demand.note_prediction(now, level, outcome.forecast_lift_mu_per_minute)
        return decisions

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
            slo_correction=self.slo_correction,
            slo_gain=self.slo_gain,
        )
        decisions = self._decide(snapshot, now)
        self.allowances = self.demand.rates(decisions)
        chosen = [decisions.for_deployment(index + 1) for index in range(len(fleet))]
        self.last_decision = chosen[0]
        recommended.append((now, tuple(d.recommended_replicas for d in chosen)))
        self._targets = tuple(d.target_replicas for d in chosen)
        return sum(self._targets)


class ClairvoyantDemand(LiveDemand):
    """LiveDemand whose forecast is exact for the next cold start: at each tick, the forecast
    "now" is the measured level (so the policy's forecast lift is the exact rise) and the
    forecast ahead the highest demand of the whole minutes [now, now + cold start + tick]
    touches, the MU of the requests arriving in each (`context.future_requests`, which only
    the oracles read). No forecast of the hour: the valley release stays off."""

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context, prediction=True)
        arriving: dict[int, float] = defaultdict(float)
        for request in context.future_requests:
            arriving[int(request.arrival_s // 60)] += context.request_mu(request)
        self._arriving = dict(arriving)

    def refit(self, now: float) -> None:
        """No fit: the forecast is the future itself."""

    def forecast_figures(self, now: float) -> ForecastFigures:
        whole = int(now // 60)
        level = (
            sum(
                sum(self._minutes.get(m, {}).values()) + sum(self._refused.get(m, {}).values())
                for m in range(whole - RECENT_MINUTES, whole)
            )
            / RECENT_MINUTES
        )
        horizon = self.context.cold_start_seconds + self.context.tick_seconds
        ahead = max(
            self._arriving.get(m, 0.0) for m in range(whole, int((now + horizon) // 60) + 1)
        )
        return ForecastFigures(level, ahead, None)


class ClairvoyantModelUnitAutoscaler(ModelUnitAutoscaler):
    """The live policy given the exact demand of the next cold start (`ClairvoyantDemand`),
    prediction otherwise as the live policy's: the limit of what a forecast's lift can save.
    Reads `context.future_requests`, as the oracle does."""

    def _live_demand(self, context: PolicyContext, prediction: bool) -> LiveDemand:
        return ClairvoyantDemand(context)


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
