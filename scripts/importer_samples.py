"""Writes the importers' sample files (tests/benchmarking/data/) from tables the project ships.

    python scripts/importer_samples.py

No published result file of vLLM's `bench serve`, genai-perf, AIPerf or trtllm-bench with a
licence to ship and enough shapes to fit was found, so each sample is written here in the tool's
layout (the keys its own code writes; tests/benchmarking/data/README.md names the code and
commits) and carries figures from a shipped table, so an import can be checked against the
fit of that table. Only keys whose values the table gives are written: a tool's other keys
(latency means and medians, timestamps) are left out rather than made up.
"""

from __future__ import annotations

import csv
import json
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarking" / "data"
OUT = ROOT / "tests" / "benchmarking" / "data"
WINDOW_SECONDS = 5  # each point of the emulator tables was measured for 5 s (their README)

# The page's $num_requests per shape (perf-overview.md, "Preparing a Dataset").
TRTLLM_NUM_REQUESTS = {
    (128, 128): 30000,
    (128, 2048): 3000,
    (128, 4096): 1500,
    (1000, 2000): 1500,
    (2048, 128): 3000,
    (2048, 2048): 1500,
    (5000, 500): 1500,
    (1000, 1000): 3000,
    (500, 2000): 3000,
    (20000, 2000): 1000,
}


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def exact_lengths(tokens: int, unit: str) -> dict:
    """Every request of a run had exactly this length: all statistics equal it."""
    stats = {f"p{p}": float(tokens) for p in (1, 5, 10, 25, 50, 75, 90, 95, 99)}
    return {"unit": unit, "avg": float(tokens), **stats, "min": tokens, "max": tokens, "std": 0.0}


def completed_in_window(requests_per_s: float) -> int:
    return max(1, round(requests_per_s * WINDOW_SECONDS))


def vllm_records() -> list[dict]:
    records = []
    for row in rows(DATA / "emulator" / "llama31-8b_l40s_tp1.csv"):
        isl, osl, rps = int(row["input_len"]), int(row["output_len"]), float(row["requests_per_s"])
        completed = completed_in_window(rps)
        records.append(
            {
                "endpoint_type": "openai",
                "backend": "openai",
                "label": None,
                "model_id": "llama-3.1-8b",
                "num_prompts": completed,
                "request_rate": "inf",
                "burstiness": 1.0,
                "max_concurrency": int(row["concurrency"]),
                "duration": completed / rps,
                "completed": completed,
                "failed": 0,
                "total_input_tokens": completed * isl,
                "total_output_tokens": completed * osl,
                "request_throughput": rps,
                "request_goodput": None,
                "output_throughput": rps * osl,
                "total_token_throughput": rps * (isl + osl),
                "p95_ttft_ms": float(row["ttft_p95_ms"]),
                "p95_tpot_ms": float(row["tpot_p95_ms"]),
            }
        )
    return records


def profile_export_metrics(row: dict[str, str], *, count_unit: str) -> dict:
    isl, osl, rps = int(row["input_len"]), int(row["output_len"]), float(row["requests_per_s"])
    return {
        "request_throughput": {"unit": "requests/sec", "avg": rps},
        "time_to_first_token": {"unit": "ms", "p95": float(row["ttft_p95_ms"])},
        "inter_token_latency": {"unit": "ms", "p95": float(row["tpot_p95_ms"])},
        "output_token_throughput": {"unit": "tokens/sec", "avg": rps * osl},
        "output_sequence_length": exact_lengths(osl, "tokens"),
        "input_sequence_length": exact_lengths(isl, "tokens"),
        "request_count": {"unit": count_unit, "avg": completed_in_window(rps)},
    }


def genai_perf_export(row: dict[str, str]) -> dict:
    isl, osl = int(row["input_len"]), int(row["output_len"])
    return {
        **profile_export_metrics(row, count_unit="count"),
        "input_config": {
            "model_names": ["qwen2.5-72b"],
            "endpoint": {
                "service_kind": "openai",
                "type": "completions",
                "streaming": True,
                "url": "localhost:8000",
            },
            "perf_analyzer": {"stimulus": {"concurrency": int(row["concurrency"])}},
            "input": {
                "synthetic_tokens": {"mean": isl, "stddev": 0},
                "output_tokens": {"mean": osl, "stddev": 0, "deterministic": False},
            },
            "subcommand": "profile",
        },
    }


def aiperf_export(row: dict[str, str]) -> dict:
    isl, osl, concurrency = int(row["input_len"]), int(row["output_len"]), int(row["concurrency"])
    return {
        **profile_export_metrics(row, count_unit="requests"),
        "input_config": {
            "endpoint": {
                "model_names": ["qwen2.5-72b"],
                "type": "completions",
                "streaming": True,
                "url": "localhost:8000",
            },
            "input": {
                "prompt": {
                    "input_tokens": {"mean": isl, "stddev": 0},
                    "output_tokens": {"mean": osl, "stddev": 0},
                }
            },
            "loadgen": {"concurrency": concurrency},
            "cli_command": (
                "aiperf profile --model qwen2.5-72b --endpoint-type completions --streaming "
                f"--synthetic-input-tokens-mean {isl} --synthetic-input-tokens-stddev 0 "
                f"--output-tokens-mean {osl} --output-tokens-stddev 0 "
                f"--concurrency {concurrency}"
            ),
        },
        "was_cancelled": False,
        "error_summary": [],
    }


def trtllm_report(row: dict[str, str]) -> dict:
    isl, osl = int(row["input_len"]), int(row["output_len"])
    rps, tokens = Decimal(row["requests_per_s"]), Decimal(row["output_tokens_per_s"])
    gpus = int(row["gpus_per_replica"])
    requests = TRTLLM_NUM_REQUESTS[(isl, osl)]
    length_stats = {
        name: {
            "p50": float(value),
            "p95": float(value),
            "p99": float(value),
            "minimum": float(value),
            "maximum": float(value),
            "average": float(value),
        }
        for name, value in (("isl_stats", isl), ("osl_stats", osl), ("seq_len_stats", isl + osl))
    }
    return {
        "engine": {"model": "nvidia/Llama-3.3-70B-Instruct-FP8", "backend": "Pytorch"},
        "world_info": {"tp_size": gpus, "pp_size": 1, "ep_size": 1, "world_size": gpus},
        "request_info": {
            "num_requests": requests,
            "avg_input_length": float(isl),
            "avg_output_length": float(osl),
        },
        "performance": {
            "total_latency_ms": float(Decimal(requests) / rps * 1000),
            "request_throughput_req_s": float(rps),
            "system_output_throughput_tok_s": float(tokens),
            "system_total_throughput_tok_s": float(rps * (isl + osl)),
            "output_throughput_per_gpu_tok_s": float(tokens / gpus),
        },
        "dataset": {
            **length_stats,
            "num_requests": requests,
            "max_isl": isl,
            "max_osl": osl,
            "max_sequence_length": isl + osl,
            "avg_isl": isl,
            "avg_osl": osl,
            "avg_sequence_length": isl + osl,
        },
    }


def write(path: Path, document: dict | list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def main() -> None:
    # `vllm bench serve --save-result --append-result`: one JSON object per line.
    lines = (json.dumps(record) for record in vllm_records())
    (OUT / "vllm_bench_serve_llama31-8b_l40s_tp1.jsonl").write_text("\n".join(lines) + "\n")
    for row in rows(DATA / "emulator" / "qwen25-72b_h100_tp4.csv"):
        run = f"isl{row['input_len']}_osl{row['output_len']}_concurrency{row['concurrency']}"
        write(OUT / "genai-perf" / run / "profile_export_genai_perf.json", genai_perf_export(row))
    for row in rows(DATA / "emulator" / "qwen25-72b_a100_tp4.csv"):
        run = f"isl{row['input_len']}_osl{row['output_len']}_concurrency{row['concurrency']}"
        write(OUT / "aiperf" / run / "profile_export_aiperf.json", aiperf_export(row))
    for row in rows(DATA / "trtllm_llama33-70b_fp8_h100_tp2.csv"):
        name = f"report_isl{row['input_len']}_osl{row['output_len']}.json"
        write(OUT / "trtllm-bench" / name, trtllm_report(row))


if __name__ == "__main__":
    main()
