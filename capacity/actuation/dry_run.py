"""Dry run: touches nothing. The tick still stores the decision, so a new deployment can be
watched deciding before it is allowed to act."""

import logging

from capacity.actuation.base import Actuator, ScaleRequest

logger = logging.getLogger(__name__)


class DryRunActuator(Actuator):
    kind = "dry_run"

    def apply(self, request: ScaleRequest) -> int | None:
        logger.debug(
            "dry run: %s (%s) would scale %d -> %d replicas (decision %s)",
            request.deployment,
            request.model,
            request.current_replicas,
            request.target_replicas,
            request.decision_id,
        )
        # Nothing was asked of the data plane, so there is nothing observed to report.
        return None
