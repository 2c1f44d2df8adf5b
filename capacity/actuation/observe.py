"""Every tick reads what each observable deployment runs, from the data plane itself
(level-triggered, issue 20): a workload that drifted from its target (a `kubectl scale`, an
HPA, a controller that restarted) is seen and corrected on the next tick, not never.

Today the Kubernetes actuator can say (`Actuator.observe`); the others return nothing and
their readiness stays the probes'. The reads run concurrently, each within the push deadline
(ALLOCATION_PUSH_DEADLINE_SECONDS), so a hanging API server delays a tick by at most that.
What was read is stored on the deployment (observed_spec_replicas, observed_ready_replicas,
replicas_observed_at); for the modes where the count is an autoscaler's, not ours (hpa-bounds,
metric), `current_replicas` follows what the workload runs.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

from django.conf import settings

from capacity.actuation.base import (
    ActuatorResult,
    Observation,
    PermanentActuatorError,
    ScaleRequest,
    TransientActuatorError,
)
from capacity.actuation.kubernetes import mode_of
from capacity.actuation.push import push_all
from capacity.actuation.registry import actuator_for
from capacity.models import ActuatorKind, Deployment

logger = logging.getLogger(__name__)


def observable(deployment: Deployment) -> bool:
    return (
        deployment.actuator_kind == ActuatorKind.KUBERNETES
        and not deployment.actuator_config_problem
        and isinstance(deployment.actuator_config, dict)
    )


def owns_count(deployment: Deployment) -> bool:
    """Whether the control plane sets the replicas itself (otherwise an HPA, Knative or a
    KEDA ScaledObject does, within bounds or from a metric)."""
    if deployment.actuator_kind != ActuatorKind.KUBERNETES:
        return True
    return mode_of(deployment.actuator_config or {}) == "replicas"


def observe_fleet(deployments: list[Deployment], now: datetime) -> dict[int, Observation]:
    """Read and store what each observable deployment runs; deployment id → Observation."""
    targets = [d for d in deployments if observable(d)]
    if not targets:
        return {}
    deadline = settings.ALLOCATION_PUSH_DEADLINE_SECONDS

    def read(deployment: Deployment, abandoned: threading.Event) -> ActuatorResult:
        request = ScaleRequest(
            deployment_id=deployment.pk,
            deployment=deployment.name,
            model="",
            target_replicas=deployment.current_replicas,
            current_replicas=deployment.current_replicas,
            config=_bounded(deployment.actuator_config, deadline),
        )
        try:
            observation = actuator_for(deployment.actuator_kind).observe(request)
        except (TransientActuatorError, PermanentActuatorError) as error:
            return ActuatorResult(ok=False, error=str(error))
        except Exception as error:  # one broken read must not stop the tick
            return ActuatorResult(ok=False, error=f"{type(error).__name__}: {error}")
        return ActuatorResult(ok=True, detail={"observation": observation})

    started = time.monotonic()
    results = push_all(targets, read, deadline)
    observed: dict[int, Observation] = {}
    changed, followed = [], []
    for deployment, result in zip(targets, results, strict=True):
        observation = result.detail.get("observation") if result.ok else None
        if observation is None:
            if not result.ok:
                logger.warning("observing %s failed: %s", deployment.name, result.error)
            continue
        observed[deployment.pk] = observation
        deployment.observed_spec_replicas = observation.spec_replicas
        deployment.replicas_observed_at = now
        if observation.ready_replicas is not None:
            deployment.observed_ready_replicas = observation.ready_replicas
            spec = observation.spec_replicas
            deployment.observed_starting_replicas = (
                max(0, spec - observation.ready_replicas) if spec is not None else None
            )
        if not owns_count(deployment) and observation.spec_replicas is not None:
            # The autoscaler's count is what runs: capacity, admission and billing follow it.
            deployment.current_replicas = min(observation.spec_replicas, deployment.max_replicas)
            followed.append(deployment)
        changed.append(deployment)
    Deployment.objects.bulk_update(
        changed,
        [
            "observed_spec_replicas",
            "observed_ready_replicas",
            "observed_starting_replicas",
            "replicas_observed_at",
        ],
    )
    # Only where the count is not ours: elsewhere a planner's edit since the read stands.
    Deployment.objects.bulk_update(followed, ["current_replicas"])
    logger.debug("observed %d deployments in %.3f s", len(observed), time.monotonic() - started)
    return observed


def _bounded(config: dict, deadline: float) -> dict:
    configured = float(config.get("timeout_seconds") or 5.0)
    return {**config, "timeout_seconds": max(0.1, min(configured, deadline))}
