"""Parsing throughput tables from other tools (vLLM's serving benchmark, trtllm-bench, …).

Columns: `input_len,output_len,requests_per_s` (throughput per replica), optionally
`ttft_p95_ms,tpot_p95_ms,concurrency,cached_input_len`. Every row is checked before anything
is stored, so a bad file writes nothing; errors name the line and the column.
"""

import csv
import io
import math
from dataclasses import dataclass

from core.errors import DomainError

REQUIRED_COLUMNS = ("input_len", "output_len", "requests_per_s")
OPTIONAL_COLUMNS = ("ttft_p95_ms", "tpot_p95_ms", "concurrency", "cached_input_len")
MAX_ROWS = 100_000


@dataclass(frozen=True)
class ImportedRow:
    line: int
    input_len: int
    output_len: int
    requests_per_s: float
    cached_input_len: int = 0
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    concurrency: int | None = None


def _number(value: str, *, column: str, line: int) -> float:
    try:
        return float(value)
    except ValueError:
        raise DomainError(
            f"line {line}: {column} '{value}' is not a number.", field=column
        ) from None


def _positive_int(value: str, *, column: str, line: int, allow_zero: bool = False) -> int:
    number = _number(value, column=column, line=line)
    if not math.isfinite(number) or number != int(number):
        raise DomainError(f"line {line}: {column} '{value}' is not a whole number.", field=column)
    if number < 0 or (number == 0 and not allow_zero):
        raise DomainError(
            f"line {line}: {column} must be {'≥ 0' if allow_zero else '> 0'}, got {value}.",
            field=column,
        )
    return int(number)


def _positive_float(value: str, *, column: str, line: int) -> float:
    number = _number(value, column=column, line=line)
    if not math.isfinite(number) or number <= 0:
        raise DomainError(f"line {line}: {column} must be > 0, got {value}.", field=column)
    return number


def parse_throughput_csv(text: str) -> list[ImportedRow]:
    reader = csv.DictReader(io.StringIO(text.lstrip("\ufeff")))
    header = [name.strip() for name in (reader.fieldnames or [])]
    missing = [name for name in REQUIRED_COLUMNS if name not in header]
    if missing:
        raise DomainError(
            f"The CSV lacks the column(s) {', '.join(missing)}; it needs "
            f"{', '.join(REQUIRED_COLUMNS)} (optional: {', '.join(OPTIONAL_COLUMNS)}). "
            f"Found: {', '.join(header) or 'nothing'}.",
            field="file",
            code="missing_columns",
        )
    rows = []
    for raw in reader:
        line = reader.line_num
        row = {(key or "").strip(): (value or "").strip() for key, value in raw.items()}
        if not any(row.values()):
            continue
        for column in REQUIRED_COLUMNS:
            if not row.get(column):
                raise DomainError(f"line {line}: {column} is empty.", field=column)
        optional = {}
        for column in ("ttft_p95_ms", "tpot_p95_ms"):
            if row.get(column):
                optional[column] = _positive_float(row[column], column=column, line=line)
        if row.get("concurrency"):
            optional["concurrency"] = _positive_int(
                row["concurrency"], column="concurrency", line=line
            )
        if row.get("cached_input_len"):
            optional["cached_input_len"] = _positive_int(
                row["cached_input_len"], column="cached_input_len", line=line, allow_zero=True
            )
        rows.append(
            ImportedRow(
                line=line,
                input_len=_positive_int(row["input_len"], column="input_len", line=line),
                output_len=_positive_int(row["output_len"], column="output_len", line=line),
                requests_per_s=_positive_float(
                    row["requests_per_s"], column="requests_per_s", line=line
                ),
                **optional,
            )
        )
        if len(rows) > MAX_ROWS:
            raise DomainError(f"The CSV has more than {MAX_ROWS} rows.", field="file")
    if not rows:
        raise DomainError("The CSV has a header but no rows.", field="file")
    seen = {}
    for row in rows:
        key = (row.input_len, row.output_len, row.cached_input_len)
        if key in seen:
            raise DomainError(
                f"line {row.line}: the shape {row.input_len}/{row.output_len} repeats line "
                f"{seen[key]}; give one sustainable throughput per shape.",
                field="file",
            )
        seen[key] = row.line
    return rows
