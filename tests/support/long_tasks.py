"""A long task for the tests of the workers' queues: it holds a slot of the worker that takes
its queue for as long as it is told (a benchmark run or a what-if holds one for minutes). A
test's worker imports it with `celery worker --include tests.support.long_tasks`; the tests
send it by name (`occupy`)."""

import time
from pathlib import Path

from celery import shared_task

OCCUPY = "tests.occupy"


@shared_task(name=OCCUPY, queue="benchmarks")
def occupy(seconds: float, marker: str) -> None:
    Path(marker).write_text(str(time.time()))
    time.sleep(seconds)
