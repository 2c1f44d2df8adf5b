"""Bulk writes through PostgreSQL's COPY: a per-connection staging table filled with COPY, then
one INSERT … SELECT that inserts or updates. For tens of thousands of rows per tick this is
several times faster than multi-row INSERT statements; on SQLite (the demo database) the ORM's
bulk_create does the same job."""

import json
from collections.abc import Sequence

from django.db import connection


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
