# A deployment's suite and a cost model's run are now rows benchmarking owns (issue 35: the
# schema follows the dependency order). benchmarking 0006 copied every link before these
# columns go, and copies them back when unapplied after this has restored them.
#
# On SQLite, dropping a column rebuilds the table, and the usage table's reference triggers
# (0035) name the deployment and cost-model tables: SQLite refuses the rebuild's rename while a
# trigger names a table that is, for that moment, gone. So the two triggers are dropped around
# the rebuild and written again as 0035 wrote them, both ways. PostgreSQL drops a column in
# place and keeps its triggers.

import importlib

from django.db import migrations

_references = importlib.import_module("capacity.migrations.0035_usage_references_checked_per_statement")
_TRIGGERS = ("usage_event_references_insert", "usage_event_references_update")


def _drop_sqlite_triggers(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for trigger in _TRIGGERS:
            schema_editor.execute(f"DROP TRIGGER IF EXISTS {trigger}", params=None)


def _create_sqlite_triggers(apps, schema_editor):
    if schema_editor.connection.vendor == "sqlite":
        for statement in _references._sqlite(apps):
            schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ('capacity', '0037_usage_prompts_and_sequences'),
        ('benchmarking', '0006_benchmark_references_owned_by_benchmarking'),
    ]

    operations = [
        migrations.RunPython(_drop_sqlite_triggers, _create_sqlite_triggers),
        migrations.RemoveField(
            model_name='costmodel',
            name='source_run',
        ),
        migrations.RemoveField(
            model_name='deployment',
            name='benchmark_suite',
        ),
        migrations.RunPython(_create_sqlite_triggers, _drop_sqlite_triggers),
    ]
