"""The database beyond the ORM: advisory locks with one registry of their keys, and COPY-upsert.

Locks. Every advisory lock the project takes is named in `Lock` below, so two features can never
pick the same key by accident and a reader finds all of them in one place. Three ways to take one:

- `exclusive(lock)`: one runner at a time for periodic work (the allocation tick, the health
  probes), held across transactions, never waited for: a PostgreSQL session-level advisory lock,
  or a Redis lock on SQLite (the demo).
- `try_lock_for_transaction(lock)`: the same but released at the end of the current transaction
  (the usage rollup's passes); on SQLite always taken (its writers are serialised anyway).
- `lock_for_transaction(lock, sub_key)`: wait for the lock, to the end of the transaction, one
  per `sub_key` (invoice generation, one per period).

Bulk writes through PostgreSQL's COPY: a per-connection staging table filled with COPY, then
one INSERT … SELECT that inserts or updates. For tens of thousands of rows per tick this is
several times faster than multi-row INSERT statements; on SQLite (the demo database) the ORM's
bulk_create does the same job.
"""

import enum
import json
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import redis
from django.conf import settings
from django.db import connection, transaction


class Lock(enum.IntEnum):
    """Every advisory lock key of the project: ASCII tags, so pg_locks shows what holds one."""

    ALLOCATION_TICK = 0x4D55_414C  # "MUAL": capacity.allocation.tick
    HEALTH_PROBES = 0x4D55_4845  # "MUHE": capacity.health.probes
    USAGE_ROLLUP = 0x4D55_5255  # "MURU": capacity.metering.rollups
    INVOICE_PERIOD = 0x4249_4C4C  # "BILL": billing.generation, one per month (the sub-key)


@contextmanager
def exclusive(lock: Lock, *, timeout_seconds: int = 120) -> Iterator[bool]:
    """Yields whether this caller holds the lock; never waits for it."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [int(lock)])
            taken = cursor.fetchone()[0]
        try:
            yield taken
        finally:
            if taken:
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_advisory_unlock(%s)", [int(lock)])
        return
    client = redis.Redis.from_url(settings.REDIS_URL)
    redis_lock = client.lock(
        f"controlplane:{lock.name.lower().replace('_', '-')}",
        timeout=timeout_seconds,
        blocking=False,
    )
    taken = redis_lock.acquire(blocking=False)
    try:
        yield taken
    finally:
        if taken:
            redis_lock.release()


def try_lock_for_transaction(lock: Lock) -> bool:
    """Take the lock to the end of the current transaction if free; False if someone holds it.
    SQLite needs none: its transactions begin IMMEDIATE (settings), which serialises writers."""
    if connection.vendor != "postgresql":
        return True
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [int(lock)])
        return bool(cursor.fetchone()[0])


def lock_for_transaction(lock: Lock, sub_key: int) -> None:
    """Wait for the lock on `sub_key`, to the end of the current transaction (none on SQLite)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [int(lock), sub_key])


def copy_upsert(
    *,
    table: str,
    columns: Sequence[str],
    rows: Sequence[tuple],
    conflict: Sequence[str] = (),
    update: Sequence[str] = (),
    returning: Sequence[str] = (),
) -> list[tuple]:
    """Insert `rows` into `table` (PostgreSQL), updating `update` columns on a `conflict`.

    Identifiers come from the caller's constants, never from input; values go through COPY.
    """
    if not rows:
        return []
    staging = f"staging_{table}"
    column_list = ", ".join(columns)
    sql = f"INSERT INTO {table} ({column_list}) SELECT {column_list} FROM {staging}"  # noqa: S608
    if conflict:
        sql += f" ON CONFLICT ({', '.join(conflict)}) "
        sql += (
            "DO UPDATE SET " + ", ".join(f"{c} = EXCLUDED.{c}" for c in update)
            if update
            else "DO NOTHING"
        )
    if returning:
        sql += f" RETURNING {', '.join(returning)}"
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {staging} ON COMMIT DELETE ROWS AS "  # noqa: S608
            f"SELECT {column_list} FROM {table} WITH NO DATA"
        )
        with cursor.cursor.copy(f"COPY {staging} ({column_list}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(
                    tuple(json.dumps(v) if isinstance(v, list | dict) else v for v in row)
                )
        cursor.execute(sql)
        result = cursor.fetchall() if returning else []
        cursor.execute(f"TRUNCATE {staging}")
    return result


# Fewer values (rows × fields) than this are written by the ORM's bulk_update: the staging
# table's four statements cost more than the CASE of a few rows. The CASE costs per value
# (100 rows of 7 fields took the ORM 0.1-0.3 s to build, COPY a few ms).
COPY_UPDATE_MIN_VALUES = 200


def copy_update(*, model, rows: Sequence, fields: Sequence[str], batch_size: int = 1000) -> None:
    """Write `fields` of model instances `rows` back by primary key: on PostgreSQL one COPY
    into a staging table and one UPDATE … FROM it (the ORM's bulk_update builds a CASE per
    field and row, whose SQL costs more to build than to run for a thousand rows); elsewhere
    the ORM's bulk_update. Identifiers come from the model's own fields, values through COPY."""
    if not rows:
        return
    if connection.vendor != "postgresql" or len(rows) * len(fields) < COPY_UPDATE_MIN_VALUES:
        model.objects.bulk_update(rows, list(fields), batch_size=batch_size)
        return
    meta = model._meta
    table = meta.db_table
    key = meta.pk.column
    columns = [meta.get_field(name).column for name in fields]
    # One staging table per (table, columns) and connection, emptied after use (as
    # copy_upsert's): the caller's transaction may be a savepoint that never commits.
    staging = f"staging_update_{table}_{zlib.crc32(' '.join(columns).encode()):08x}"
    column_list = ", ".join([key, *columns])
    assignments = ", ".join(f"{c} = s.{c}" for c in columns)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TEMP TABLE IF NOT EXISTS {staging} ON COMMIT DELETE ROWS AS "  # noqa: S608
            f"SELECT {column_list} FROM {table} WITH NO DATA"
        )
        with cursor.cursor.copy(f"COPY {staging} ({column_list}) FROM STDIN") as copy:
            for row in rows:
                values = [row.pk, *(getattr(row, name) for name in fields)]
                copy.write_row(
                    tuple(json.dumps(v) if isinstance(v, list | dict) else v for v in values)
                )
        cursor.execute(
            f"UPDATE {table} t SET {assignments} FROM {staging} s "  # noqa: S608
            f"WHERE t.{key} = s.{key}"
        )
        cursor.execute(f"TRUNCATE {staging}")


def driver_rows(queryset) -> list[tuple]:
    """The rows of a `values_list()` queryset as PostgreSQL's driver returns them.

    Django runs a converter per value of every annotated column (a `Sum` of a float column,
    an epoch cast to bigint), which cost the allocation snapshot more than its queries at
    tens of thousands of rows a tick. On PostgreSQL psycopg already returns those columns as
    the Python types wanted (double precision → float, bigint → int, boolean → bool), so the
    query compiled by the ORM is run as it is. Elsewhere (SQLite's booleans are integers, its
    sums of integers may be floats) the queryset is read normally.
    """
    if connection.vendor != "postgresql":
        return list(queryset)
    sql, params = queryset.query.get_compiler(queryset.db).as_sql()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()
