"""The load runner: drives an OpenAI-compatible endpoint with exact request shapes.

For each (input length, output length) of a grid it runs closed-loop load at rising
concurrency until p95 TTFT or p95 TPOT breaks the SLO or throughput stops growing, and
reports the highest throughput that met the SLO. Exact shapes: the prompt is a list of token
ids and `max_tokens` = `min_tokens` = the output length with `ignore_eos`, which vLLM honours;
timings come from the streamed response.

Pure asyncio over the runner's own HTTP client (benchmarking/streams.py); no Django. The
service that stores results calls `run_grid`.

Load goes only where the operator allows (BENCHMARK_ALLOWED_HOSTS): every connection of the
runner's clients is checked by a `core.outbound.HostPolicy` when it is opened, on the
address it is opened to. Connections are pooled, so the check costs nothing per request.

Its rooms, from the bottom: spec.py (what a run asks for), results.py (what it measured),
prompts.py (the exact requests of a shape), client.py (the endpoints and one timed request),
load.py (lanes over a window, in this process or in client processes), point.py (measuring one
point), sweep.py (a shape's sweep and a grid's run). What other packages use is named here.
"""

from benchmarking.runner.client import Endpoint, make_session
from benchmarking.runner.point import measure_point
from benchmarking.runner.prompts import prompt_token_ids
from benchmarking.runner.results import PointResult, RequestResult, ShapeResult, percentile
from benchmarking.runner.spec import GridShape, RunnerError, SuiteSpec
from benchmarking.runner.sweep import run_grid, sweep_shape

__all__ = [
    "Endpoint",
    "GridShape",
    "PointResult",
    "RequestResult",
    "RunnerError",
    "ShapeResult",
    "SuiteSpec",
    "make_session",
    "measure_point",
    "percentile",
    "prompt_token_ids",
    "run_grid",
    "sweep_shape",
]
