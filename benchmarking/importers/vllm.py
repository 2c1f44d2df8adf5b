"""vLLM's `vllm bench serve --save-result` JSON (vllm/benchmarks/serve.py; the older
benchmarks/benchmark_serving.py writes the same keys).

One run of the benchmark measures one workload at one load and writes one JSON object;
`--append-result` appends one object per run as a line, so a sweep over shapes and
concurrencies is one JSON Lines file (or several files). Per record:

- `completed`, `total_input_tokens`, `total_output_tokens`: the shape is the mean prompt and
  output length of the completed requests (a `random` dataset with `--random-range-ratio 0`
  gives every request exactly the asked lengths; `ignore_eos` is on for it by default);
- `request_throughput`: completed requests per second over the run (for the whole endpoint);
- `failed`, `max_concurrency`, `model_id`; `median_*_ms` and `p95_*_ms` of ttft, tpot and
  e2el when the run kept them (`--metric-percentiles 50,95`; the default keeps only p99).
"""

from __future__ import annotations

from typing import Any

from benchmarking.importers._common import (
    ImportedSample,
    check_error_share,
    mean_tokens,
    optional_int,
    optional_ms,
    positive_number,
    require,
    text_or_empty,
    whole_count,
)

FORMAT = "vllm"
TITLE = "a `vllm bench serve --save-result` result"
REQUIRED = ("completed", "total_input_tokens", "total_output_tokens", "request_throughput")


def looks_like(document: Any) -> bool:
    throughput = document.get("request_throughput") if isinstance(document, dict) else None
    return isinstance(throughput, int | float) and not isinstance(throughput, bool)


def read(where: str, document: Any, *, hint: str = "") -> ImportedSample:
    require(where, document, REQUIRED, what=TITLE, hint=hint)
    completed = whole_count(where, "completed", document["completed"], allow_zero=False)
    failed = document.get("failed")
    failed = whole_count(where, "failed", failed) if failed is not None else 0
    check_error_share(where, completed=completed, failed=failed)
    total_input = whole_count(
        where, "total_input_tokens", document["total_input_tokens"], total=True
    )
    total_output = whole_count(
        where, "total_output_tokens", document["total_output_tokens"], total=True
    )
    return ImportedSample(
        where=where,
        input_len=mean_tokens(where, "total_input_tokens / completed", total_input / completed),
        output_len=mean_tokens(where, "total_output_tokens / completed", total_output / completed),
        requests_per_s=positive_number(where, "request_throughput", document["request_throughput"]),
        concurrency=optional_int(document.get("max_concurrency")),
        ttft_p50_ms=optional_ms(document.get("median_ttft_ms")),
        ttft_p95_ms=optional_ms(document.get("p95_ttft_ms")),
        tpot_p50_ms=optional_ms(document.get("median_tpot_ms")),
        tpot_p95_ms=optional_ms(document.get("p95_tpot_ms")),
        e2e_p95_ms=optional_ms(document.get("p95_e2el_ms")),
        request_count=completed,
        error_count=failed,
        engine_model_id=text_or_empty(document.get("model_id")),
    )
