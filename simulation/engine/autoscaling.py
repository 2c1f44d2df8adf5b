"""What an autoscaler sees each tick, and two trivial autoscalers for tests and baselines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class DeploymentReplicas:
    """One deployment's replicas as observed: starting + ready (current), and draining."""

    current: int
    ready: int
    starting: int
    draining: int


@dataclass(frozen=True)
class Observation:
    """Only what a live control plane could know at `timestamp_s`; counts cover the last window.

    `current_replicas` counts starting + ready replicas (what the data plane was asked for);
    draining replicas finish their work and go, and are reported apart.
    """

    timestamp_s: float
    window_s: float
    arrived_requests: int
    completed_requests: int
    refused_requests: int
    timed_out_requests: int
    # MU of the requests completed in the window, per client (empty without `request_mu`).
    mu_used_by_client: dict[str, float]
    current_replicas: int
    ready_replicas: int
    starting_replicas: int
    draining_replicas: int
    running_requests: int  # in a batch on some replica
    waiting_requests: int  # queued on a replica or waiting for one to be ready
    # The same requests one by one: (client, arrival time, MU), as usage events (which carry
    # `started_at`) show them.
    completed_mu: list[tuple[str, float, float]] = field(default_factory=list)
    # The requests admission refused in the window: (client, arrival time, MU, refused in the
    # guaranteed class), as refused usage events (with their estimated MU) show them.
    refused_mu: list[tuple[str, float, float, bool]] = field(default_factory=list)
    # Of `waiting_requests`, those held for want of a ready replica (a live gateway holds them
    # for a model at zero: gw:v1:waiting); the rest wait in the engines' queues.
    pending_requests: int = 0
    # A fleet of several deployments (SimulationSettings.fleet): the replicas of each, in the
    # fleet's order (the counts above are their sums); empty for a fleet of one kind.
    deployments: tuple[DeploymentReplicas, ...] = ()
    # The TTFT of each request completed in the window, seconds, as usage events' `ttft_ms`
    # show it (the delivered SLO the live policy corrects itself by).
    completed_ttft_s: list[float] = field(default_factory=list)


class Autoscaler(Protocol):
    """Decides the fleet's size every tick.

    In a fleet of several deployments, the count is in replicas of the fleet's unit
    deployment, placed over the deployments as the live policy places capacity
    (`DeploymentFleet.place`); an autoscaler that sizes each deployment itself (the live
    policy) also has `deployment_targets()`, read after each `decide`, which gives one count
    per deployment (None: place the count). An autoscaler may also have `initial_replicas()`,
    the fleet it starts with."""

    def decide(self, observation: Observation) -> int:
        """Target number of replicas (starting + ready)."""
        ...


@dataclass(frozen=True)
class StaticAutoscaler:
    replicas: int

    def decide(self, observation: Observation) -> int:
        return self.replicas


@dataclass(frozen=True)
class ScheduledAutoscaler:
    """A scripted fleet: `schedule` is (from_s, replicas) pairs; before the first, `initial`."""

    schedule: Sequence[tuple[float, int]]
    initial: int = 0

    def decide(self, observation: Observation) -> int:
        replicas = self.initial
        for from_s, count in sorted(self.schedule):
            if from_s <= observation.timestamp_s:
                replicas = count
        return replicas
