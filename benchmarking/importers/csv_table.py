"""The project's own throughput table (`benchmarking.csv_import`), as samples like the others."""

from __future__ import annotations

from benchmarking.csv_import import REQUIRED_COLUMNS, parse_throughput_csv
from benchmarking.importers._common import ImportedSample
from core.errors import DomainError

FORMAT = "csv"
TITLE = f"a throughput table (CSV with {','.join(REQUIRED_COLUMNS)})"


def read(name: str, text: str) -> list[ImportedSample]:
    try:
        rows = parse_throughput_csv(text)
    except DomainError as error:
        raise DomainError(
            f"{name}: {error.message}", field=error.field, code=error.code, status=error.status
        ) from None
    return [
        ImportedSample(
            where=f"{name} line {row.line}",
            input_len=row.input_len,
            output_len=row.output_len,
            cached_input_len=row.cached_input_len,
            requests_per_s=row.requests_per_s,
            concurrency=row.concurrency,
            ttft_p95_ms=row.ttft_p95_ms,
            tpot_p95_ms=row.tpot_p95_ms,
        )
        for row in rows
    ]
