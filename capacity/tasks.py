"""Thin Celery adapters for the capacity app (docs/design.md#tasks).

The allocation tick and what feeds it (the usage rollups, the reservations' status, the
capacity sample, the reaper of requests without an event) run on the `allocation` queue, whose
worker no long task shares (benchmarks and what-ifs run on `benchmarks`): two long runs can
never starve the tick or its inputs (controlplane/workers.py says which worker takes which
queue, for make run, compose and Kubernetes alike). The health probes have their own too.
"""

from celery import shared_task

from capacity.admission.gate import fallback_records_prune
from capacity.allocation import prediction
from capacity.allocation.heartbeat import tick_watch
from capacity.allocation.tick import allocation_tick as tick
from capacity.allocation.wake import (
    WAKE_EXPIRES_SECONDS,
    WAKE_QUEUE,
    WAKE_TASK,
    run_woken_tick,
)
from capacity.health.degradation import evaluate_all
from capacity.health.probes import probe_round
from capacity.metering import rollups
from capacity.metering.history import record_capacity
from capacity.metering.reaper import usage_reap as reap
from capacity.selling import reservations


@shared_task(name="capacity.usage_rollup", queue="allocation", expires=25)
def usage_rollup() -> dict:
    """The last minutes' usage rolled up per minute (capacity.metering.rollups)."""
    result = rollups.usage_rollup()
    # Fallback admission records are needed only while their usage events may still arrive.
    result["fallback_records_pruned"] = fallback_records_prune()
    return result


@shared_task(name="capacity.reservations_refresh_status", queue="allocation", expires=55)
def reservations_refresh_status() -> dict:
    """Reservations whose term started or ended since the last run (capacity.selling)."""
    return reservations.reservations_refresh_status()


@shared_task(name="capacity.allocation_tick", queue="allocation", expires=12)
def allocation_tick() -> dict:
    """One tick of the loop (capacity.allocation.tick): its id, whether another held the lock,
    and how many targets were applied or failed."""

    result = tick()
    return {"tick_id": result.tick_id, "skipped": result.skipped, "applied": result.applied,
            "failed": result.failed, "seconds": result.seconds}  # fmt: skip


@shared_task(name="capacity.capacity_sample", queue="allocation", expires=25)
def capacity_sample() -> dict:
    """The minute's capacity sample of every model, for the fleet page's charts
    (capacity.metering.history): out of the allocation tick, which it held for seconds."""

    return {"samples": record_capacity()}


@shared_task(name="capacity.demand_forecast_fit", expires=3000)
def demand_forecast_fit() -> dict:
    """Every model's demand forecast fitted again from its rollups (capacity.allocation
    .prediction): hourly, off the tick, which only evaluates the stored curve."""
    return prediction.demand_forecast_fit()


@shared_task(name="capacity.usage_reap", queue="allocation", expires=55)
def usage_reap() -> dict:
    """Requests whose gateway worker died holding their usage event: closed at 0 MU
    (capacity.metering.reaper)."""
    return reap()


@shared_task(name=WAKE_TASK, queue=WAKE_QUEUE, expires=WAKE_EXPIRES_SECONDS)
def allocation_wake(reason: str = "") -> dict:
    """A tick asked for now (capacity.allocation.wake): demand waiting at a model at zero."""
    return run_woken_tick(reason=reason)


@shared_task(name="capacity.health_probes", queue="health", expires=10)
def health_probes() -> dict:
    """A probe round (capacity.health.probes), the degradation levels it moves, and the
    tick's heartbeat watched from here, since the tick's own worker may be the one stalled."""
    result = probe_round()
    changes = evaluate_all()
    tick_alert = tick_watch()
    return {"probed": result.probed, "skipped": result.skipped, "failed": result.failed,
            "unhealthy": result.marked_unhealthy, "recovered": result.recovered,
            "degradation_changes": changes, "tick_alert": tick_alert}  # fmt: skip
