"""The references benchmarking owns into the catalogue: the suite a deployment's nightly
benchmark runs, and the run a cost model was fitted from.

Benchmark data points at the catalogue, never the reverse (docs/architecture.md: capacity
sits below benchmarking, in its code and in its schema). Capacity's API and admin still show
and set a deployment's `benchmark_suite`: they read it back through the reverse relations
(`Deployment.benchmark_suite`, `CostModel.source_run`), and a write announces itself through
capacity.hooks, which benchmarking subscribes to at start-up (BenchmarkingConfig.ready). The
subscriber runs inside the writing transaction, so the suite and the nightly beat row roll back
with the deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchmarking.models import BenchmarkRun, BenchmarkSuite, CostModelSource, DeploymentSuite
from benchmarking.schedules import (
    SCHEDULE_FIELDS,
    deployment_schedule_delete,
    deployment_schedule_sync,
)
from capacity.models import CostModel, Deployment


def deployment_suite_set(*, deployment: Deployment, suite: BenchmarkSuite | None) -> None:
    """Point the deployment's nightly benchmark at `suite` (None: no suite)."""
    if suite is None:
        DeploymentSuite.objects.filter(deployment=deployment).delete()
        # The deployment may hold the removed row in its cache of the reverse relation.
        deployment.benchmark_suite_link = None
        return
    link, _ = DeploymentSuite.objects.update_or_create(
        deployment=deployment, defaults={"suite": suite}
    )
    deployment.benchmark_suite_link = link


def cost_model_source_set(*, cost_model: CostModel, run: BenchmarkRun) -> None:
    """Record the run a cost model version was fitted from."""
    link, _ = CostModelSource.objects.update_or_create(cost_model=cost_model, defaults={"run": run})
    cost_model.source_link = link


def deployment_references_write(deployment: Deployment, changes: Mapping[str, Any]) -> None:
    """capacity.hooks subscriber: a created or changed deployment's suite and nightly beat row,
    in its transaction."""
    if "benchmark_suite" in changes:
        deployment_suite_set(deployment=deployment, suite=changes["benchmark_suite"])
    if SCHEDULE_FIELDS & set(changes):
        deployment_schedule_sync(deployment=deployment)


def deployment_references_delete(deployment_pk: int) -> None:
    """capacity.hooks subscriber: a deleted deployment's nightly beat rows go (its suite row
    went with it: the reference cascades)."""
    deployment_schedule_delete(deployment_pk=deployment_pk)
