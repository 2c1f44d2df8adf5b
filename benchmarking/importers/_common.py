"""What every importer shares: one imported sample, reading JSON documents, and checked reads of
nested keys whose errors name the file, the record and the missing or bad key."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from capacity.metering.events import MAX_TOKENS
from core.errors import DomainError

MAX_RECORDS = 100_000
# Token counts, request counts and concurrency land in 32-bit integer columns.
MAX_COUNT = MAX_TOKENS
# A record whose failed requests exceed this share measured an endpoint that was refusing work,
# not its capacity; the load runner stops a run at the same share (BenchmarkSuite.max_error_rate).
MAX_ERROR_SHARE = 0.05

MISSING = object()


@dataclass(frozen=True)
class ImportedSample:
    """One measured point of a tool's result file, before it is divided by the replicas."""

    where: str  # the file, and the record inside it when it holds several ("a.jsonl line 3")
    input_len: int  # mean prompt tokens of the completed requests, rounded
    output_len: int  # mean output tokens of the completed requests, rounded
    requests_per_s: float  # completed requests per second of the whole measured endpoint
    cached_input_len: int = 0
    concurrency: int | None = None
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p95_ms: float | None = None
    e2e_p95_ms: float | None = None
    request_count: int = 0
    error_count: int = 0
    engine_model_id: str = ""  # the model the tool says it measured; "" when it does not say
    gpus_per_replica: int | None = None  # what the file says one replica ran on, if it says


def fail(message: str, *, code: str = "invalid_file") -> DomainError:
    return DomainError(message, field="file", code=code)


def load_json_documents(name: str, text: str) -> list[tuple[str, Any]]:
    """The JSON documents of a file: one value, or one per line (JSON Lines, as `vllm bench serve
    --append-result` writes), each with where it came from."""
    body = text.lstrip("\ufeff")
    try:
        return [(name, json.loads(body))]
    except RecursionError:
        raise fail(f"{name}: the JSON nests too deeply to read.") from None
    except json.JSONDecodeError as error:
        whole_file_error = error
    documents = []
    for number, line in enumerate(body.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            documents.append((f"{name} line {number}", json.loads(line)))
        except (json.JSONDecodeError, RecursionError):
            # Not JSON Lines either: report the whole file's error, which says where it broke.
            raise fail(
                f"{name} is not valid JSON: {whole_file_error.msg} at line "
                f"{whole_file_error.lineno}, column {whole_file_error.colno}.",
                code="invalid_json",
            ) from None
        if len(documents) > MAX_RECORDS:
            raise fail(f"{name} holds more than {MAX_RECORDS} records.")
    if not documents:
        raise fail(f"{name} is empty.")
    return documents


def lookup(document: Any, path: str) -> Any:
    """The value at a dotted path ("performance.request_throughput_req_s"), or MISSING."""
    value = document
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def missing_paths(document: Any, paths: Iterable[str]) -> list[str]:
    return [path for path in paths if lookup(document, path) is MISSING]


def top_level_keys(document: Any, limit: int = 12) -> str:
    if not isinstance(document, dict):
        return f"a JSON {type(document).__name__.replace('dict', 'object')}, not an object"
    keys = [str(key) for key in document][:limit]
    more = len(document) - len(keys)
    return ", ".join(keys) + (f" and {more} more" if more > 0 else "") if keys else "no keys"


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def positive_number(where: str, path: str, value: Any) -> float:
    number = _finite(value)
    if number is None or number <= 0:
        raise fail(f"{where}: {path} must be a positive number, got {value!r}.")
    return number


def whole_count(
    where: str, path: str, value: Any, *, allow_zero: bool = True, total: bool = False
) -> int:
    """A whole count; a `total` (tokens of a whole run) may exceed what one column holds."""
    number = _finite(value)
    lowest = 0 if allow_zero else 1
    highest = math.inf if total else MAX_COUNT
    if number is None or number != int(number) or not lowest <= number <= highest:
        bound = f"≥ {lowest}" if total else f"from {lowest} to {MAX_COUNT}"
        raise fail(f"{where}: {path} must be a whole number {bound}, got {value!r}.")
    return int(number)


def mean_tokens(where: str, path: str, value: Any) -> int:
    """A mean token count, rounded to the shape's length; it must round to at least one."""
    number = _finite(value)
    if number is None or not 0.5 <= number <= MAX_COUNT:
        raise fail(
            f"{where}: {path} must be a mean token count from 1 to {MAX_COUNT}, got {value!r}."
        )
    return round(number)


def optional_ms(value: Any) -> float | None:
    """A latency in ms when the file has a usable one; tools write NaN or null for none."""
    number = _finite(value)
    return number if number is not None and number >= 0 else None


def optional_int(value: Any) -> int | None:
    """A positive whole number when the file has a usable one (concurrency, a count)."""
    number = _finite(value)
    if number is None or number != int(number) or not 1 <= number <= MAX_COUNT:
        return None
    return int(number)


def text_or_empty(value: Any) -> str:
    return value.strip()[:200] if isinstance(value, str) else ""


def check_error_share(where: str, *, completed: int, failed: int) -> None:
    attempted = completed + failed
    if attempted and failed / attempted > MAX_ERROR_SHARE:
        raise fail(
            f"{where}: {failed} of {attempted} requests failed ({failed / attempted:.0%}); a "
            f"throughput with more than {MAX_ERROR_SHARE:.0%} failures measures refusals, not "
            "capacity. Re-run it where the endpoint serves every request.",
            code="too_many_failures",
        )


def require(where: str, document: Any, paths: Sequence[str], *, what: str, hint: str = "") -> None:
    """Refuse a document that lacks any of `paths`, naming every one it lacks."""
    if not isinstance(document, dict):
        raise fail(f"{where} is not {what}: it is {top_level_keys(document)}.{hint}")
    absent = missing_paths(document, paths)
    if absent:
        needs = "" if len(absent) == len(paths) else f" (such a file has {', '.join(paths)})"
        raise fail(
            f"{where} is not {what}: it lacks {', '.join(absent)}{needs}. Its keys: "
            f"{top_level_keys(document)}.{hint}",
            code="missing_keys",
        )
