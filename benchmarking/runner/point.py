"""Measuring one point: one shape at one concurrency, its throughput over the window, its
latencies in the steady state, whether they met the SLO, and what the engines counted."""

from collections.abc import Sequence

from benchmarking.runner.client import Endpoint
from benchmarking.runner.load import Window, drive_point, idle_lag_ms
from benchmarking.runner.results import PointResult, RequestResult, percentile
from benchmarking.runner.spec import GridShape, SuiteSpec


async def measure_point(
    endpoint: Endpoint,
    *,
    input_len: int,
    output_len: int,
    concurrency: int,
    spec: SuiteSpec,
    prefix_share: float = 0.0,
    images: int = 0,
) -> PointResult:
    """Closed-loop load: `concurrency` workers send back to back.

    The first quarter of the time is a warm-up that fills the batch. Throughput counts each
    successful request by the share of its lifetime that falls inside the measuring window:
    identical requests started together finish together, so counting whole completions in a
    window would jump by a whole cohort at a time, while lifetime shares flow smoothly.
    """
    shape = GridShape(input_len, output_len, prefix_share, images)
    engines_before = await endpoint.engine_stats()
    idle_ms = await idle_lag_ms()
    window = Window.after_warmup(spec.duration_per_point_seconds)
    results, lags_ms = await drive_point(
        endpoint,
        concurrency=concurrency,
        shape=shape,
        timeout_seconds=spec.request_timeout_seconds,
        window=window,
    )
    engines_after = await endpoint.engine_stats()
    seconds = spec.duration_per_point_seconds
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    requests, input_tokens, output_tokens = _counted_in_window(ok, window)
    ttfts, tpots, e2es = _settled_latencies_ms(ok, window)
    ttft_p95 = percentile(ttfts, 0.95)
    tpot_p95 = percentile(tpots, 0.95)
    return PointResult(
        input_len=input_len,
        output_len=output_len,
        concurrency=concurrency,
        requests_per_s=requests / seconds,
        input_tokens_per_s=input_tokens / seconds,
        output_tokens_per_s=output_tokens / seconds,
        ttft_p50_ms=percentile(ttfts, 0.5),
        ttft_p95_ms=ttft_p95,
        tpot_p50_ms=percentile(tpots, 0.5),
        tpot_p95_ms=tpot_p95,
        e2e_p95_ms=percentile(e2es, 0.95),
        e2e_p99_ms=percentile(e2es, 0.99),
        request_count=len(ok),
        error_count=len(errors),
        slo_met=_slo_met(ok, ttft_p95, tpot_p95, spec),
        first_error=errors[0].error if errors else "",
        client_lag_mean_ms=(max(0.0, sum(lags_ms) / len(lags_ms) - idle_ms) if lags_ms else None),
        client_lag_p99_ms=percentile(lags_ms, 0.99),
        prefix_share=prefix_share,
        images=images,
        prompt_tokens_mean=sum(r.prompt_tokens for r in ok) / len(ok) if ok else None,
        **_engine_view(ok, engines_before, engines_after, endpoint.bases),
    )


def _counted_in_window(ok: list[RequestResult], window: Window) -> tuple[float, float, float]:
    """(requests, input tokens, output tokens) inside the window: each request by the share of
    its lifetime that falls inside it."""
    request_share = 0.0
    input_tokens = 0.0
    output_tokens = 0.0
    for r in ok:
        lifetime = max(r.finished_s - r.started_s, 1e-9)
        overlap = min(r.finished_s, window.window_end) - max(r.started_s, window.window_start)
        share = max(0.0, overlap) / lifetime
        request_share += share
        input_tokens += share * r.prompt_tokens
        output_tokens += share * r.completion_tokens
    return request_share, input_tokens, output_tokens


def _settled_latencies_ms(
    ok: list[RequestResult], window: Window
) -> tuple[list[float], list[float], list[float]]:
    """(TTFTs, TPOTs, end-to-end) in ms of the requests that finished inside the window: the
    steady state (all of them, when none did)."""
    settled = [r for r in ok if window.window_start <= r.finished_s <= window.window_end] or ok
    ttfts = [r.ttft_s * 1000 for r in settled if r.ttft_s is not None]
    tpots = [r.tpot_s * 1000 for r in settled if r.tpot_s is not None]
    e2es = [(r.finished_s - r.started_s) * 1000 for r in settled]
    return ttfts, tpots, e2es


def _slo_met(
    ok: list[RequestResult], ttft_p95: float | None, tpot_p95: float | None, spec: SuiteSpec
) -> bool:
    """Some requests succeeded, and their p95 TTFT and TPOT (where any) are within the SLO."""
    return (
        bool(ok)
        and (ttft_p95 or 0) <= spec.slo_ttft_p95_ms
        and (tpot_p95 is None or tpot_p95 <= spec.slo_tpot_p95_ms)
    )


def _engine_view(ok: list[RequestResult], before: list, after: list, bases: Sequence[str]) -> dict:
    """The point's client and engine mean TTFT over the same requests (all the point's), and
    how many engines served them (and which did not); nothing where an engine does not expose
    its metrics."""
    if not ok or any(b is None for b in before) or any(a is None for a in after):
        return {}
    moved = [
        tuple(x - y for x, y in zip(a, b, strict=True)) for b, a in zip(before, after, strict=True)
    ]
    counted = sum(m[2] for m in moved)
    queried = sum(m[3] for m in moved)
    client_ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "client_ttft_mean_ms": 1000 * sum(client_ttfts) / len(client_ttfts)
        if client_ttfts
        else None,
        "engine_ttft_mean_ms": 1000 * sum(m[1] for m in moved) / counted if counted else None,
        "engines_measured": sum(1 for m in moved if m[0] > 0),
        "engines_silent": tuple(base for base, m in zip(bases, moved, strict=True) if not m[0] > 0),
        # Every request of the point was admitted between the two reads: the share is the
        # point's own (None where the engines keep no prefix cache).
        "cache_hit_share": sum(m[4] for m in moved) / queried if queried else None,
    }
