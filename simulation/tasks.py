"""Thin Celery adapters: take ids, call one service (docs/design.md#tasks).

The what-if task is `simulation.run_whatif` (`whatif.RUN_TASK`, queued by that name). It was
registered as `benchmarking.run_whatif` while it lived in the benchmarking app: that name stays
registered, running the same code, so that messages queued before the rename still run. Both
are routed to the benchmarks queue by CELERY_TASK_ROUTES (controlplane/settings.py).
"""

import logging

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from simulation import whatif

logger = logging.getLogger(__name__)

# The name the task had in the benchmarking app, kept for the messages queued under it.
RUN_TASK_FORMER_NAME = "benchmarking.run_whatif"

_RUN_OPTIONS = {
    "acks_late": True,
    # A redelivered message finds its run already claimed and does nothing.
    "reject_on_worker_lost": False,
    "time_limit": whatif.TASK_TIME_LIMIT_SECONDS,
    "soft_time_limit": whatif.TASK_TIME_LIMIT_SECONDS - 30,
}


def _run(run_id: int) -> None:
    try:
        whatif.whatif_execute(run_id)
    except SoftTimeLimitExceeded:
        whatif.whatif_fail(
            run_id, f"The simulation exceeded the {whatif.TASK_TIME_LIMIT_SECONDS} s limit."
        )
    except Exception as error:
        logger.exception("what-if %s crashed", run_id)
        whatif.whatif_fail(run_id, f"{type(error).__name__}: {error}")
        raise


@shared_task(name=whatif.RUN_TASK, **_RUN_OPTIONS)
def run_whatif(run_id: int) -> None:
    """Simulate the queued what-if `run_id` (whatif_execute); a run past the time limit, or
    one that crashed, is ended as failed with the reason."""
    _run(run_id)


@shared_task(name=RUN_TASK_FORMER_NAME, **_RUN_OPTIONS)
def run_whatif_by_former_name(run_id: int) -> None:
    """`run_whatif` under the name it had in the benchmarking app, for messages queued before
    the rename."""
    _run(run_id)
