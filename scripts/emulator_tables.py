"""The demo's throughput tables for GPU types without a published one, measured on the emulator.

    python scripts/emulator_tables.py profiles           # write benchmarking/data/emulator/*.json
    python scripts/emulator_tables.py measure [NAME ...] # benchmark them, write *.csv beside them

`profiles` derives one engine-emulator profile per (model, GPU type, GPUs per replica) of the
demo (`benchmarking/data/emulator/README.md` has the table and the arithmetic):

1. The H100 profiles are calibrated on NVIDIA's published TensorRT-LLM tables
   (`benchmarking/data/trtllm_*.csv`): the emulator's ground truth has the cost model's form
   (`simulation.engine.profile.ground_truth_replica_seconds`), so a fit of the table on the
   emulator's four terms gives its constants: prefill per token = w_input, per context token =
   w_input×output / 1000, and per output token = base / max_num_seqs + per sequence, where the
   base step is the weights read once (weight bytes per GPU / HBM bandwidth).
2. A profile on another GPU type scales those constants by spec-sheet ratios against the H100
   SXM, in 8-bit formats throughout (FP8; INT8 on the A100, which has no FP8): the memory-bound
   terms (base step, per context token) by HBM bandwidth, the compute-bound terms (prefill,
   per sequence) by dense 8-bit tensor throughput. A replica over more GPUs (tensor
   parallelism) divides the per-GPU work, at an efficiency below 1 for the all-reduce.
3. The KV budget is what the GPUs' memory holds after the weights and a 10 % reserve.

`measure` starts `python -m dataplane.emulator` on each profile and drives it with the load runner
the control plane's benchmarks use (`benchmarking.runner.run_grid`, the suite below), then writes
the sustainable requests/s per shape in the import format (`manage.py import_benchmark`). Run it
on a quiet machine: the emulator must keep real time, and the largest step lag seen is printed
and kept in the README.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("DEBUG", "1")

DATA = ROOT / "benchmarking" / "data"
OUT = DATA / "emulator"

# Spec sheets (dense, without sparsity): HBM bandwidth in TB/s, tensor TFLOPS.
# The H100 and L40S run the FP8 checkpoints the published tables measured. The A100 has no FP8:
# it runs the 8-bit format TensorRT-LLM offers on Ampere, INT8 weights and activations
# (SmoothQuant W8A8) with an INT8 KV cache, so it reads as many bytes per step as FP8 does and
# its 8-bit tensor throughput is INT8's.
GPUS = {
    "H100-80GB": {"memory_gb": 80, "bandwidth_tb_s": 3.35, "eight_bit_tflops": 1979},
    "L40S-48GB": {"memory_gb": 48, "bandwidth_tb_s": 0.864, "eight_bit_tflops": 733},
    "A100-80GB": {"memory_gb": 80, "bandwidth_tb_s": 2.039, "eight_bit_tflops": 624},
}
# Share of the ideal speed-up a replica keeps when its model is split over twice the GPUs.
TP_EFFICIENCY_PER_DOUBLING = 0.85
MEMORY_RESERVE_SHARE = 0.10  # activations, CUDA graphs, fragmentation
MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class Model:
    name: str
    parameters_billions: float
    layers: int
    kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


LLAMA_8B = Model("llama-3.1-8b", 8.03, 32, 8, 128, 8192, 128_256)
LLAMA_70B = Model("llama-3.3-70b", 70.6, 80, 8, 128, 32768, 128_256)
QWEN_72B = Model("qwen2.5-72b", 72.7, 80, 8, 128, 32768, 152_064)


@dataclass(frozen=True)
class Profile:
    """One emulator profile: `model` on `gpus` × `gpu`, from a TensorRT-LLM table on H100
    (`calibration`, measured with `calibration_model` on `calibration_gpus` H100s)."""

    name: str
    model: Model
    gpu: str
    gpus: int
    calibration: str
    calibration_model: Model
    calibration_gpus: int
    measure: bool  # False: the published table is used; the profile is for the demo's engines


PROFILES = [
    Profile("llama31-8b_h100_tp1", LLAMA_8B, "H100-80GB", 1,
            "trtllm_llama31-8b_fp8_h100_tp1.csv", LLAMA_8B, 1, measure=False),
    Profile("llama31-8b_l40s_tp1", LLAMA_8B, "L40S-48GB", 1,
            "trtllm_llama31-8b_fp8_h100_tp1.csv", LLAMA_8B, 1, measure=True),
    Profile("qwen25-72b_h100_tp4", QWEN_72B, "H100-80GB", 4,
            "trtllm_llama33-70b_fp8_h100_tp2.csv", LLAMA_70B, 2, measure=True),
    Profile("qwen25-72b_a100_tp4", QWEN_72B, "A100-80GB", 4,
            "trtllm_llama33-70b_fp8_h100_tp2.csv", LLAMA_70B, 2, measure=True),
]  # fmt: skip

# The benchmark: the demo's SLOs; outputs up to 256 tokens keep a point within seconds.
GRID = [(128, 32), (128, 256), (512, 64), (512, 256), (1024, 128), (2048, 32), (2048, 256),
        (4096, 64)]  # fmt: skip
SUITE = {
    "slo_ttft_p95_ms": 2000.0,
    "slo_tpot_p95_ms": 60.0,
    "duration_per_point_seconds": 5.0,
    "concurrency_start": 1,
    "max_concurrency": 256,
}


def _calibrated_h100(profile: Profile) -> dict[str, float]:
    """The ground-truth constants of the calibration model on its H100s, from its table."""
    from benchmarking.fitting import fit_cost_model
    from capacity.pricing.features import Shape

    with open(DATA / profile.calibration, newline="") as handle:
        rows = list(csv.DictReader(handle))
    fit = fit_cost_model(
        [Shape(input_tokens=int(r["input_len"]), output_tokens=int(r["output_len"])) for r in rows],
        [float(r["requests_per_s"]) for r in rows],
        # The emulator's own terms: it has no per-request overhead.
        candidate_sets=[
            ("input_tokens", "output_tokens", "input_x_output_per_1000", "output_sq_per_1000")
        ],
    )
    w = fit.weights_replica_seconds
    h100 = GPUS["H100-80GB"]
    # FP8 weights (1 byte per parameter), split over the tensor-parallel GPUs.
    weight_bytes_per_gpu = profile.calibration_model.parameters_billions * 1e9
    weight_bytes_per_gpu /= profile.calibration_gpus
    base = weight_bytes_per_gpu / (h100["bandwidth_tb_s"] * 1e12)
    return {
        "prefill_seconds_per_token": w["input_tokens"],
        "decode_step_base_seconds": base,
        "decode_seconds_per_sequence": max(0.0, w["output_tokens"] - base / MAX_NUM_SEQS),
        "decode_seconds_per_context_token": w["input_x_output_per_1000"] / 1000,
        "calibration_cv_mape": fit.cv_mape,
    }


def derive(profile: Profile) -> dict:
    """The emulator config of one profile, with how each constant was reached."""
    h100 = _calibrated_h100(profile)
    gpu = GPUS[profile.gpu]
    ref = GPUS["H100-80GB"]
    # Memory-bound: the same bytes per step (8-bit weights and KV cache) over the bandwidth.
    memory = ref["bandwidth_tb_s"] / gpu["bandwidth_tb_s"]
    # Compute-bound: 8-bit tensor throughput.
    compute = ref["eight_bit_tflops"] / gpu["eight_bit_tflops"]
    size = profile.model.parameters_billions / profile.calibration_model.parameters_billions
    doublings = math.log2(profile.gpus / profile.calibration_gpus)
    tp = (profile.calibration_gpus / profile.gpus) / TP_EFFICIENCY_PER_DOUBLING**doublings
    bytes_per_value = 1
    weights_gb = profile.model.parameters_billions * bytes_per_value
    free_bytes = (profile.gpus * gpu["memory_gb"] * (1 - MEMORY_RESERVE_SHARE) - weights_gb) * 1e9
    kv_tokens = int(free_bytes / profile.model.kv_bytes_per_token(bytes_per_value)) // 1000 * 1000
    model = {
        "name": profile.model.name,
        "replicas": 1,
        "cold_start_seconds": 30,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": 8192,
        "kv_cache_tokens": kv_tokens,
        "context_length": profile.model.context_length,
        "prefill_seconds_per_token": _sig(h100["prefill_seconds_per_token"] * compute * size * tp),
        "decode_step_base_seconds": _sig(h100["decode_step_base_seconds"] * memory * size * tp),
        "decode_seconds_per_sequence": _sig(
            h100["decode_seconds_per_sequence"] * compute * size * tp
        ),
        # The KV cache has the same shape for the calibration model and this one.
        "decode_seconds_per_context_token": _sig(
            h100["decode_seconds_per_context_token"] * memory * tp
        ),
        "mean_output_tokens": 200,
        "vocab_size": profile.model.vocab_size,
    }
    factors = {
        "calibration": profile.calibration,
        "calibration_cv_mape": round(h100["calibration_cv_mape"], 4),
        "h100_constants": {k: _sig(v) for k, v in h100.items() if k != "calibration_cv_mape"},
        "memory_factor": round(memory, 4),
        "compute_factor": round(compute, 4),
        "model_size_factor": round(size, 4),
        "tensor_parallel_factor": round(tp, 4),
        "kv_bytes_per_token": profile.model.kv_bytes_per_token(bytes_per_value),
        "weights_gb": round(weights_gb, 1),
    }
    return {"seed": 0, "models": [model]}, factors


def _sig(value: float) -> float:
    return float(f"{value:.3g}")


def write_profiles() -> None:
    OUT.mkdir(exist_ok=True)
    derivations = {}
    for profile in PROFILES:
        config, factors = derive(profile)
        path = OUT / f"{profile.name}.json"
        path.write_text(json.dumps(config, indent=2) + "\n")
        derivations[profile.name] = factors
        print(f"{path.relative_to(ROOT)}: {json.dumps(config['models'][0])}")
        print(f"  from {json.dumps(factors)}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _measure(base_url: str, model: str) -> tuple[list, float]:
    import httpx

    from benchmarking.runner import SuiteSpec, run_grid
    from core.outbound import HostPolicy

    spec = SuiteSpec(grid=tuple(GRID), **SUITE)
    lag = {"max": 0.0}
    lag_by_shape: dict[tuple[int, int], float] = {}

    async def watch_lag() -> None:
        async with httpx.AsyncClient(trust_env=False) as client:
            while True:
                text = (await client.get(base_url + "/metrics")).text
                for value in re.findall(r"^emulator_step_lag_seconds\{[^}]*\} (\S+)$", text, re.M):
                    lag["max"] = max(lag["max"], float(value))
                await asyncio.sleep(0.5)

    async def on_shape(shape) -> None:
        best = shape.sustainable
        lag_by_shape[(shape.input_len, shape.output_len)] = lag["max"]
        print(
            f"  {shape.input_len}/{shape.output_len}: "
            + (f"{best.requests_per_s:.3f} req/s at {best.concurrency}" if best else "none")
            + f" ({shape.stop_reason}; largest step lag {lag['max'] * 1000:.1f} ms)",
            flush=True,
        )
        lag["max"] = 0.0

    watcher = asyncio.create_task(watch_lag())
    try:
        shapes = await run_grid(
            base_url=base_url,
            model=model,
            spec=spec,
            host_policy=HostPolicy.parse("BENCHMARK_ALLOWED_HOSTS", ["127.0.0.0/8"]),
            on_shape=on_shape,
        )
    finally:
        watcher.cancel()
    return shapes, lag_by_shape


def measure(names: list[str]) -> None:
    import django

    django.setup()
    for profile in PROFILES:
        if not profile.measure or (names and profile.name not in names):
            continue
        config_path = OUT / f"{profile.name}.json"
        port = _free_port()
        print(f"{profile.name}: emulator on port {port}", flush=True)
        emulator = subprocess.Popen(
            [sys.executable, "-m", "dataplane.emulator", "--port", str(port),
             "--config", str(config_path)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            time.sleep(2)
            started = time.monotonic()
            shapes, lags = asyncio.run(_measure(f"http://127.0.0.1:{port}", profile.model.name))
        finally:
            emulator.terminate()
            emulator.wait(timeout=10)
        path = OUT / f"{profile.name}.csv"
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["input_len", "output_len", "requests_per_s", "output_tokens_per_s",
                             "gpus_per_replica", "concurrency", "ttft_p95_ms", "tpot_p95_ms",
                             "step_lag_max_ms"])  # fmt: skip
            for shape in shapes:
                best = shape.sustainable
                if best is None:
                    continue
                writer.writerow([
                    shape.input_len, shape.output_len, f"{best.requests_per_s:.4f}",
                    f"{best.output_tokens_per_s:.1f}", profile.gpus, best.concurrency,
                    f"{best.ttft_p95_ms:.1f}",
                    f"{best.tpot_p95_ms:.2f}" if best.tpot_p95_ms is not None else "",
                    f"{lags[(shape.input_len, shape.output_len)] * 1000:.1f}",
                ])  # fmt: skip
        print(
            f"{path.relative_to(ROOT)}: {len(shapes)} shapes in "
            f"{time.monotonic() - started:.0f} s, largest step lag "
            f"{max(lags.values(), default=0.0) * 1000:.1f} ms",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("profiles", help="derive the emulator profiles")
    run = commands.add_parser("measure", help="benchmark the profiles on the emulator")
    run.add_argument("names", nargs="*", help="profiles to measure (default: all measured)")
    args = parser.parse_args()
    if args.command == "profiles":
        write_profiles()
    else:
        measure(args.names)


if __name__ == "__main__":
    main()
