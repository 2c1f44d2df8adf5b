"""Per-deployment circuits: repeated push failures open a circuit for a while (doubling up to
CIRCUIT_MAX_SECONDS), and a push that lands closes it and records the replica count."""

from datetime import timedelta

from django.db import connection

from capacity.models import (
    ActuatorCircuit,
    AllocationDecision,
    Deployment,
)

CIRCUIT_THRESHOLD = 3
CIRCUIT_BASE_SECONDS = 60
CIRCUIT_MAX_SECONDS = 900


def record_applied(rows: list[AllocationDecision], *, counts: bool = True) -> None:
    """Close the circuits of pushes that landed and, with `counts`, record their targets as
    the replicas running (not for an HPA's bounds: its count stays the HPA's)."""
    if not rows:
        return
    ids = [row.deployment_id for row in rows]
    if counts:
        _record_counts(rows)
    ActuatorCircuit.objects.filter(deployment_id__in=ids, consecutive_failures__gt=0).update(
        consecutive_failures=0, opened_until=None, last_error=""
    )


def _record_counts(rows: list[AllocationDecision]) -> None:
    if connection.vendor == "postgresql":
        # One statement for the whole fleet; conditional on the count the tick saw, so a
        # planner's edit in between wins over this tick's view.
        values = ", ".join(["(%s, %s, %s)"] * len(rows))
        params = [
            v
            for row in rows
            for v in (row.deployment_id, row.current_replicas, row.target_replicas)
        ]
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE capacity_deployment AS d SET current_replicas = v.target "  # noqa: S608
                f"FROM (VALUES {values}) AS v(id, seen, target) "
                "WHERE d.id = v.id AND d.current_replicas = v.seen",
                params,
            )
    else:
        for row in rows:
            Deployment.objects.filter(
                pk=row.deployment_id, current_replicas=row.current_replicas
            ).update(current_replicas=row.target_replicas)


def record_failure(deployment_id: int, error: str, now) -> None:
    circuit, _ = ActuatorCircuit.objects.get_or_create(deployment_id=deployment_id)
    circuit.consecutive_failures += 1
    circuit.last_error = error[:2000]
    if circuit.consecutive_failures >= CIRCUIT_THRESHOLD:
        seconds = min(
            CIRCUIT_MAX_SECONDS,
            CIRCUIT_BASE_SECONDS * 2 ** (circuit.consecutive_failures - CIRCUIT_THRESHOLD),
        )
        circuit.opened_until = now + timedelta(seconds=seconds)
    circuit.save()
