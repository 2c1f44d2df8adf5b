"""genai-perf's `profile_export_genai_perf.json` (triton-inference-server/perf_analyzer,
genai-perf/genai_perf/export_data/json_exporter.py), and the layout AIPerf copies.

One `genai-perf profile` run measures one workload at one concurrency (or request rate) and
writes one object: each metric is `{"unit": …, "avg": …, "p50": …, "p95": …, …}` (system
metrics such as `request_throughput` carry only `avg`), and `input_config` is the run's
configuration. Per file:

- `input_sequence_length.avg`, `output_sequence_length.avg`: the shape, as measured (tokens);
- `request_throughput.avg`: requests per second of the whole endpoint;
- `time_to_first_token` and `inter_token_latency` (genai-perf's time per output token) p50/p95,
  `request_latency` p95, in ms; `request_count.avg`;
- concurrency from `input_config.perf_analyzer.stimulus.concurrency` (genai-perf's config
  layout) or `input_config.concurrency` (its older flat layout of command-line arguments); the
  model from `input_config.model_names` or `input_config.model`.
"""

from __future__ import annotations

from typing import Any

from benchmarking.importers._common import (
    MISSING,
    ImportedSample,
    check_error_share,
    fail,
    lookup,
    mean_tokens,
    optional_int,
    optional_ms,
    positive_number,
    require,
    text_or_empty,
)

FORMAT = "genai-perf"
TITLE = "a genai-perf export (profile_export_genai_perf.json)"
REQUIRED = (
    "request_throughput.avg",
    "input_sequence_length.avg",
    "output_sequence_length.avg",
)
TIME_UNIT = "ms"


def looks_like(document: Any) -> bool:
    return isinstance(document, dict) and isinstance(document.get("request_throughput"), dict)


def _latency(where: str, document: Any, metric: str, statistic: str) -> float | None:
    block = document.get(metric)
    if not isinstance(block, dict) or statistic not in block:
        return None
    unit = block.get("unit", TIME_UNIT)
    if unit != TIME_UNIT:
        raise fail(f"{where}: {metric} is in {unit!r}; the export gives latencies in ms.")
    return optional_ms(block[statistic])


def _first_name(value: Any) -> str:
    if isinstance(value, list) and value:
        return text_or_empty(value[0])
    return text_or_empty(value)


def read_profile_export(
    where: str,
    document: Any,
    *,
    what: str,
    concurrency: Any,
    model: Any,
    errors: Any = None,
    hint: str = "",
) -> ImportedSample:
    """The metrics genai-perf and AIPerf share; the caller reads its own config layout."""
    require(where, document, REQUIRED, what=what, hint=hint)
    completed = lookup(document, "request_count.avg")
    completed_count = int(completed) if optional_int(completed) else 0
    error_count = int(errors) if optional_int(errors) else 0
    check_error_share(where, completed=completed_count, failed=error_count)
    return ImportedSample(
        where=where,
        input_len=mean_tokens(
            where, "input_sequence_length.avg", document["input_sequence_length"]["avg"]
        ),
        output_len=mean_tokens(
            where, "output_sequence_length.avg", document["output_sequence_length"]["avg"]
        ),
        requests_per_s=positive_number(
            where, "request_throughput.avg", document["request_throughput"]["avg"]
        ),
        concurrency=optional_int(concurrency),
        ttft_p50_ms=_latency(where, document, "time_to_first_token", "p50"),
        ttft_p95_ms=_latency(where, document, "time_to_first_token", "p95"),
        tpot_p50_ms=_latency(where, document, "inter_token_latency", "p50"),
        tpot_p95_ms=_latency(where, document, "inter_token_latency", "p95"),
        e2e_p95_ms=_latency(where, document, "request_latency", "p95"),
        request_count=completed_count,
        error_count=error_count,
        engine_model_id=_first_name(model),
    )


def read(where: str, document: Any, *, hint: str = "") -> ImportedSample:
    config = document.get("input_config") if isinstance(document, dict) else None
    concurrency = lookup(config, "perf_analyzer.stimulus.concurrency")
    if concurrency is MISSING:
        concurrency = lookup(config, "concurrency")
    model = lookup(config, "model_names")
    if model is MISSING:
        model = lookup(config, "model")
    return read_profile_export(
        where,
        document,
        what=TITLE,
        concurrency=None if concurrency is MISSING else concurrency,
        model=None if model is MISSING else model,
        hint=hint,
    )
