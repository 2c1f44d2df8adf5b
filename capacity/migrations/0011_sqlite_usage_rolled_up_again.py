"""On SQLite (the `make run` default) usage ingestion stored its datetimes as text with an
offset ("2026-12-01 04:00:00+00:00"), which the ORM's lookups never match, and the rollup then
marked those events rolled up with nothing written. This rewrites their datetimes as the ORM
stores them (UTC, no offset) and marks them not rolled up, so the next rollup pass (every
30 s) recomputes every minute they touch from the raw events. PostgreSQL stored them right:
nothing to do there."""

from datetime import UTC, datetime

from django.db import migrations
from django.utils import timezone

ACTOR = "system:migration capacity.0011_sqlite_usage_rolled_up_again"
COLUMNS = ("started_at", "finished_at", "minute", "ingested_at")


def forwards(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "sqlite":
        return
    adapt = connection.ops.adapt_datetimefield_value
    table = "capacity_usageevent"
    offsets = " OR ".join(f"{c} LIKE '%+%' OR {c} LIKE '%T%' OR {c} LIKE '%Z'" for c in COLUMNS)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT id, {', '.join(COLUMNS)} FROM {table} WHERE {offsets}")  # noqa: S608
        rows = cursor.fetchall()
        for row in rows:
            fixed = []
            for text in row[1:]:
                moment = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
                if moment.tzinfo is None:  # already stored as the ORM does (UTC)
                    moment = moment.replace(tzinfo=UTC)
                fixed.append(adapt(moment.astimezone(UTC)))
            cursor.execute(
                f"UPDATE {table} SET {', '.join(f'{c} = %s' for c in COLUMNS)}, "  # noqa: S608
                "rolled_up = 0 WHERE id = %s",
                [*fixed, row[0]],
            )
    if rows:
        AuditEntry = apps.get_model("controlplane", "AuditEntry")
        AuditEntry.objects.create(
            at=timezone.now(),
            actor=ACTOR,
            action="usage.roll_up_again",
            object_type="capacity.usageevent",
            object_repr=f"{len(rows)} usage events",
            after={"events": len(rows)},
            reason="SQLite datetimes rewritten as the ORM stores them; marked not rolled up",
        )
        print(f"\n  {len(rows)} usage event(s) rewritten and marked for the rollup again.")


class Migration(migrations.Migration):
    dependencies = [
        ("capacity", "0010_admission_records_decide_usage_class"),
        ("controlplane", "0001_initial"),
    ]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
