"""trtllm-bench's report (`trtllm-bench … throughput --report_json FILE`; NVIDIA/TensorRT-LLM,
tensorrt_llm/bench/dataclasses/reporting.py, `ReportUtility.get_statistics_dict`).

One run is one dataset through one engine (one replica: its TP × PP GPUs) and writes one
object. Per file:

- `request_info.avg_input_length`, `request_info.avg_output_length`: the shape (the mean over
  the run's requests; the published tables use datasets where every request has the same);
- `performance.request_throughput_req_s`: requests per second of the replica;
- `world_info.world_size` (else `tp_size` × `pp_size`): the replica's GPUs;
- `request_info.num_requests`, `engine.model`; with `--streaming`,
  `streaming_metrics.ttft_percentiles` and `tpot_percentiles` (p50, p95, in ms);
  `performance.request_latency_percentiles_ms.p95`.
"""

from __future__ import annotations

from typing import Any

from benchmarking.importers._common import (
    MISSING,
    ImportedSample,
    fail,
    lookup,
    mean_tokens,
    optional_int,
    optional_ms,
    positive_number,
    require,
    text_or_empty,
)

FORMAT = "trtllm-bench"
TITLE = "a trtllm-bench report (--report_json)"
REQUIRED = (
    "performance.request_throughput_req_s",
    "request_info.avg_input_length",
    "request_info.avg_output_length",
)


def looks_like(document: Any) -> bool:
    return isinstance(document, dict) and "performance" in document and "request_info" in document


def _gpus(where: str, document: Any) -> int | None:
    world = document.get("world_info")
    if not isinstance(world, dict):
        return None
    size = optional_int(world.get("world_size"))
    tp, pp = optional_int(world.get("tp_size")), optional_int(world.get("pp_size"))
    if size is None and tp is not None:
        size = tp * (pp or 1)
    if size is None and any(key in world for key in ("world_size", "tp_size")):
        raise fail(f"{where}: world_info gives no whole number of GPUs: {world!r}.")
    return size


def _value(document: Any, path: str) -> Any:
    value = lookup(document, path)
    return None if value is MISSING else value


def read(where: str, document: Any, *, hint: str = "") -> ImportedSample:
    require(where, document, REQUIRED, what=TITLE, hint=hint)
    requests = optional_int(_value(document, "request_info.num_requests")) or 0
    return ImportedSample(
        where=where,
        input_len=mean_tokens(
            where, "request_info.avg_input_length", document["request_info"]["avg_input_length"]
        ),
        output_len=mean_tokens(
            where, "request_info.avg_output_length", document["request_info"]["avg_output_length"]
        ),
        requests_per_s=positive_number(
            where,
            "performance.request_throughput_req_s",
            document["performance"]["request_throughput_req_s"],
        ),
        ttft_p50_ms=optional_ms(_value(document, "streaming_metrics.ttft_percentiles.p50")),
        ttft_p95_ms=optional_ms(_value(document, "streaming_metrics.ttft_percentiles.p95")),
        tpot_p50_ms=optional_ms(_value(document, "streaming_metrics.tpot_percentiles.p50")),
        tpot_p95_ms=optional_ms(_value(document, "streaming_metrics.tpot_percentiles.p95")),
        e2e_p95_ms=optional_ms(_value(document, "performance.request_latency_percentiles_ms.p95")),
        request_count=requests,
        engine_model_id=text_or_empty(_value(document, "engine.model")),
        gpus_per_replica=_gpus(where, document),
    )
