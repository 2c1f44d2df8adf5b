"""Closed-loop load over a point's window: lanes that send back to back, on this event loop or
shared among the client processes (each with its own event loop and connections), and a ticker
whose lateness is the client's own overhead."""

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarking.runner.client import Endpoint, make_session
from benchmarking.runner.results import RequestResult
from benchmarking.runner.spec import GridShape
from core import outbound

try:  # uvloop where installed: its loop costs a client a fraction of asyncio's per event
    import uvloop
except ImportError:  # pragma: no cover - a dependency on Linux
    uvloop = None  # type: ignore[assignment]

# Each client process is told when to start, this long ahead: it is already running (the pool
# is started before the first point), so only the hand-over is paid.
DISPATCH_SECONDS = 0.2
SALTS_PER_SHARE = 1_000_000  # prompts per process and point: far more than a point sends
# The first quarter of a point's time is a warm-up that fills the batch.
WARMUP_SHARE = 0.25
# 50 wake-ups a second: enough to see the loop lag, too few to slow an engine in the same
# process (the tests run the emulator in-process).
LAG_TICK_SECONDS = 0.02


@dataclass(frozen=True)
class Window:
    start: float  # perf_counter (CLOCK_MONOTONIC: one clock for every process of the machine)
    window_start: float
    window_end: float

    @classmethod
    def after_warmup(cls, seconds: float) -> "Window":
        """Load starts DISPATCH_SECONDS from now; after its warm-up, `seconds` are measured."""
        start = time.perf_counter() + DISPATCH_SECONDS
        window_start = start + seconds * WARMUP_SHARE
        return cls(start, window_start, window_start + seconds)


@dataclass(frozen=True)
class _ProcessShare:
    bases: tuple[str, ...]
    model: str
    host_policy: outbound.HostPolicy
    lanes: tuple[int, ...]
    salt_from: int
    shape: GridShape
    timeout_seconds: float
    window: Window


async def drive_point(
    endpoint: Endpoint,
    *,
    concurrency: int,
    shape: GridShape,
    timeout_seconds: float,
    window: Window,
) -> tuple[list[RequestResult], list[float]]:
    """`concurrency` lanes over the window: every request's result, and the lag ticks."""
    shares = endpoint.lane_shares(concurrency)
    if len(shares) == 1:
        return await _drive(
            endpoint, lanes=shares[0], shape=shape, timeout_seconds=timeout_seconds, window=window
        )
    host_policy = endpoint.host_policy
    assert host_policy is not None  # an Endpoint takes client processes only with one
    loop = asyncio.get_running_loop()
    answers = await asyncio.gather(
        *(
            loop.run_in_executor(
                endpoint.pool(),
                _drive_in_process,
                _ProcessShare(
                    bases=tuple(endpoint.bases),
                    model=endpoint.model,
                    host_policy=host_policy,
                    lanes=lanes,
                    salt_from=endpoint.reserve_salts(SALTS_PER_SHARE),
                    shape=shape,
                    timeout_seconds=timeout_seconds,
                    window=window,
                ),
            )
            for lanes in shares
        )
    )
    results = [result for share_results, _ in answers for result in share_results]
    lags_ms = [lag for _, share_lags in answers for lag in share_lags]
    return results, lags_ms


async def _drive(
    endpoint: Endpoint,
    *,
    lanes: Sequence[int],
    shape: GridShape,
    timeout_seconds: float,
    window: Window,
) -> tuple[list[RequestResult], list[float]]:
    """This event loop's lanes, back to back until the window ends; the loop's lag ticks."""
    results: list[RequestResult] = []
    lags_ms: list[float] = []
    await asyncio.sleep(max(0.0, window.start - time.perf_counter()))

    async def worker(lane: int) -> None:
        while time.perf_counter() < window.window_end:
            results.append(
                await endpoint.complete(
                    input_len=shape.input_len,
                    output_len=shape.output_len,
                    prefix_share=shape.prefix_share,
                    images=shape.images,
                    timeout_seconds=timeout_seconds,
                    lane=lane,
                )
            )

    async def ticker() -> None:
        # Inside the measuring window only: the warm-up's connection set-up is not the
        # steady state the TTFTs are read from.
        while time.perf_counter() < window.window_end:
            due = time.perf_counter() + LAG_TICK_SECONDS
            await asyncio.sleep(LAG_TICK_SECONDS)
            if due >= window.window_start:
                lags_ms.append(max(0.0, time.perf_counter() - due) * 1000)

    await asyncio.gather(ticker(), *(worker(lane) for lane in lanes))
    return results, lags_ms


def _drive_in_process(share: _ProcessShare) -> tuple[list[RequestResult], list[float]]:
    """One client process's share of a point: its own event loop and connections."""

    async def drive() -> tuple[list[RequestResult], list[float]]:
        session = make_session(
            len(share.lanes), timeout_seconds=share.timeout_seconds, host_policy=share.host_policy
        )
        try:
            endpoint = Endpoint(list(share.bases), share.model, session=session)
            endpoint.skip_salts(share.salt_from)
            return await _drive(
                endpoint,
                lanes=share.lanes,
                shape=share.shape,
                timeout_seconds=share.timeout_seconds,
                window=share.window,
            )
        finally:
            await session.close()

    if uvloop is None:  # pragma: no cover - a dependency on Linux
        return asyncio.run(drive())
    return uvloop.run(drive())


async def idle_lag_ms(ticks: int = 5) -> float:
    """The ticker's own lateness with nothing else to run (the timer's granularity): what the
    load adds on top of it is the client's overhead."""
    lags = []
    for _ in range(ticks):
        due = time.perf_counter() + LAG_TICK_SECONDS
        await asyncio.sleep(LAG_TICK_SECONDS)
        lags.append(max(0.0, time.perf_counter() - due) * 1000)
    return sum(lags) / len(lags)
