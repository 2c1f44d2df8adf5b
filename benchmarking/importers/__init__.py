"""Benchmark results in the tools' own formats, as samples (docs/design.md#benchmarks).

| format | file | module |
| --- | --- | --- |
| `csv` | the project's table: `input_len,output_len,requests_per_s` per replica | csv_table |
| `vllm` | `vllm bench serve --save-result` JSON (JSON Lines with `--append-result`) | vllm |
| `genai-perf` | `profile_export_genai_perf.json` | genai_perf |
| `aiperf` | `profile_export_aiperf.json` | aiperf |
| `trtllm-bench` | `trtllm-bench throughput --report_json` | trtllm_bench |

`parse_result_files` reads one or more files of one format (`auto` tells them apart by their
keys) and returns their samples; every record is one sample. A record's shape is the mean
prompt and output length its requests had, and its throughput is the whole endpoint's: the
caller divides by the replicas behind it. Per shape, the record with the highest throughput is
the sustainable one that fits use (a sweep over concurrency measures each shape several times;
the tools' runs have no latency SLO, so the saturated point is the replica's capacity). A file
of the wrong kind is refused with a message naming what it lacks; nothing here writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarking.importers import aiperf, csv_table, genai_perf, trtllm_bench, vllm
from benchmarking.importers._common import (
    MAX_RECORDS,
    ImportedSample,
    fail,
    load_json_documents,
    top_level_keys,
)
from core.errors import DomainError

__all__ = [
    "AUTO",
    "CSV",
    "FORMATS",
    "ImportedResults",
    "ImportedSample",
    "detect_format",
    "parse_result_files",
]

# The JSON formats in the order they are told apart: AIPerf before genai-perf (it writes
# genai-perf's layout and adds its own configuration).
_JSON_MODULES = (trtllm_bench, aiperf, genai_perf, vllm)
FORMATS: dict[str, str] = {
    csv_table.FORMAT: csv_table.TITLE,
    **{module.FORMAT: module.TITLE for module in _JSON_MODULES},
}
_JSON_BY_FORMAT = {module.FORMAT: module for module in _JSON_MODULES}
AUTO = "auto"
CSV = csv_table.FORMAT


@dataclass(frozen=True)
class ImportedResults:
    file_format: str
    samples: tuple[ImportedSample, ...]
    sustainable: tuple[bool, ...]  # per sample: the highest throughput of its shape
    engine_model_id: str  # what the files say they measured; "" when they do not say
    gpus_per_replica: int | None  # what the files say a replica ran on; None when they do not

    @property
    def distinct_shapes(self) -> int:
        return sum(self.sustainable)


def _csv_header(text: str) -> bool:
    first = next((line for line in text.lstrip("\ufeff").splitlines() if line.strip()), "")
    return "input_len" in first and "," in first


def _looks_like_json(text: str) -> bool:
    return text.lstrip("\ufeff \t\r\n").startswith(("{", "["))


_NOT_A_SUMMARY = (
    (
        lambda d: "metadata" in d and "metrics" in d,
        "is AIPerf's per-request profile_export.jsonl; import the run's summary, "
        "profile_export_aiperf.json, written beside it",
    ),
    (
        lambda d: "experiments" in d,
        "is perf_analyzer's raw profile_export.json; import genai-perf's summary, "
        "profile_export_genai_perf.json, written beside it",
    ),
    (
        lambda d: "requests_per_second" in d and "elapsed_time" in d,
        "is a `vllm bench throughput --output-json` result, which does not say the requests' "
        "lengths; measure with `vllm bench serve --save-result` instead",
    ),
)

_WHAT_EACH_HAS = (
    "a vLLM `bench serve --save-result` result has a number request_throughput and completed, "
    "total_input_tokens, total_output_tokens; a genai-perf or AIPerf export has "
    "request_throughput.avg, input_sequence_length.avg and output_sequence_length.avg; a "
    "trtllm-bench report has performance.request_throughput_req_s and request_info; a CSV table "
    "has the columns input_len,output_len,requests_per_s"
)


def _first_object(documents: list[tuple[str, Any]]) -> Any:
    document = documents[0][1]
    if isinstance(document, list) and document:
        return document[0]
    return document


def _detect_json(documents: list[tuple[str, Any]]) -> str | None:
    document = _first_object(documents)
    for module in _JSON_MODULES:
        if module.looks_like(document):
            return module.FORMAT
    return None


def detect_format(name: str, text: str) -> str:
    """The format of one file, told by its content; a clear error when no importer fits."""
    if not _looks_like_json(text):
        return csv_table.FORMAT
    documents = load_json_documents(name, text)
    detected = _detect_json(documents)
    if detected is not None:
        return detected
    document = _first_object(documents)
    if isinstance(document, dict):
        for test, says in _NOT_A_SUMMARY:
            if test(document):
                raise fail(f"{name} {says}.", code="wrong_file")
    raise fail(
        f"Cannot tell which tool wrote {name}: {_WHAT_EACH_HAS}. {name} has "
        f"{top_level_keys(document)}.",
        code="unknown_format",
    )


def _records(
    file_format: str, name: str, documents: list[tuple[str, Any]]
) -> list[tuple[str, Any]]:
    records = []
    for where, document in documents:
        if isinstance(document, list):
            if file_format != vllm.FORMAT:
                raise fail(
                    f"{where} holds a list of {len(document)} values; {FORMATS[file_format]} "
                    "is one object per file (give each run's file)."
                )
            records.extend((f"{where}[{index}]", item) for index, item in enumerate(document))
        else:
            records.append((where, document))
    if not records:
        raise fail(f"{name} holds no records.")
    return records


def _read_file(name: str, text: str, file_format: str) -> list[ImportedSample]:
    if file_format == csv_table.FORMAT:
        if _looks_like_json(text):
            raise fail(
                f"{name} is JSON, not {csv_table.TITLE}.{_hint(name, text)}", code="wrong_format"
            )
        return csv_table.read(name, text)
    if not _looks_like_json(text):
        raise fail(
            f"{name} is not JSON, so not {FORMATS[file_format]}"
            + (" (it reads like a CSV table: use the format csv)." if _csv_header(text) else "."),
            code="wrong_format",
        )
    documents = load_json_documents(name, text)
    detected = _detect_json(documents)
    hint = (
        f" It looks like {FORMATS[detected]}: import it with the format {detected}."
        if detected not in (None, file_format)
        else ""
    )
    module = _JSON_BY_FORMAT[file_format]
    return [
        module.read(where, record, hint=hint)
        for where, record in _records(file_format, name, documents)
    ]


def _hint(name: str, text: str) -> str:
    try:
        detected = detect_format(name, text)
    except DomainError:
        return ""
    return f" It looks like {FORMATS[detected]}: import it with the format {detected}."


def _one(values: set, *, what: str) -> Any:
    if len(values) > 1:
        raise fail(
            f"The files disagree on {what}: {', '.join(sorted(map(str, values)))}; import one "
            "at a time.",
            code="mixed_files",
        )
    return next(iter(values), None)


def parse_result_files(
    files: Sequence[tuple[str, str]], *, file_format: str = AUTO
) -> ImportedResults:
    """Samples of (name, text) files of one format; `file_format` is a FORMATS key or "auto"."""
    if file_format != AUTO and file_format not in FORMATS:
        raise DomainError(
            f"Unknown format {file_format!r}; known: {AUTO}, {', '.join(FORMATS)}.",
            field="format",
        )
    if not files:
        raise fail("No files to import.")
    formats = {
        name: detect_format(name, text) if file_format == AUTO else file_format
        for name, text in files
    }
    if len(set(formats.values())) > 1:
        raise fail(
            "The files are of different formats: "
            + ", ".join(f"{name} ({fmt})" for name, fmt in formats.items())
            + "; import one format at a time.",
            code="mixed_files",
        )
    chosen = next(iter(formats.values()))
    if chosen == csv_table.FORMAT and len(files) > 1:
        raise fail("A CSV is one table: import one CSV file at a time.", code="mixed_files")
    samples: list[ImportedSample] = []
    for name, text in files:
        samples.extend(_read_file(name, text, chosen))
        if len(samples) > MAX_RECORDS:
            raise fail(f"The files hold more than {MAX_RECORDS} records.")
    models = {sample.engine_model_id for sample in samples if sample.engine_model_id}
    gpus = {sample.gpus_per_replica for sample in samples if sample.gpus_per_replica}
    best: dict[tuple[int, int, int], int] = {}
    for index, sample in enumerate(samples):
        key = (sample.input_len, sample.output_len, sample.cached_input_len)
        if key not in best or sample.requests_per_s > samples[best[key]].requests_per_s:
            best[key] = index
    chosen_indexes = set(best.values())
    return ImportedResults(
        file_format=chosen,
        samples=tuple(samples),
        sustainable=tuple(index in chosen_indexes for index in range(len(samples))),
        engine_model_id=_one(models, what="the model they measured") or "",
        gpus_per_replica=_one(gpus, what="the GPUs of a replica"),
    )
