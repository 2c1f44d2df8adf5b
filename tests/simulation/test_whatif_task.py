"""The what-if's Celery task on a real worker that takes only the benchmarks queue: a what-if is
queued as `simulation.run_whatif` and runs, and a message under the name the task had in the
benchmarking app (`benchmarking.run_whatif`, queued before the rename) still runs, routed to
that queue by the settings alone."""

import time

import pytest
from celery import current_app

from simulation import whatif
from simulation.models import WhatIfRun
from tests.support.processes import celery_worker_process

pytestmark = pytest.mark.django_db(transaction=True)

# A three-minute trace under one policy simulates in about a second here (the worker is up
# before the what-if is queued): far more than three times that, on a slower machine.
WAIT_SECONDS = 90


def finished(run: WhatIfRun) -> WhatIfRun:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        run.refresh_from_db()
        if run.finished:
            return run
        time.sleep(0.3)
    raise AssertionError(f"what-if {run.pk} still {run.status}: {run.progress_message}")


def test_a_what_if_runs_under_its_new_task_name_and_under_the_one_queued_before_the_rename(
    tmp_path,
):
    with celery_worker_process(tmp_path, queues="benchmarks"):
        # Queued by whatif_create once its transaction commits.
        run = whatif.whatif_create(
            trace_name="azure-conv", duration_minutes=3, policies=["static-peak"]
        )
        run = finished(run)
        assert run.status == WhatIfRun.Status.SUCCEEDED, run.error
        log = (tmp_path / "worker.log").read_text()
        assert "Task simulation.run_whatif[" in log
        assert "benchmarking.run_whatif" not in log

        # A run queued before the rename: its row, and its message under the former name,
        # sent without a queue (the routing is the settings').
        queued_before = WhatIfRun.objects.create(
            trace_name=run.trace_name,
            settings=run.settings,
            progress_total=run.progress_total,
            progress_message="queued",
        )
        current_app.send_task("benchmarking.run_whatif", args=[queued_before.pk])
        queued_before = finished(queued_before)

    assert queued_before.status == WhatIfRun.Status.SUCCEEDED, queued_before.error
    assert queued_before.result["policies"].keys() == run.result["policies"].keys()
    assert "Task benchmarking.run_whatif[" in (tmp_path / "worker.log").read_text()
