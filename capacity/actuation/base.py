"""What every actuator does: push one deployment's target replica count to the data plane.

An actuator is told the target by a `ScaleRequest` and answers an `ActuatorResult`; it never
raises for a data-plane failure. `apply_with_retries` retries transient failures with
exponential backoff and full jitter within a deadline, so one tick never hangs on one
deployment; the next tick decides afresh, so a failed decision is never re-applied later.
"""

import random
import time
from dataclasses import dataclass, field


class TransientActuatorError(Exception):
    """Worth retrying: a timeout, a 5xx, a conflict on a concurrent write."""


class PermanentActuatorError(Exception):
    """Not worth retrying: bad config, 4xx other than conflicts, missing object."""


@dataclass(frozen=True)
class ScaleRequest:
    deployment_id: int
    deployment: str
    model: str
    target_replicas: int
    current_replicas: int
    config: dict
    endpoint_url: str = ""
    decision_id: int | None = None
    reasons: list[dict] = field(default_factory=list)
    # For an actuator that bounds an outside autoscaler (Kubernetes' hpa-bounds mode).
    floor_replicas: int = 0
    ceiling_replicas: int | None = None
    # A scale-down's pods to remove first, least loaded first (Kubernetes: their
    # pod-deletion-cost is lowered before the ReplicaSet picks; capacity/actuation/drain.py).
    leaving_pods: tuple[str, ...] = ()


# Who picks the pods a scale-down deletes (Observation.removed_by).
REPLICA_SET = "ReplicaSet"
KNATIVE = "Knative"


@dataclass(frozen=True)
class Observation:
    """What the data plane itself says it runs, read every tick (level-triggered)."""

    spec_replicas: int | None  # what it is asked to run, by whoever owns the count
    ready_replicas: int | None  # None: this resource reports no ready count
    # (min, max) of an outside autoscaler's bounds, when the actuator sets them.
    bounds: tuple[int, int] | None = None
    # Who picks the pods a scale-down deletes, where the kind alone does not say (an
    # InferenceService: REPLICA_SET in RawDeployment mode, KNATIVE in Serverless mode);
    # capacity/actuation/drain.py.
    removed_by: str | None = None


@dataclass(frozen=True)
class ActuatorResult:
    ok: bool
    attempts: int = 1
    applied_replicas: int | None = None
    observed_replicas: int | None = None  # what the data plane reports running, if it says
    error: str = ""
    detail: dict = field(default_factory=dict)


class Actuator:
    kind: str = ""

    def apply(self, request: ScaleRequest) -> int | None:
        """Push the target; return the replicas the data plane reports, if any.

        Raise TransientActuatorError or PermanentActuatorError on failure.
        """
        raise NotImplementedError

    def observe(self, request: ScaleRequest) -> Observation | None:
        """Read what runs now; None for kinds that cannot say. Raises as `apply`."""
        return None


def apply_with_retries(
    actuator: Actuator,
    request: ScaleRequest,
    *,
    max_attempts: int = 3,
    base_delay_seconds: float = 0.2,
    max_delay_seconds: float = 2.0,
    deadline_seconds: float = 10.0,
    sleep=time.sleep,
) -> ActuatorResult:
    started = time.monotonic()
    last_error = ""
    for attempt in range(1, max_attempts + 1):
        try:
            observed = actuator.apply(request)
            return ActuatorResult(
                ok=True,
                attempts=attempt,
                applied_replicas=request.target_replicas,
                observed_replicas=observed,
            )
        except PermanentActuatorError as error:
            return ActuatorResult(ok=False, attempts=attempt, error=f"permanent: {error}")
        except TransientActuatorError as error:
            last_error = f"transient: {error}"
        if attempt == max_attempts:
            break
        # Full jitter: concurrent ticks across deployments do not retry in lockstep.
        delay = random.uniform(0, min(max_delay_seconds, base_delay_seconds * 2 ** (attempt - 1)))  # noqa: S311
        if time.monotonic() - started + delay > deadline_seconds:
            break
        sleep(delay)
    return ActuatorResult(ok=False, attempts=attempt, error=last_error)
