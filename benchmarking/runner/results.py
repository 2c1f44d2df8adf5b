"""What the runner measured: a request, a point (one shape at one concurrency), a shape's
sweep; and the one percentile rule of the project (nearest rank)."""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    started_s: float
    finished_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    # What the engine's usage said its prefix cache served (engines started with vLLM's
    # --enable-prompt-tokens-details), else None.
    cached_tokens: int | None = None


@dataclass(frozen=True)
class PointResult:
    input_len: int
    output_len: int
    concurrency: int
    requests_per_s: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    e2e_p95_ms: float | None
    request_count: int
    error_count: int
    slo_met: bool
    first_error: str = ""
    e2e_p99_ms: float | None = None
    # Mean TTFT as the client saw it, and as the engines measured it over the same point (their
    # vllm:time_to_first_token_seconds histogram, from the request's arrival in the engine:
    # it leaves out the server's HTTP handling as well as the client's).
    client_ttft_mean_ms: float | None = None
    engine_ttft_mean_ms: float | None = None
    # The client's own overhead: how late its event loop ran what was due (a 20 ms ticker's
    # lateness), which every response waits behind before its time is read.
    client_lag_mean_ms: float | None = None
    client_lag_p99_ms: float | None = None
    # How many of the endpoints' engines counted requests during the point, and the base
    # URLs of those whose own counter (vllm:request_success) did not move.
    engines_measured: int | None = None
    engines_silent: tuple[str, ...] = ()
    # The shape's prefix share and images per request (GridShape), the mean prompt tokens
    # the engines counted, and the share of them their prefix caches served over the point
    # (vllm:prefix_cache_hits / vllm:prefix_cache_queries, read before and after it).
    prefix_share: float = 0.0
    images: int = 0
    prompt_tokens_mean: float | None = None
    cache_hit_share: float | None = None

    @property
    def measured_input_tokens(self) -> int:
        """Prompt tokens per request as the engines counted them (images' tokens included),
        else the shape's."""
        if self.prompt_tokens_mean is None:
            return self.input_len
        return round(self.prompt_tokens_mean)

    @property
    def cached_input_tokens(self) -> int:
        """Prompt tokens per request the prefix cache served: the achieved hit share, read back
        from the engines' own counters, of the prompt."""
        if not self.cache_hit_share:
            return 0
        return round(self.cache_hit_share * self.measured_input_tokens)

    @property
    def client_overhead_share(self) -> float | None:
        """What the client's lag adds to the TTFT it measured, as a share of the rest."""
        if self.client_lag_mean_ms is None or self.client_ttft_mean_ms is None:
            return None
        served = self.client_ttft_mean_ms - self.client_lag_mean_ms
        return self.client_lag_mean_ms / served if served > 0 else None

    @property
    def error_rate(self) -> float:
        total = self.request_count + self.error_count
        return self.error_count / total if total else 0.0


@dataclass
class ShapeResult:
    input_len: int
    output_len: int
    points: list[PointResult] = field(default_factory=list)
    prefix_share: float = 0.0
    images: int = 0
    sustainable: PointResult | None = None
    stop_reason: str = ""


def percentile(values: Sequence[float], share: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]
