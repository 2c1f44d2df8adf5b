"""Reads of benchmark suites, runs and their samples, for the API and the planner's pages."""

from django.db.models import QuerySet

from benchmarking.models import BenchmarkRun, BenchmarkSample, BenchmarkSuite
from capacity.models import CostModel, Deployment


def suites() -> QuerySet[BenchmarkSuite]:
    """Every benchmark suite."""
    return BenchmarkSuite.objects.all()


def runs() -> QuerySet[BenchmarkRun]:
    """Every run, with its suite, deployment, model and GPU type."""
    return BenchmarkRun.objects.select_related("suite", "deployment", "served_model", "gpu_type")


def samples_of(run: BenchmarkRun) -> QuerySet[BenchmarkSample]:
    """A run's samples by input and output length, then concurrency."""
    return run.samples.order_by("input_len", "output_len", "concurrency", "id")


# --- The planner's benchmark pages ---------------------------------------------------------------


def runs_without_log() -> QuerySet[BenchmarkRun]:
    """Runs without their log (up to 20,000 characters each, which a list never shows)."""
    return runs().defer("log")


def latest_runs_of_group(
    *, served_model, gpu_type, gpus_per_replica: int, limit: int
) -> list[BenchmarkRun]:
    """The newest runs (without their log) of a model on a GPU type and size."""
    return list(
        runs_without_log().filter(
            served_model=served_model, gpu_type=gpu_type, gpus_per_replica=gpus_per_replica
        )[:limit]
    )


def samples_in_shape_order(run: BenchmarkRun) -> QuerySet[BenchmarkSample]:
    """A run's samples by input, output and cached length, then concurrency."""
    return run.samples.order_by("input_len", "output_len", "cached_input_len", "concurrency", "id")


def sustainable_samples_of_run(run_id: int) -> QuerySet[BenchmarkSample]:
    """The samples a fit uses: sustainable, with a positive throughput, by shape."""
    return BenchmarkSample.objects.filter(
        run_id=run_id, sustainable=True, requests_per_s__gt=0
    ).order_by("input_len", "output_len", "cached_input_len")


def any_suites() -> bool:
    """Whether any suite exists."""
    return BenchmarkSuite.objects.exists()


def suite_of(deployment: Deployment) -> BenchmarkSuite | None:
    """The suite the deployment's nightly benchmark runs, or None (typed:
    `Deployment.benchmark_suite` is, to capacity, some model)."""
    suite = deployment.benchmark_suite
    return suite if isinstance(suite, BenchmarkSuite) else None


def cost_models_fitted_from(run: BenchmarkRun) -> QuerySet[CostModel]:
    """The versions fitted from a benchmark run, oldest first."""
    return CostModel.objects.filter(source_link__run=run).order_by("version")
