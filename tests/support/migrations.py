"""Taking the test database to a named state of its migrations and back, for the tests of a
data migration (they store rows through the old schema's models, then migrate)."""

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor


def migrate_to(targets):
    """Migrate to `targets` ((app label, migration name) pairs); the models of that state."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def migrate_to_the_leaf() -> None:
    """Every app at its newest migration."""
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.fixture
def back_to_the_leaf():
    """After the test, the schema every other test expects."""
    yield
    migrate_to_the_leaf()


def old_served_model(apps, gpu_type_id: int, name: str = "llama-old"):
    """A served model stored through `apps`' (an old state's) model: today's factory would
    write columns that later migrations add (issue 36's `prediction_enabled` broke three tests
    that did)."""
    return apps.get_model("capacity", "ServedModel").objects.create(
        name=name,
        engine_model_id=f"org/{name}",
        parameters_billions=8.0,
        reference_gpu_type_id=gpu_type_id,
        context_length_tokens=8192,
    )
