"""The live allocation policy (`capacity.allocation.policy.decide`) as a simulator autoscaler.

The very same pure function the allocation tick runs is called every simulated tick, with a
snapshot built the way the live tick builds it (`capacity.allocation.tick`), from what it could
observe live and nothing from the future:

- per customer, the MU its completed requests used (usage events), rolled up per whole minute:
  `recent` is the mean of the last RECENT_WINDOW's whole minutes, `peak` the busiest whole
  minute of the last PEAK_WINDOW (the minute in progress is left out, as the live tick leaves
  out a minute whose rollup is not complete);
- bursts (`capacity.allocation.bursts`) of all completed requests by the second they started (usage
  events' `started_at`) over the last BURST_WINDOW;
- the requests waiting in the engines (vLLM's `num_requests_waiting`), priced at the mean
  request's MU;
- the replicas asked for and ready, the customers' reservations, and the previous ticks'
  recommendations (the scale-down stabilisation window).
"""

from collections import defaultdict, deque

from capacity.allocation.bursts import Bursts, bursts
from capacity.allocation.policy import (
    BURST_WINDOW_SECONDS,
    PEAK_WINDOW_SECONDS,
    RECENT_WINDOW_SECONDS,
    CustomerDemand,
    DeploymentDecision,
    DeploymentState,
    ModelSnapshot,
    PolicySettings,
    PoolState,
    Snapshot,
    decide,
)
from simulation.engine.autoscaling import Observation
from simulation.engine.policy_context import PolicyContext

# The live tick's windows.
RECENT_MINUTES = RECENT_WINDOW_SECONDS // 60
PEAK_MINUTES = PEAK_WINDOW_SECONDS // 60
# The live tick's scale-down stabilisation is a setting (ALLOCATION_STABILISATION_SECONDS in
# controlplane.settings): the caller passes it in; this is that setting's default.
DEFAULT_STABILISATION_SECONDS = 120.0


class ModelUnitAutoscaler:
    def __init__(
        self,
        context: PolicyContext,
        *,
        stabilisation_seconds: float = DEFAULT_STABILISATION_SECONDS,
    ) -> None:
        self.context = context
        self.stabilisation_seconds = float(stabilisation_seconds)
        # minute index -> {client: MU completed in that minute}
        self._minutes: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        # second -> MU of the completed requests that started in that second
        self._starts: dict[int, float] = defaultdict(float)
        self._recommendations: deque[tuple[float, int]] = deque()
        self._started = False
        self._last_use_s: float | None = None
        # client -> when it last used the model; the reservations start with the simulation.
        self._client_last_use_s: dict[str, float] = {}
        self._start_s: float | None = None
        # The policy's whole decision at the last tick, reasons included (what the demo's
        # history stores as the tick's AllocationDecision).
        self.last_decision: DeploymentDecision | None = None

    def initial_replicas(self) -> int:
        return self.context.warm_replicas

    def _record(self, observation: Observation) -> None:
        now = observation.timestamp_s
        # The window (now - window, now] lies in one minute when ticks divide the minute.
        minute = int((now - 1e-6) // 60)
        for client, mu in observation.mu_used_by_client.items():
            self._minutes[minute][client] += mu
            self._client_last_use_s[client] = now
        for _client, started_s, mu in observation.completed_mu:
            self._starts[int(started_s)] += mu
        if observation.mu_used_by_client:
            self._last_use_s = now
        oldest = int(now // 60) - PEAK_MINUTES
        for stale in [m for m in self._minutes if m < oldest]:
            del self._minutes[stale]
        for stale in [k for k in self._starts if k < now - BURST_WINDOW_SECONDS]:
            del self._starts[stale]
        window = self.stabilisation_seconds
        while self._recommendations and now - self._recommendations[0][0] > window:
            self._recommendations.popleft()

    def _customers(self, now: float) -> tuple[CustomerDemand, ...]:
        start = self._start_s if self._start_s is not None else now
        whole = int(now // 60)  # the minute in progress; only earlier minutes are complete
        peak_minutes = [self._minutes.get(m, {}) for m in range(whole - PEAK_MINUTES, whole)]
        recent_minutes = peak_minutes[-RECENT_MINUTES:]
        clients = set(self.context.reservations_mu_per_minute)
        for used in peak_minutes:
            clients.update(used)
        return tuple(
            CustomerDemand(
                customer_id=index,
                reserved_mu_per_minute=self.context.reservations_mu_per_minute.get(client, 0.0),
                recent_mu_per_minute=sum(m.get(client, 0.0) for m in recent_minutes)
                / RECENT_MINUTES,
                peak_mu_per_minute=max(m.get(client, 0.0) for m in peak_minutes),
                keep_warm=self.context.keep_warm,
                # As the live snapshot: since the last use or the reservation's start.
                idle_seconds=now - max(self._client_last_use_s.get(client, start), start),
            )
            for index, client in enumerate(sorted(clients))
        )

    def _bursts(self, now: float) -> Bursts:
        start_s = int(now) - BURST_WINDOW_SECONDS
        bins = [0.0] * (BURST_WINDOW_SECONDS + 1)
        for second, mu in self._starts.items():
            if second >= start_s:
                bins[second - start_s] += mu
        return bursts(bins, self.context.ttft_slo_seconds)

    def decide(self, observation: Observation) -> int:
        now = observation.timestamp_s
        if not self._started:
            # A running control plane has recommended the fleet it runs until now.
            self._started = True
            self._start_s = now
            self._recommendations.append((now, observation.current_replicas))
        self._record(observation)
        deployment = DeploymentState(
            deployment_id=1,
            name="simulated",
            pool_id=1,
            gpus_per_replica=1,
            mu_per_minute_per_replica=self.context.replica_mu_per_minute,
            current_replicas=observation.current_replicas,
            ready_replicas=observation.ready_replicas,
            min_replicas=0,
            max_replicas=self.context.max_replicas,
            cold_start_seconds=self.context.cold_start_seconds,
            scale_to_zero_after_seconds=self.context.scale_to_zero_after_seconds,
            target_utilisation=self.context.target_utilisation,
            cost_per_hour_usd=1.0,
            recent_recommendations=tuple((now - t, r) for t, r in self._recommendations),
        )
        idle = None if self._last_use_s is None else now - self._last_use_s
        recent_bursts = self._bursts(now)
        snapshot = Snapshot(
            models=(
                ModelSnapshot(
                    1,
                    "simulated",
                    self._customers(now),
                    (deployment,),
                    idle,
                    waiting_mu=observation.waiting_requests * self.context.mean_request_mu,
                    burst_mu_per_minute=recent_bursts.burst_mu_per_minute,
                    burst_window_busiest_minute_mu=recent_bursts.busiest_minute_mu,
                ),
            ),
            pools=(PoolState(1, "simulated", self.context.max_replicas),),
            settings=PolicySettings(stabilisation_window_seconds=self.stabilisation_seconds),
        )
        decision = decide(snapshot).deployments[0]
        self.last_decision = decision
        self._recommendations.append((now, decision.recommended_replicas))
        return decision.target_replicas
