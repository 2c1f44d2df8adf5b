"""A database made before the layout move keeps its what-ifs: WhatIfRun moved from benchmarking
to simulation in the state only (the table stays benchmarking_whatifrun), and its content type
follows it so permissions and admin history still point at the model."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("benchmarking", "0002_whatifrun"), ("simulation", None)]
AFTER = [("benchmarking", "0003_delete_whatifrun"), ("simulation", "0001_initial")]

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.both_databases]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    # The state at the targets, with the apps the test reads too (content types, auth).
    nodes = [target for target in targets if target[1] is not None]
    nodes += [
        leaf for leaf in executor.loader.graph.leaf_nodes() if leaf[0] in ("contenttypes", "auth")
    ]
    return executor.loader.project_state(nodes).apps


def test_a_whatif_made_before_the_move_is_read_and_permissioned_after_it():
    old_apps = _migrate(BEFORE)
    OldWhatIfRun = old_apps.get_model("benchmarking", "WhatIfRun")
    ContentType = old_apps.get_model("contenttypes", "ContentType")
    Permission = old_apps.get_model("auth", "Permission")
    Group = old_apps.get_model("auth", "Group")
    run = OldWhatIfRun.objects.create(trace_name="made-before", settings={"overcommit": 1.5})
    content_type, _ = ContentType.objects.get_or_create(app_label="benchmarking", model="whatifrun")
    permission, _ = Permission.objects.get_or_create(
        content_type=content_type, codename="view_whatifrun", defaults={"name": "Can view"}
    )
    Group.objects.create(name="what-if readers").permissions.add(permission)
    try:
        new_apps = _migrate(AFTER)
        WhatIfRun = new_apps.get_model("simulation", "WhatIfRun")
        assert WhatIfRun._meta.db_table == "benchmarking_whatifrun"
        kept = WhatIfRun.objects.get(pk=run.pk)
        assert kept.trace_name == "made-before" and kept.settings == {"overcommit": 1.5}
        group = new_apps.get_model("auth", "Group").objects.get(name="what-if readers")
        assert [(p.content_type.app_label, p.codename) for p in group.permissions.all()] == [
            ("simulation", "view_whatifrun")
        ]
        assert WhatIfRun.objects.create(trace_name="made-after").pk > run.pk
    finally:
        # Leave the test database at the latest state for the tests after this one.
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
