"""Test databases copied from one migrated template instead of each migrated on its own.

make test opens seven test databases at once (four PostgreSQL workers, the timing-sensitive
pass, two SQLite workers), and `migrate` costs 7 s of CPU each on this project's two cores.
The first process to take the template's lock migrates it; every process then copies it:
PostgreSQL with `CREATE DATABASE … TEMPLATE`, SQLite with its backup API into the worker's
in-memory database. The template's name carries a digest of every migration file and of the
database engine, so a changed migration builds a new one, and an unchanged one is reused by
the next run on the same machine.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import tempfile
from pathlib import Path

import django
from django.apps import apps
from django.conf import settings
from django.core.management import call_command

from tests.support.once import file_lock


def install(connection) -> None:
    """Make `connection.creation.create_test_db` copy the template (Django's setup_databases
    and teardown_databases call it and destroy_test_db as ever)."""
    vendor = connection.vendor
    if vendor not in ("postgresql", "sqlite"):
        return
    creation = connection.creation
    if vendor == "sqlite" and not creation.is_in_memory_db(creation._get_test_db_name()):
        return  # a test database in a file: Django's own way

    def create_test_db(verbosity=1, autoclobber=False, serialize=True, keepdb=False):
        test_name = creation._get_test_db_name()
        if vendor == "postgresql":
            _postgresql_copy(connection, test_name)
        else:
            _sqlite_copy(connection, test_name)
        if serialize:
            connection._test_serialized_contents = creation.serialize_db_to_string()
        connection.ensure_connection()
        return test_name

    creation.create_test_db = create_test_db


def _digest(vendor: str) -> str:
    """Of everything migrate reads: the migration files of every installed app, Django's
    version and the engine."""
    digest = hashlib.sha256(f"{django.__version__} {vendor}".encode())
    for config in sorted(apps.get_app_configs(), key=lambda c: c.label):
        folder = Path(config.path) / "migrations"
        for path in sorted(folder.glob("*.py")) if folder.is_dir() else []:
            digest.update(f"{config.label}/{path.name}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _migrate(connection) -> None:
    call_command(
        "migrate", verbosity=0, interactive=False, database=connection.alias, run_syncdb=True
    )
    call_command("createcachetable", database=connection.alias)
    connection.close()


def _use(connection, name: str) -> None:
    connection.close()
    settings.DATABASES[connection.alias]["NAME"] = name
    connection.settings_dict["NAME"] = name


def _postgresql_copy(connection, test_name: str) -> None:
    original = connection.settings_dict["NAME"]
    # A database name holds at most 63 bytes.
    template = f"{original[:36]}_template_{_digest('postgresql')}"
    quote = connection.ops.quote_name
    # Machine-wide: a PostgreSQL template is shared by every pass and checkout on the server.
    with file_lock(Path(tempfile.gettempdir()) / f"{template}.lock"):
        with connection.creation._nodb_cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [template])
            built = cursor.fetchone() is not None
        if not built:
            # Built under another name and renamed once migrated: a run killed mid-migrate
            # leaves no template that looks whole.
            building = template[:54] + "_building"
            with connection.creation._nodb_cursor() as cursor:
                cursor.execute(f"DROP DATABASE IF EXISTS {quote(building)} WITH (FORCE)")
                cursor.execute(f"CREATE DATABASE {quote(building)}")
            _use(connection, building)
            _migrate(connection)
            _use(connection, original)
            with connection.creation._nodb_cursor() as cursor:
                cursor.execute(f"ALTER DATABASE {quote(building)} RENAME TO {quote(template)}")
        with connection.creation._nodb_cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {quote(test_name)} WITH (FORCE)")
            cursor.execute(f"CREATE DATABASE {quote(test_name)} TEMPLATE {quote(template)}")
    _use(connection, test_name)


def _sqlite_copy(connection, test_name: str) -> None:
    original = Path(connection.settings_dict["NAME"])
    template = original.with_name(f"{original.stem}-template-{_digest('sqlite')}.sqlite3")
    with file_lock(template.with_suffix(".lock")):  # this checkout's own
        if not template.exists():
            building = template.with_suffix(".building")
            building.unlink(missing_ok=True)
            _use(connection, str(building))
            _migrate(connection)
            os.replace(building, template)
            for stale in original.parent.glob(f"{original.stem}-template-*.sqlite3"):
                if stale != template:
                    stale.unlink(missing_ok=True)  # of migrations since changed
    _use(connection, test_name)
    connection.ensure_connection()
    source = sqlite3.connect(template)
    try:
        source.backup(connection.connection)
    finally:
        source.close()
