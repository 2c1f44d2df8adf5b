"""The live allocation policy (`capacity.allocation.decide`) as a simulator autoscaler.

The very same pure function the allocation tick runs is called every simulated tick, with a
snapshot built only from what the tick could observe live: the MU completed per customer in
the last window (usage events), what arrived and what waits (the gateway's admission and the
engines' `num_requests_waiting`), the replicas asked for and ready, and the customers'
reservations. Nothing here looks at the future.
"""

from collections import deque

from benchmarking.simulator.autoscaling import Observation
from benchmarking.simulator.policy_context import PolicyContext
from capacity.allocation import (
    CustomerDemand,
    DeploymentState,
    ModelSnapshot,
    PolicySettings,
    PoolState,
    Snapshot,
    decide,
)

RECENT_SECONDS = 300.0  # the live tick's "recent" window (capacity.allocation_tick)
PEAK_SECONDS = 900.0  # the live tick's peak window
STABILISATION_SECONDS = 300.0


class ModelUnitAutoscaler:
    def __init__(self, context: PolicyContext) -> None:
        self.context = context
        # (timestamp, {client: MU/min over that window}) of recent ticks.
        self._demand: deque[tuple[float, dict[str, float]]] = deque()
        self._recommendations: deque[tuple[float, int]] = deque()
        self._last_arrival_s: float | None = None

    def _observe(self, observation: Observation) -> dict[str, float]:
        minutes = max(observation.window_s, 1e-9) / 60.0
        rates = {client: mu / minutes for client, mu in observation.mu_used_by_client.items()}
        # Completions lag arrivals (and stop entirely while nothing is ready), so what arrived
        # and what waits count too, priced at the mean request.
        seen = sum(rates.values())
        arrived = observation.arrived_requests * self.context.mean_request_mu / minutes
        waiting = observation.waiting_requests * self.context.mean_request_mu  # within a minute
        extra = max(0.0, arrived - seen) + waiting
        if extra > 0:
            rates["(arrivals)"] = rates.get("(arrivals)", 0.0) + extra
        if observation.arrived_requests:
            self._last_arrival_s = observation.timestamp_s
        return rates

    def decide(self, observation: Observation) -> int:
        now = observation.timestamp_s
        self._demand.append((now, self._observe(observation)))
        while self._demand and now - self._demand[0][0] > PEAK_SECONDS:
            self._demand.popleft()
        while self._recommendations and now - self._recommendations[0][0] > STABILISATION_SECONDS:
            self._recommendations.popleft()

        clients = set(self.context.reservations_mu_per_minute)
        for _, rates in self._demand:
            clients.update(rates)
        customers = []
        for index, client in enumerate(sorted(clients)):
            recent = [r.get(client, 0.0) for t, r in self._demand if now - t < RECENT_SECONDS]
            peak = max((r.get(client, 0.0) for _, r in self._demand), default=0.0)
            customers.append(
                CustomerDemand(
                    customer_id=index,
                    reserved_mu_per_minute=self.context.reservations_mu_per_minute.get(client, 0.0),
                    recent_mu_per_minute=sum(recent) / len(recent) if recent else 0.0,
                    peak_mu_per_minute=peak,
                    keep_warm=self.context.keep_warm,
                )
            )
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
        idle = None if self._last_arrival_s is None else now - self._last_arrival_s
        snapshot = Snapshot(
            models=(ModelSnapshot(1, "simulated", tuple(customers), (deployment,), idle),),
            pools=(PoolState(1, "simulated", self.context.max_replicas),),
            settings=PolicySettings(stabilisation_window_seconds=STABILISATION_SECONDS),
        )
        decision = decide(snapshot).deployments[0]
        self._recommendations.append((now, decision.recommended_replicas))
        return decision.target_replicas
