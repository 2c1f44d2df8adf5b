"""What a policy under test may know when it is built (before the simulation starts).

Everything here is knowable ahead of time by a live control plane — the replica's capacity,
the customers' reservations, the deployment's limits — except `future_requests`, which only
the oracle (the lower bound) is allowed to read.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from simulation.engine.deployments import DeploymentFleet
from simulation.engine.traces import TraceRequest


@dataclass(frozen=True)
class PolicyContext:
    replica_mu_per_minute: float  # MU/min one replica serves when saturated (R = 100)
    request_mu: Callable[[TraceRequest], float]  # a request's cost in MU
    max_replicas: int
    max_num_seqs: int  # a replica's batch limit (Knative's concurrency target derives from it)
    cold_start_seconds: float
    tick_seconds: float
    target_utilisation: float = 0.8
    reservations_mu_per_minute: dict[str, float] = field(default_factory=dict)
    # The clients allowed on the model (a live fleet's entitlements): the trace's clients.
    clients: tuple[str, ...] = ()
    keep_warm: bool = False
    ttft_slo_seconds: float = 2.0
    scale_to_zero_after_seconds: float | None = 600.0
    peak_rate_req_per_s: float = 0.0  # of the whole trace: static-peak's sizing
    mean_request_mu: float = 0.0
    # The fleet already running when the trace begins: replicas for the demand of the first
    # cold start (and the reservations) at the target utilisation. A live control plane was
    # watching demand before the trace's first request; starting reactive policies cold would
    # charge them a cold start no running system pays.
    warm_replicas: int = 0
    future_requests: Sequence[TraceRequest] = ()  # the oracle only
    # The model's several deployments (None: one kind of replica, described above). The
    # counts above (max_replicas, warm_replicas) are then in replicas of the fleet's unit
    # deployment, whose MU/min `replica_mu_per_minute` is; the live policy sizes each
    # deployment (within `fleet.place(max_replicas)`), the others are placed.
    fleet: DeploymentFleet | None = None
