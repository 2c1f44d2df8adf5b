"""A model's fleet of several deployments, as the simulator runs it (pure: no Django).

A served model may run on several deployments (GPU types, tensor-parallel sizes), each with its
own replica (`FleetDeployment.model`: the profile its own GPU type's cost model describes), the
MU/min one of its replicas serves (R on the reference GPU type, R · t_ref / t_own on another),
its GPUs per replica and their price, its max replicas, cold start and idle window, on a pool
whose GPUs it may share with the model's other deployments (`DeploymentFleet.pool_gpus`, by
pool: a pool is counted once, whatever number of deployments are placed on it).

The live allocation policy (`capacity.allocation.policy.decide`) sizes each deployment itself
(`simulation.engine.modelunit`). The other policies (static-peak, kpa, hpa-rps, the oracles)
size a fleet in replicas of one kind; here a replica of theirs is one of the `unit`
deployment's, the one whose MU is cheapest, and `place` spreads that capacity
(replicas × the unit's MU/min) over the deployments as the live policy places capacity:
cheapest $/MU first, within each deployment's max replicas and the GPUs its pool has left.
`place` runs that very policy (a snapshot of one warm reservation of that capacity), so the
rule has one home.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from capacity.allocation.policy import (
    CustomerDemand,
    DeploymentState,
    ModelSnapshot,
    PoolState,
    Snapshot,
    decide,
)

from .profile import ModelConfig


@dataclass(frozen=True)
class FleetDeployment:
    name: str
    model: ModelConfig  # the replica: its own GPU type's profile
    replica_mu_per_minute: float  # MU/min one replica serves saturated
    pool: str  # the pool's key in DeploymentFleet.pool_gpus
    max_replicas: int  # its own limit (its pool's GPUs are DeploymentFleet's)
    cold_start_seconds: float
    gpus_per_replica: int = 1
    scale_to_zero_after_seconds: float | None = 600.0
    gpu_hourly_cost_usd: float = 1.0  # per GPU

    @property
    def replica_hourly_cost_usd(self) -> float:
        return self.gpu_hourly_cost_usd * self.gpus_per_replica

    @property
    def usd_per_mu(self) -> float:
        mu = self.replica_mu_per_minute
        return self.replica_hourly_cost_usd / (mu * 60) if mu > 0 else math.inf


@dataclass(frozen=True)
class DeploymentFleet:
    deployments: tuple[FleetDeployment, ...]
    pool_gpus: Mapping[str, int]  # GPUs per pool, shared by the deployments placed on it
    # Placements already computed, by replicas of the unit (a baseline asks the same few
    # counts tick after tick).
    _placed: dict[int, tuple[int, ...]] = field(
        default_factory=dict, init=False, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.deployments:
            raise ValueError("a fleet needs at least one deployment")
        missing = sorted({d.pool for d in self.deployments} - set(self.pool_gpus))
        if missing:
            raise ValueError(f"no GPU count for pool {missing[0]!r}")

    def __len__(self) -> int:
        return len(self.deployments)

    @cached_property
    def unit_index(self) -> int:
        """The deployment the live policy fills first: the cheapest $/MU (ties: the first) of
        those that hold a replica in their pool (of all, when none does)."""
        indices = [i for i, count in enumerate(self.most) if count > 0]
        return min(
            indices or range(len(self.deployments)), key=lambda i: self.deployments[i].usd_per_mu
        )

    @property
    def unit(self) -> FleetDeployment:
        return self.deployments[self.unit_index]

    @cached_property
    def pools(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.pool for d in self.deployments))

    def pool_states(self) -> tuple[PoolState, ...]:
        return tuple(
            PoolState(index + 1, name, self.pool_gpus[name])
            for index, name in enumerate(self.pools)
        )

    def pool_id(self, deployment: FleetDeployment) -> int:
        return self.pools.index(deployment.pool) + 1

    def with_cold_start(self, cold_start_seconds: float) -> DeploymentFleet:
        """The same fleet with every deployment's cold start set to `cold_start_seconds`."""
        return DeploymentFleet(
            tuple(
                replace(
                    d,
                    cold_start_seconds=cold_start_seconds,
                    model=replace(d.model, cold_start_seconds=cold_start_seconds),
                )
                for d in self.deployments
            ),
            dict(self.pool_gpus),
        )

    def place_mu(self, mu_per_minute: float) -> tuple[int, ...]:
        """Replicas per deployment that serve `mu_per_minute` (saturated), as the live policy
        places a warm reservation: cheapest $/MU first, within each deployment's max and the
        GPUs its pool has left; all the fleet holds when that is not enough."""
        if mu_per_minute <= 0:
            return (0,) * len(self.deployments)
        states = tuple(
            DeploymentState(
                deployment_id=index + 1,
                name=d.name,
                pool_id=self.pool_id(d),
                gpus_per_replica=d.gpus_per_replica,
                mu_per_minute_per_replica=d.replica_mu_per_minute,
                current_replicas=0,
                ready_replicas=0,
                min_replicas=0,
                max_replicas=d.max_replicas,
                cold_start_seconds=d.cold_start_seconds,
                scale_to_zero_after_seconds=None,
                # Saturated: the policies that ask for replicas planned their own headroom.
                target_utilisation=1.0,
                cost_per_hour_usd=d.replica_hourly_cost_usd,
            )
            for index, d in enumerate(self.deployments)
        )
        demand = CustomerDemand(
            customer_id=1,
            reserved_mu_per_minute=mu_per_minute,
            recent_mu_per_minute=0.0,
            peak_mu_per_minute=0.0,
            keep_warm=True,
        )
        snapshot = Snapshot(
            models=(ModelSnapshot(1, "placement", (demand,), states, idle_seconds=None),),
            pools=self.pool_states(),
        )
        decisions = decide(snapshot)
        return tuple(
            decisions.for_deployment(index + 1).target_replicas
            for index in range(len(self.deployments))
        )

    def place(self, replicas: int) -> tuple[int, ...]:
        """Replicas per deployment for `replicas` of the unit deployment's capacity."""
        replicas = max(0, int(replicas))
        placed = self._placed.get(replicas)
        if placed is None:
            placed = self.place_mu(replicas * self.unit.replica_mu_per_minute)
            self._placed[replicas] = placed
        return placed

    @cached_property
    def most(self) -> tuple[int, ...]:
        """Every replica the fleet holds: each deployment's max, within its pool's GPUs."""
        everything = sum(d.max_replicas * d.replica_mu_per_minute for d in self.deployments)
        return self.place_mu(everything + 1.0)

    def mu_per_minute_of(self, replicas: tuple[int, ...]) -> float:
        return sum(
            count * d.replica_mu_per_minute
            for count, d in zip(replicas, self.deployments, strict=True)
        )

    @cached_property
    def capacity_replicas(self) -> int:
        """What the whole fleet serves, in replicas of the unit deployment (rounded down)."""
        unit_mu = self.unit.replica_mu_per_minute
        return int(math.floor(self.mu_per_minute_of(self.most) / unit_mu + 1e-9))
