"""A shape's sweep (concurrency doubled until the SLO breaks or throughput stops growing) and a
grid's run, the runner's entry (`run_grid`)."""

from collections.abc import Awaitable, Callable, Sequence

from benchmarking.runner.client import MIN_STREAMS_PER_PROCESS, Endpoint, make_session
from benchmarking.runner.point import measure_point
from benchmarking.runner.results import PointResult, ShapeResult
from benchmarking.runner.spec import RunnerError, SuiteSpec
from core import outbound


async def sweep_shape(
    endpoint: Endpoint,
    *,
    input_len: int,
    output_len: int,
    spec: SuiteSpec,
    on_point: Callable[[PointResult], Awaitable[None]] | None = None,
    prefix_share: float = 0.0,
    images: int = 0,
) -> ShapeResult:
    """Measure the shape from `concurrency_start`, doubling until the SLO breaks, throughput
    grows less than `min_throughput_growth`, or `max_concurrency` is reached; the sustainable
    point is the best that met the SLO. RunnerError when too many requests failed, or when an
    engine counted none of the requests sent to it."""
    shape = ShapeResult(
        input_len=input_len, output_len=output_len, prefix_share=prefix_share, images=images
    )
    concurrency = spec.concurrency_start
    while True:
        point = await measure_point(
            endpoint,
            input_len=input_len,
            output_len=output_len,
            concurrency=concurrency,
            spec=spec,
            prefix_share=prefix_share,
            images=images,
        )
        shape.points.append(point)
        if on_point is not None:
            await on_point(point)
        if point.engines_measured is not None and point.engines_measured < len(endpoint.urls):
            raise RunnerError(
                f"only {point.engines_measured} of the {len(endpoint.urls)} benchmarked "
                f"replicas' engines counted requests at {input_len}/{output_len}, concurrency "
                f"{concurrency}; by its own metrics (vllm:request_success) no engine served "
                f"the requests sent to {', '.join(point.engines_silent)}: the measurement "
                "would not be per replica"
            )
        if point.error_rate > spec.max_error_rate:
            raise RunnerError(
                f"{point.error_count} of {point.request_count + point.error_count} requests "
                f"failed at {input_len}/{output_len} with concurrency {concurrency} "
                f"(over the {spec.max_error_rate:.0%} limit); first error: {point.first_error}"
            )
        best = shape.sustainable
        if not point.slo_met:
            shape.stop_reason = (
                f"SLO broken at concurrency {concurrency}: p95 TTFT {point.ttft_p95_ms} ms, "
                f"p95 TPOT {point.tpot_p95_ms} ms"
            )
            break
        if best is not None and point.requests_per_s < best.requests_per_s * (
            1 + spec.min_throughput_growth
        ):
            if point.requests_per_s > best.requests_per_s:
                shape.sustainable = point
            shape.stop_reason = f"throughput stopped growing at concurrency {concurrency}"
            break
        shape.sustainable = point
        if concurrency >= spec.max_concurrency:
            shape.stop_reason = f"reached max concurrency {spec.max_concurrency}"
            break
        concurrency = min(concurrency * 2, spec.max_concurrency)
    return shape


async def run_grid(
    *,
    base_url: str | Sequence[str],
    model: str,
    spec: SuiteSpec,
    host_policy: outbound.HostPolicy,
    processes: int = 1,
    on_point: Callable[[PointResult], Awaitable[None]] | None = None,
    on_shape: Callable[[ShapeResult], Awaitable[None]] | None = None,
) -> list[ShapeResult]:
    """`processes`: client processes for points of MIN_STREAMS_PER_PROCESS streams or more
    each (BENCHMARK_CLIENT_PROCESSES); one event loop is the client's limit at hundreds."""
    session = make_session(
        spec.max_concurrency,
        timeout_seconds=spec.request_timeout_seconds,
        host_policy=host_policy,
    )
    endpoint = Endpoint(
        base_url, model, session=session, processes=processes, host_policy=host_policy
    )
    try:
        await endpoint.check()
        if spec.max_concurrency >= 2 * MIN_STREAMS_PER_PROCESS:
            await endpoint.start_processes()
        shapes = []
        for grid_shape in spec.shapes:
            shape = await sweep_shape(
                endpoint,
                input_len=grid_shape.input_len,
                output_len=grid_shape.output_len,
                prefix_share=grid_shape.prefix_share,
                images=grid_shape.images,
                spec=spec,
                on_point=on_point,
            )
            shapes.append(shape)
            if on_shape is not None:
                await on_shape(shape)
        return shapes
    finally:
        await endpoint.close()
