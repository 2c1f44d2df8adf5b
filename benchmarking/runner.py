"""The load runner: drives an OpenAI-compatible endpoint with exact request shapes.

For each (input length, output length) of a grid it runs closed-loop load at rising
concurrency until p95 TTFT or p95 TPOT breaks the SLO or throughput stops growing, and
reports the highest throughput that met the SLO. Exact shapes: the prompt is a list of token
ids and `max_tokens` = `min_tokens` = the output length with `ignore_eos`, which vLLM honours;
timings come from the streamed response.

Pure asyncio over the runner's own HTTP client (streams.py); no Django. The service that
stores results calls `run_grid`.

Load goes only where the operator allows (BENCHMARK_ALLOWED_HOSTS): every connection of the
runner's clients is checked by a `core.outbound.HostPolicy` when it is opened, on the
address it is opened to. Connections are pooled, so the check costs nothing per request.
"""

import asyncio
import base64
import json
import math
import multiprocessing
import os
import struct
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from benchmarking.streams import ClientError, StreamClient
from core import outbound


class RunnerError(Exception):
    """The run cannot go on (unreachable endpoint, too many errors): a clear reason."""


@dataclass(frozen=True)
class GridShape:
    """One shape of a suite: `input_len` text tokens (images' tokens come on top, as the
    engine counts them), `output_len` tokens decoded, the share of the prompt every request of
    the shape shares (a prefix the engine's prefix cache can serve), and images per request.
    The rest of every prompt, and every image, is distinct per request."""

    input_len: int
    output_len: int
    prefix_share: float = 0.0
    images: int = 0

    @classmethod
    def of(cls, shape: "GridShape | Sequence[int]") -> "GridShape":
        if isinstance(shape, GridShape):
            return shape
        input_len, output_len = shape
        return cls(int(input_len), int(output_len))

    @property
    def shared_tokens(self) -> int:
        return round(self.prefix_share * self.input_len)

    def describe(self) -> str:
        text = f"{self.input_len}/{self.output_len}"
        if self.prefix_share:
            text += f" ({self.prefix_share:.0%} shared)"
        if self.images:
            text += f" + {self.images} image{'s' if self.images > 1 else ''}"
        return text


@dataclass(frozen=True)
class SuiteSpec:
    grid: tuple["GridShape | tuple[int, int]", ...]
    slo_ttft_p95_ms: float
    slo_tpot_p95_ms: float
    duration_per_point_seconds: float = 20.0
    concurrency_start: int = 1
    max_concurrency: int = 256
    min_throughput_growth: float = 0.05
    max_error_rate: float = 0.05
    request_timeout_seconds: float = 120.0

    @property
    def shapes(self) -> tuple[GridShape, ...]:
        return tuple(GridShape.of(shape) for shape in self.grid)


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


def prompt_token_ids(input_len: int, salt: int) -> list[int]:
    # Distinct ids per request, so an engine's prefix cache cannot make later requests cheaper.
    return [100 + (salt * 7919 + index * 104729) % 30000 for index in range(input_len)]


def shared_prefix_token_ids(shape: GridShape) -> list[int]:
    """The prefix every request of the shape starts with: the same for all of them, and in a
    range of ids the salted parts never use, so it is cached only where the shape means it."""
    key = shape.input_len * 31 + shape.output_len * 7 + shape.images
    return [30100 + (key * 104729 + index * 7919) % 30000 for index in range(shape.shared_tokens)]


def shape_prompt_ids(shape: GridShape, salt: int) -> list[int]:
    """A prompt of the shape: its shared prefix, then ids salted per request."""
    shared = shared_prefix_token_ids(shape)
    return shared + prompt_token_ids(shape.input_len - len(shared), salt)


def png_data_url(salt: int) -> str:
    """A 1×1 PNG whose colour comes from the salt (so images differ between requests), as a
    data: URL, the form OpenAI's and vLLM's image_url parts take inline."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    colour = (salt % (1 << 24)).to_bytes(3, "big")
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00" + colour))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_messages(shape: GridShape, salt: int) -> list[dict]:
    """A chat request of the shape: the shared prefix as text, the images, then the salted
    text. Words are the tokens of text prompts; the engine's own count is what is recorded."""
    ids = shape_prompt_ids(shape, salt)
    shared = shape.shared_tokens
    content: list[dict] = []
    if shared:
        content.append({"type": "text", "text": " ".join(f"w{i}" for i in ids[:shared])})
    content.extend(
        {"type": "image_url", "image_url": {"url": png_data_url(salt * 8 + index)}}
        for index in range(shape.images)
    )
    if len(ids) > shared:
        content.append({"type": "text", "text": " ".join(f"w{i}" for i in ids[shared:])})
    return [{"role": "user", "content": content}]


def _has_text(choice: dict) -> bool:
    """A completion chunk's text, or a chat chunk's delta content."""
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


# 50 wake-ups a second: enough to see the loop lag, too few to slow an engine in the same
# process (the tests run the emulator in-process).
LAG_TICK_SECONDS = 0.02


def make_session(
    concurrency: int, *, timeout_seconds: float, host_policy: outbound.HostPolicy
) -> StreamClient:
    """One client for every stream, whose connections `host_policy` vets (no redirects, no
    proxies). Our own (streams.py) rather than aiohttp or httpx: at 512 streams their
    per-chunk and per-request work made the client, not the engine, the limit (make bench,
    runner figures). `timeout_seconds` is each request's own."""
    del timeout_seconds  # every exchange is given its own
    return StreamClient(host_policy, connections=concurrency + 2)


class _StreamReading:
    """A streamed answer's SSE read as its pieces arrive (in the socket's callback): when its
    first token came, how many chunks carried text, and the engine's usage."""

    __slots__ = ("pending", "first_token_at", "finished_at", "chunks_with_text", "usage", "done")

    def __init__(self) -> None:
        self.pending = b""
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.chunks_with_text = 0
        self.usage: dict | None = None
        self.done = False

    def feed(self, data: bytes) -> None:
        if self.done:
            return
        # Whatever has arrived is split into lines at once: at hundreds of streams the
        # client's per-line work is what shows.
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                self.finished_at = time.perf_counter()
                return
            # Decoding every chunk would make the client, not the engine, the limit at high
            # concurrency: only the first token's chunk and the usage chunk are parsed. A
            # quoted "prompt_tokens" key appears only in a usage object (inside generated
            # text the quotes are escaped).
            if b'"prompt_tokens"' in payload:
                chunk = json.loads(payload)
                self.usage = chunk.get("usage") or self.usage
                if not any(_has_text(c) for c in chunk.get("choices") or []):
                    continue
            elif self.first_token_at is not None:
                self.chunks_with_text += 1
                continue
            else:
                chunk = json.loads(payload)
            if any(_has_text(choice) for choice in chunk.get("choices") or []):
                self.chunks_with_text += 1
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()


class Endpoint:
    """OpenAI-compatible completions endpoints (one, or each replica a run holds), reached
    through one session; lanes are spread over the endpoints."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str,
        *,
        session: StreamClient,
        processes: int = 1,
        host_policy: outbound.HostPolicy | None = None,
    ) -> None:
        bases = [base_url] if isinstance(base_url, str) else list(base_url)
        if not bases:
            raise ValueError("an Endpoint needs at least one base URL")
        if processes > 1 and host_policy is None:
            raise ValueError("client processes open their own connections: give the host_policy")
        self.bases = [base.rstrip("/") for base in bases]
        self.urls = [base + "/v1/completions" for base in self.bases]
        # Shapes with images go through chat, the API that carries them.
        self.chat_urls = [base + "/v1/chat/completions" for base in self.bases]
        self.url = self.urls[0]
        self.model = model
        self.session = session
        self.processes = max(1, processes)
        self.host_policy = host_policy
        self._pool: ProcessPoolExecutor | None = None
        self._salt = 0

    def lane_shares(self, concurrency: int) -> list[tuple[int, ...]]:
        """The lanes each event loop drives: this one alone at low concurrency; else spread
        over the client processes, every endpoint's lanes in each (lane i goes to endpoint
        i mod n whichever process drives it)."""
        count = min(self.processes, concurrency // MIN_STREAMS_PER_PROCESS) or 1
        return [tuple(range(index, concurrency, count)) for index in range(count)]

    def pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            raise RuntimeError("start_processes() first")
        return self._pool

    async def start_processes(self) -> None:
        """Start the client processes before any point, so no window pays their start-up.
        spawn, not fork: the caller may be a threaded Celery worker."""
        if self.processes <= 1 or self._pool is not None:
            return
        self._pool = ProcessPoolExecutor(
            max_workers=self.processes, mp_context=multiprocessing.get_context("spawn")
        )
        loop = asyncio.get_running_loop()
        await asyncio.gather(
            *(loop.run_in_executor(self._pool, _warm, i) for i in range(self.processes))
        )

    async def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        await self.session.close()

    def reserve_salts(self, count: int) -> int:
        """The first of `count` prompt salts for lanes driven by another process, so that its
        prompts differ from this endpoint's and the other processes'."""
        first = self._salt + 1
        self._salt += count
        return first

    def skip_salts(self, salt: int) -> None:
        self._salt = salt

    async def check(self) -> None:
        """Fail fast, with the reason, when an endpoint cannot serve the model at all."""
        for lane, url in enumerate(self.urls):
            result = await self.complete(input_len=4, output_len=2, timeout_seconds=30.0, lane=lane)
            if not result.ok:
                raise RunnerError(f"The endpoint {url} cannot serve '{self.model}': {result.error}")

    async def engine_stats(self) -> list[tuple[float, ...] | None]:
        """Per endpoint, from its engine's own /metrics: (requests finished, TTFT seconds
        summed, TTFTs counted, prefix-cache queried tokens, prefix-cache hit tokens); None
        where the engine does not say."""
        return [await self._engine_stats(base) for base in self.bases]

    async def _engine_stats(self, base: str) -> tuple[float, ...] | None:
        try:
            answer = await self.session.get(base + "/metrics", timeout_seconds=5)
            if answer.status != 200:
                return None
            text = answer.body.decode("utf-8", errors="replace")
            finished = ttft_sum = ttft_count = queries = hits = 0.0
            for family in text_string_to_metric_families(text):
                if family.name == "vllm:request_success":
                    finished = sum(s.value for s in family.samples if s.name.endswith("_total"))
                elif family.name == "vllm:prefix_cache_queries":
                    queries = sum(s.value for s in family.samples if s.name.endswith("_total"))
                elif family.name == "vllm:prefix_cache_hits":
                    hits = sum(s.value for s in family.samples if s.name.endswith("_total"))
                elif family.name == "vllm:time_to_first_token_seconds":
                    for sample in family.samples:
                        if sample.name.endswith("_sum"):
                            ttft_sum += sample.value
                        elif sample.name.endswith("_count"):
                            ttft_count += sample.value
            return finished, ttft_sum, ttft_count, queries, hits
        except (ClientError, ValueError):
            return None

    async def complete(
        self,
        *,
        input_len: int,
        output_len: int,
        timeout_seconds: float,
        lane: int = 0,
        prefix_share: float = 0.0,
        images: int = 0,
    ) -> RequestResult:
        self._salt += 1
        shape = GridShape(input_len, output_len, prefix_share, images)
        body: dict = {
            "model": self.model,
            "max_tokens": output_len,
            "min_tokens": output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if images:
            body["messages"] = chat_messages(shape, self._salt)
            url = self.chat_urls[lane % len(self.chat_urls)]
        else:
            body["prompt"] = shape_prompt_ids(shape, self._salt)
            url = self.urls[lane % len(self.urls)]
        reading = _StreamReading()
        payload = json.dumps(body, separators=(",", ":")).encode()
        started = time.perf_counter()
        try:
            answer = await self.session.post(
                url,
                payload,
                timeout_seconds=timeout_seconds,
                on_data=reading.feed,
            )
        except (ClientError, json.JSONDecodeError) as error:
            return RequestResult(
                ok=False,
                started_s=started,
                finished_s=time.perf_counter(),
                error=f"{type(error).__name__}: {error}"[:300],
            )
        if answer.status != 200:
            detail = answer.body[:200].decode(errors="replace")
            return RequestResult(
                ok=False,
                started_s=started,
                finished_s=time.perf_counter(),
                error=f"HTTP {answer.status}: {detail}",
            )
        first_token_at = reading.first_token_at
        chunks_with_text = reading.chunks_with_text
        usage = reading.usage
        # The stream's end as the socket's callback saw it, not when this coroutine woke.
        finished = reading.finished_at or time.perf_counter()
        completion_tokens = int(usage["completion_tokens"]) if usage else chunks_with_text
        prompt_tokens = int(usage["prompt_tokens"]) if usage else input_len
        details = (usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if first_token_at is None:
            return RequestResult(
                ok=False, started_s=started, finished_s=finished, error="no tokens streamed"
            )
        ttft = first_token_at - started
        tpot = (
            (finished - first_token_at) / (completion_tokens - 1) if completion_tokens > 1 else None
        )
        return RequestResult(
            ok=True,
            started_s=started,
            finished_s=finished,
            ttft_s=ttft,
            tpot_s=tpot,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached if isinstance(cached, int) else None,
        )


# Each client process is told when to start, this long ahead: it is already running (the pool
# is started before the first point), so only the hand-over is paid.
DISPATCH_SECONDS = 0.2
# Below this many streams per process a second process costs more than it saves.
MIN_STREAMS_PER_PROCESS = 64
SALTS_PER_SHARE = 1_000_000  # prompts per process and point: far more than a point sends


@dataclass(frozen=True)
class _Window:
    start: float  # perf_counter (CLOCK_MONOTONIC: one clock for every process of the machine)
    window_start: float
    window_end: float


@dataclass(frozen=True)
class _ProcessShare:
    bases: tuple[str, ...]
    model: str
    host_policy: outbound.HostPolicy
    lanes: tuple[int, ...]
    salt_from: int
    shape: GridShape
    timeout_seconds: float
    window: _Window


async def _drive(
    endpoint: Endpoint,
    *,
    lanes: Sequence[int],
    shape: GridShape,
    timeout_seconds: float,
    window: _Window,
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

    return _event_loop_run(drive())


def _event_loop_run(coroutine):
    try:  # uvloop where installed: its loop costs a client a fraction of asyncio's per event
        import uvloop
    except ImportError:  # pragma: no cover - a dependency on Linux
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _warm(_: int) -> int:
    time.sleep(0.2)  # long enough that each of the pool's processes takes one
    return os.getpid()


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
    warmup_seconds = spec.duration_per_point_seconds * 0.25
    engines_before = await endpoint.engine_stats()
    # The ticker's own lateness with nothing else to run (the timer's granularity): what the
    # load adds on top of it is the client's overhead.
    idle_lag_ms = await _idle_lag_ms()
    start = time.perf_counter() + DISPATCH_SECONDS
    window_start = start + warmup_seconds
    window_end = window_start + spec.duration_per_point_seconds
    window = _Window(start, window_start, window_end)
    shares = endpoint.lane_shares(concurrency)
    if len(shares) == 1:
        results, lags_ms = await _drive(
            endpoint,
            lanes=shares[0],
            shape=shape,
            timeout_seconds=spec.request_timeout_seconds,
            window=window,
        )
    else:
        loop = asyncio.get_running_loop()
        answers = await asyncio.gather(
            *(
                loop.run_in_executor(
                    endpoint.pool(),
                    _drive_in_process,
                    _ProcessShare(
                        bases=tuple(endpoint.bases),
                        model=endpoint.model,
                        host_policy=endpoint.host_policy,
                        lanes=lanes,
                        salt_from=endpoint.reserve_salts(SALTS_PER_SHARE),
                        shape=shape,
                        timeout_seconds=spec.request_timeout_seconds,
                        window=window,
                    ),
                )
                for index, lanes in enumerate(shares)
            )
        )
        results = [result for share_results, _ in answers for result in share_results]
        lags_ms = [lag for _, share_lags in answers for lag in share_lags]
    engines_after = await endpoint.engine_stats()
    seconds = spec.duration_per_point_seconds
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    request_share = 0.0
    input_tokens = 0.0
    output_tokens = 0.0
    for r in ok:
        lifetime = max(r.finished_s - r.started_s, 1e-9)
        overlap = min(r.finished_s, window_end) - max(r.started_s, window_start)
        share = max(0.0, overlap) / lifetime
        request_share += share
        input_tokens += share * r.prompt_tokens
        output_tokens += share * r.completion_tokens
    # Latencies of the requests that finished inside the window: the steady state.
    settled = [r for r in ok if window_start <= r.finished_s <= window_end] or ok
    ttfts = [r.ttft_s * 1000 for r in settled if r.ttft_s is not None]
    tpots = [r.tpot_s * 1000 for r in settled if r.tpot_s is not None]
    e2es = [(r.finished_s - r.started_s) * 1000 for r in settled]
    ttft_p95 = percentile(ttfts, 0.95)
    tpot_p95 = percentile(tpots, 0.95)
    slo_met = (
        bool(ok)
        and (ttft_p95 or 0) <= spec.slo_ttft_p95_ms
        and (tpot_p95 is None or tpot_p95 <= spec.slo_tpot_p95_ms)
    )
    return PointResult(
        input_len=input_len,
        output_len=output_len,
        concurrency=concurrency,
        requests_per_s=request_share / seconds,
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
        slo_met=slo_met,
        first_error=errors[0].error if errors else "",
        client_lag_mean_ms=(
            max(0.0, sum(lags_ms) / len(lags_ms) - idle_lag_ms) if lags_ms else None
        ),
        client_lag_p99_ms=percentile(lags_ms, 0.99),
        prefix_share=prefix_share,
        images=images,
        prompt_tokens_mean=sum(r.prompt_tokens for r in ok) / len(ok) if ok else None,
        **_engine_view(ok, engines_before, engines_after, endpoint.bases),
    )


async def _idle_lag_ms(ticks: int = 5) -> float:
    lags = []
    for _ in range(ticks):
        due = time.perf_counter() + LAG_TICK_SECONDS
        await asyncio.sleep(LAG_TICK_SECONDS)
        lags.append(max(0.0, time.perf_counter() - due) * 1000)
    return sum(lags) / len(lags)


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
