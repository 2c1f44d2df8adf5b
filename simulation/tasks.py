"""Thin Celery adapters: take ids, call one service (DESIGN §6).

The what-if task keeps the name it had in the benchmarking app (`benchmarking.run_whatif`), so
messages queued before the move still find it.
"""

import logging

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded

from simulation import whatif

logger = logging.getLogger(__name__)


@shared_task(
    name="benchmarking.run_whatif",
    # The benchmarks queue: long, CPU-bound work nobody waits on by the second, kept off
    # "default" (short periodic housekeeping whose messages expire within seconds) and
    # "allocation" (the control loop's tick).
    queue="benchmarks",
    acks_late=True,
    # A redelivered message finds its run already claimed and does nothing.
    reject_on_worker_lost=False,
    time_limit=whatif.TASK_TIME_LIMIT_SECONDS,
    soft_time_limit=whatif.TASK_TIME_LIMIT_SECONDS - 30,
)
def run_whatif(run_id: int) -> None:
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
