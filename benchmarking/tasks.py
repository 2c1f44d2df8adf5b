"""Thin Celery adapters: take ids, call one service (docs/design.md#tasks)."""

import logging

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings

from benchmarking import services
from benchmarking.selectors import suite_of
from capacity.models import Deployment

logger = logging.getLogger(__name__)


@shared_task(
    name=services.RUN_TASK,  # "benchmarking.run_benchmark", queued by name by services.run_queue
    queue=services.RUN_QUEUE,
    acks_late=True,
    # A redelivered message finds its run already claimed and does nothing: safe to repeat.
    reject_on_worker_lost=False,
    time_limit=settings.BENCHMARK_TASK_TIME_LIMIT_SECONDS,
    soft_time_limit=settings.BENCHMARK_TASK_TIME_LIMIT_SECONDS - 60,
)
def run_benchmark(run_id: int) -> None:
    """Execute a queued run (`services.run_execute`); whatever ends it early fails it, with
    the reason."""
    try:
        services.run_execute(run_id=run_id)
    except SoftTimeLimitExceeded:
        services.run_fail(
            run_id=run_id,
            error=f"The run exceeded the {settings.BENCHMARK_TASK_TIME_LIMIT_SECONDS} s limit.",
        )
    except Exception as error:
        # Whatever broke, the row must not stay "running": end it with the reason.
        logger.exception("benchmark run %s crashed", run_id)
        services.run_fail(run_id=run_id, error=f"{type(error).__name__}: {error}")
        raise


@shared_task(name="benchmarking.reap_stale_runs", queue="benchmarks", expires=50)
def reap_stale_runs() -> list[int]:
    """The beat's minute: fail the runs whose worker stopped reporting (their ids)."""
    return services.runs_reap_stale()


@shared_task(name="benchmarking.benchmark_deployment", queue="benchmarks")
def benchmark_deployment(deployment_id: int) -> int | None:
    """The nightly schedule's entry: queue a run of the deployment's suite."""
    deployment = (
        Deployment.objects.filter(pk=deployment_id)
        .select_related("benchmark_suite_link__suite")
        .first()
    )
    suite = None if deployment is None else suite_of(deployment)
    if deployment is None or not deployment.benchmark_nightly or suite is None:
        logger.info("deployment %s is not set up for nightly benchmarks", deployment_id)
        return None
    return services.run_queue(suite=suite, deployment=deployment).pk
