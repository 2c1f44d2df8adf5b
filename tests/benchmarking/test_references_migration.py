"""Migrations benchmarking 0006 and capacity 0038 (issue 35: the schema follows the dependency
order) on stored data: every deployment's suite and every cost model's run, held until now by
capacity's columns, become rows benchmarking owns, and go back into the columns when the two
are unapplied. Rows without a link stay without one, both ways."""

import pytest
from django.db import connection

from tests.support.factories import GpuPoolFactory
from tests.support.migrations import migrate_to, old_served_model

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_databases]

BEFORE = [("capacity", "0037_usage_prompts_and_sequences"), ("benchmarking", "0005_sample_images")]
AFTER = [
    ("capacity", "0038_benchmark_references_moved_to_benchmarking"),
    ("benchmarking", "0006_benchmark_references_owned_by_benchmarking"),
]


def _stored(apps):
    """Two suites, three deployments (two with a suite), two runs, three cost models (two
    from a run), written through the models of the schema before the move."""
    pool = GpuPoolFactory()
    served_model = old_served_model(apps, pool.gpu_type_id)
    Suite = apps.get_model("benchmarking", "BenchmarkSuite")
    Deployment = apps.get_model("capacity", "Deployment")
    Run = apps.get_model("benchmarking", "BenchmarkRun")
    CostModel = apps.get_model("capacity", "CostModel")
    suites = [
        Suite.objects.create(name=name, grid=[[128, 16]], slo_ttft_p95_ms=1000, slo_tpot_p95_ms=50)
        for name in ("quick", "full")
    ]
    deployments = {
        name: Deployment.objects.create(
            name=name,
            served_model_id=served_model.pk,
            gpu_pool_id=pool.pk,
            benchmark_suite=suite,
            benchmark_nightly=suite is not None,
        )  # fmt: skip
        for name, suite in (("a", suites[0]), ("b", suites[1]), ("c", None))
    }
    runs = [
        Run.objects.create(
            suite=suites[0], served_model_id=served_model.pk, gpu_type_id=pool.gpu_type_id
        )
        for _ in range(2)
    ]
    cost_models = {
        version: CostModel.objects.create(
            served_model_id=served_model.pk,
            gpu_type_id=pool.gpu_type_id,
            version=version,
            features=["request"],
            weights_replica_seconds={"request": 0.05},
            alpha_mu_per_input_token=0,
            beta_mu_per_output_token=0,
            gamma_mu_per_request=0.08,
            mu_per_unit={},
            sample_count=6,
            distinct_shapes=6,
            cv_mape=0.02,
            cv_worst_error=0.05,
            source_run=run,
        )  # fmt: skip
        for version, run in ((1, runs[0]), (2, runs[1]), (3, None))
    }
    return (
        {name: (d.pk, d.benchmark_suite_id) for name, d in deployments.items()},
        {version: (c.pk, c.source_run_id) for version, c in cost_models.items()},
    )


def test_every_link_moves_to_benchmarking_and_back(back_to_the_leaf):
    deployments, cost_models = _stored(migrate_to(BEFORE))

    moved = migrate_to(AFTER)

    DeploymentSuite = moved.get_model("benchmarking", "DeploymentSuite")
    CostModelSource = moved.get_model("benchmarking", "CostModelSource")
    assert dict(DeploymentSuite.objects.values_list("deployment_id", "suite_id")) == {
        pk: suite for pk, suite in deployments.values() if suite is not None
    }
    assert dict(CostModelSource.objects.values_list("cost_model_id", "run_id")) == {
        pk: run for pk, run in cost_models.values() if run is not None
    }
    # Every row kept; the catalogue's tables no longer hold the columns.
    assert moved.get_model("capacity", "Deployment").objects.count() == 3
    assert moved.get_model("capacity", "CostModel").objects.count() == 3
    columns = {
        c.name
        for c in connection.introspection.get_table_description(
            connection.cursor(), "capacity_deployment"
        )
    }
    assert "benchmark_suite_id" not in columns

    back = migrate_to(BEFORE)

    Deployment = back.get_model("capacity", "Deployment")
    CostModel = back.get_model("capacity", "CostModel")
    assert {d.name: (d.pk, d.benchmark_suite_id) for d in Deployment.objects.all()} == deployments
    assert {c.version: (c.pk, c.source_run_id) for c in CostModel.objects.all()} == cost_models
