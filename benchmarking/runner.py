"""The load runner: drives an OpenAI-compatible endpoint with exact request shapes.

For each (input length, output length) of a grid it runs closed-loop load at rising
concurrency until p95 TTFT or p95 TPOT breaks the SLO or throughput stops growing, and
reports the highest throughput that met the SLO. Exact shapes: the prompt is a list of token
ids and `max_tokens` = `min_tokens` = the output length with `ignore_eos`, which vLLM honours;
timings come from the streamed response.

A suite's feature shapes also exercise the prefix cache and image inputs, so that the cost
model's cached-input and image weights can be measured (`ShapeSpec`): every request of a shape
with a cache-hit share starts with the same prefix of that share of its input (the rest salted,
so only the prefix can hit), and a shape with images is sent as a chat completion with that
many distinct inline images. What the engine did is read back, never assumed: the prompt
tokens from usage (image placeholders and the chat template included), and the cache hits from
usage's `prompt_tokens_details.cached_tokens` (vLLM with `--enable-prompt-tokens-details`) or
else from the delta of vLLM's prefix-cache counters on the endpoint's /metrics over the point.

Pure asyncio + httpx; no Django. The service that stores results calls `run_grid`.

Load goes only where the operator allows (BENCHMARK_ALLOWED_HOSTS): every connection of the
runner's clients is checked by a `controlplane.outbound.HostPolicy` when it is opened, on the
address it is opened to. Connections are pooled, so the check costs nothing per request.
"""

import asyncio
import base64
import functools
import json
import math
import ssl
import struct
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from controlplane import outbound


class RunnerError(Exception):
    """The run cannot go on (unreachable endpoint, too many errors): a clear reason."""


@dataclass(frozen=True)
class ShapeSpec:
    """One request shape: its lengths, and what of it the prefix cache and images make up.

    `input_len` is the prompt's text (or token-id) length; an engine adds each image's
    placeholder tokens (and, for chat, its template) to the prompt tokens it reports.
    """

    input_len: int
    output_len: int
    # Share of the input that is a prefix shared by every request of the shape, in [0, 1).
    cache_hit_share: float = 0.0
    images: int = 0  # images per request

    @property
    def shared_prefix_len(self) -> int:
        return round(self.cache_hit_share * self.input_len)

    @property
    def has_features(self) -> bool:
        return self.cache_hit_share > 0 or self.images > 0

    def describe(self) -> str:
        text = f"{self.input_len}/{self.output_len}"
        if self.cache_hit_share:
            text += f" ({self.cache_hit_share:.0%} shared prefix)"
        if self.images:
            text += f" (+{self.images} image{'s' if self.images > 1 else ''})"
        return text


@dataclass(frozen=True)
class SuiteSpec:
    grid: tuple[tuple[int, int], ...]
    slo_ttft_p95_ms: float
    slo_tpot_p95_ms: float
    duration_per_point_seconds: float = 20.0
    concurrency_start: int = 1
    max_concurrency: int = 256
    min_throughput_growth: float = 0.05
    max_error_rate: float = 0.05
    request_timeout_seconds: float = 120.0
    # Measured after the grid: shapes with a shared prefix or images.
    feature_shapes: tuple[ShapeSpec, ...] = ()

    def shapes(self) -> tuple[ShapeSpec, ...]:
        return tuple(ShapeSpec(i, o) for i, o in self.grid) + self.feature_shapes


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
    # usage.prompt_tokens_details.cached_tokens; None when the engine did not report it.
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
    # Mean TTFT as the client saw it, and as the engines measured it over the same point (their
    # vllm:time_to_first_token_seconds histogram, from the request's arrival in the engine:
    # it leaves out the server's HTTP handling as well as the client's).
    client_ttft_mean_ms: float | None = None
    engine_ttft_mean_ms: float | None = None
    # The client's own overhead: how late its event loop ran what was due (a 5 ms ticker's
    # lateness), which every response waits behind before its time is read.
    client_lag_mean_ms: float | None = None
    client_lag_p99_ms: float | None = None
    # How many of the endpoints' engines counted requests during the point.
    engines_measured: int | None = None

    cache_hit_share: float = 0.0
    images: int = 0
    # Prompt tokens served from the prefix cache, counted like input_tokens_per_s, and where
    # the count comes from: "usage", "metrics" (the counters' delta), or "" when not measured.
    cached_input_tokens_per_s: float = 0.0
    cache_hits_from: str = ""

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
    sustainable: PointResult | None = None
    stop_reason: str = ""
    cache_hit_share: float = 0.0
    images: int = 0


def percentile(values: Sequence[float], share: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


# Token ids stay in [100, 30100): below every vocabulary the runner meets (32,000 and up).
_TOKEN_ID_BASE = 100
_TOKEN_ID_SPAN = 30000


def prompt_token_ids(input_len: int, salt: int) -> list[int]:
    """Distinct ids per request, so an engine's prefix cache cannot make later requests cheaper.

    The second id carries the salt's high part: without it the ids would repeat every 30,000
    requests, within reach of a prefix cache on a long point.
    """
    ids = [
        _TOKEN_ID_BASE + (salt * 7919 + index * 104729) % _TOKEN_ID_SPAN
        for index in range(input_len)
    ]
    if input_len > 1:
        ids[1] = _TOKEN_ID_BASE + (salt // _TOKEN_ID_SPAN) % _TOKEN_ID_SPAN
    return ids


@functools.lru_cache(maxsize=64)
def shared_prefix_token_ids(length: int, seed: int) -> tuple[int, ...]:
    """The prefix every request of one shape shares; another stride than the salted ids', so
    no run of them can equal a salted run. Kept per shape: building thousands of ids for every
    request is client time the closed loop would count against the engine."""
    return tuple(
        _TOKEN_ID_BASE + (seed * 48271 + index * 104723) % _TOKEN_ID_SPAN for index in range(length)
    )


def _shape_seed(shape: ShapeSpec) -> int:
    # One prefix per shape, so one shape's requests do not hit another shape's prefix.
    return shape.input_len * 1_000_003 + shape.output_len * 1009 + shape.images * 7 + 1


def prompt_words(token_ids: Sequence[int]) -> str:
    """Chat text standing for token ids: one word per id, which the engine emulator reads as
    one token each (a real tokenizer's count is read back from usage)."""
    return " ".join(f"w{token_id}" for token_id in token_ids)


# Each image is a small PNG with pixels drawn from the request's salt, so no two requests
# share an image (vLLM caches encoder outputs and processed inputs by content hash). An
# engine's placeholder count for it is its own (fixed per image, or by size), read back.
IMAGE_SIDE_PX = 32


def _noise_scanlines(side_px: int) -> bytes:
    """RGB scanlines of a fixed pattern, each led by its filter byte (0: none)."""
    rows = bytearray()
    for y in range(side_px):
        rows.append(0)
        for x in range(side_px):
            rows += ((y * 40503 + x * 9973) * 2654435761 & 0xFFFFFF).to_bytes(3, "big")
    return bytes(rows)


_IMAGE_SCANLINES = _noise_scanlines(IMAGE_SIDE_PX)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


_PNG_HEAD = b"\x89PNG\r\n\x1a\n" + _png_chunk(
    b"IHDR", struct.pack(">IIBBBBB", IMAGE_SIDE_PX, IMAGE_SIDE_PX, 8, 2, 0, 0, 0)
)
_PNG_TAIL = _png_chunk(b"IEND", b"")


def image_png(salt: int, index: int) -> bytes:
    """A valid IMAGE_SIDE_PX² RGB PNG, different for every (salt, index): the first pixels of
    a fixed pattern carry them (tens of microseconds, not a per-pixel loop per request)."""
    stamp = struct.pack(">QH", salt & 0xFFFFFFFFFFFFFFFF, index & 0xFFFF)
    pixels = _IMAGE_SCANLINES[:1] + stamp + _IMAGE_SCANLINES[1 + len(stamp) :]
    return _PNG_HEAD + _png_chunk(b"IDAT", zlib.compress(pixels, 1)) + _PNG_TAIL


def image_part(salt: int, index: int) -> dict:
    """An OpenAI chat content part with the image inline: vLLM takes base64 data: URLs
    without fetching anything."""
    data = base64.b64encode(image_png(salt, index)).decode("ascii")
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def _has_text(choice: dict) -> bool:
    # A completion chunk carries "text"; a chat chunk a "delta" with "content".
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


# vLLM V1's prefix-cache counters, in tokens (vllm/v1/metrics/loggers.py), and the names
# vLLM 0.7–0.9 exposed them under; V0 had only a hit-rate gauge, which is not a count.
PREFIX_CACHE_COUNTERS = (
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
    ("vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"),
)


def prefix_cache_counters(metrics_text: str, model: str) -> tuple[float, float] | None:
    """(queried tokens, hit tokens) summed over the model's series (every engine of the
    process), or None when the text has no prefix-cache counters."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.labels.get("model_name", model) == model:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    for queries, hits in PREFIX_CACHE_COUNTERS:
        if queries in totals and hits in totals:
            return totals[queries], totals[hits]
    return None


LAG_TICK_SECONDS = 0.005

# httpx's connection pool scans all its connections for every request, so one client with
# hundreds of streams spends its time in the pool rather than on the wire: workers are spread
# over clients of this many connections each.
STREAMS_PER_CLIENT = 32


def client_count(concurrency: int) -> int:
    return max(1, math.ceil(concurrency / STREAMS_PER_CLIENT))


def make_clients(
    concurrency: int, *, timeout_seconds: float, host_policy: outbound.HostPolicy
) -> list[httpx.AsyncClient]:
    """Clients whose connections `host_policy` vets; no redirects, no proxies."""
    limits = httpx.Limits(
        max_connections=STREAMS_PER_CLIENT + 2, max_keepalive_connections=STREAMS_PER_CLIENT
    )
    tls = ssl.create_default_context()  # loading CA certificates once, not per client
    # A plain AsyncClient over the guarded transport: the runner never asks for redirects,
    # and the guard lives where connections open, not on the per-request path.
    return [
        httpx.AsyncClient(
            transport=outbound.AsyncGuardedTransport(host_policy, limits=limits, verify=tls),
            timeout=timeout_seconds,
            follow_redirects=False,
            trust_env=False,
        )
        for _ in range(client_count(concurrency))
    ]


class Endpoint:
    """OpenAI-compatible completions endpoints (one, or each replica a run holds), reached
    through a set of clients; lanes are spread over the endpoints."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        model: str,
        *,
        client: httpx.AsyncClient | None = None,
        clients: Sequence[httpx.AsyncClient] = (),
    ) -> None:
        bases = [base_url] if isinstance(base_url, str) else list(base_url)
        if not bases:
            raise ValueError("an Endpoint needs at least one base URL")
        self.bases = [base.rstrip("/") for base in bases]
        self.urls = [base + "/v1/completions" for base in self.bases]
        self.url = self.urls[0]
        self.chat_urls = [base + "/v1/chat/completions" for base in self.bases]
        self.model = model
        self.clients = list(clients) or ([client] if client is not None else [])
        if not self.clients:
            raise ValueError("an Endpoint needs at least one httpx client")
        self._salt = 0

    async def check(self) -> None:
        """Fail fast, with the reason, when an endpoint cannot serve the model at all."""
        for lane, url in enumerate(self.urls):
            result = await self.complete(input_len=4, output_len=2, timeout_seconds=30.0, lane=lane)
            if not result.ok:
                raise RunnerError(f"The endpoint {url} cannot serve '{self.model}': {result.error}")

    async def engine_stats(self) -> list[tuple[float, float, float] | None]:
        """Per endpoint, from its engine's own /metrics: (requests finished, TTFT seconds
        summed, TTFTs counted); None where the engine does not say."""
        return [await self._engine_stats(base) for base in self.bases]

    async def _engine_stats(self, base: str) -> tuple[float, float, float] | None:
        try:
            response = await self.clients[0].get(base + "/metrics", timeout=5.0)
            if response.status_code != 200:
                return None
            finished = ttft_sum = ttft_count = 0.0
            for family in text_string_to_metric_families(response.text):
                if family.name == "vllm:request_success":
                    finished = sum(s.value for s in family.samples if s.name.endswith("_total"))
                elif family.name == "vllm:time_to_first_token_seconds":
                    for sample in family.samples:
                        if sample.name.endswith("_sum"):
                            ttft_sum += sample.value
                        elif sample.name.endswith("_count"):
                            ttft_count += sample.value
            return finished, ttft_sum, ttft_count
        except (httpx.HTTPError, ValueError):
            return None

    async def prefix_cache_counters(self) -> tuple[float, float] | None:
        """The engines' prefix-cache counters now, summed over the endpoints, or None when one
        exposes none (or its /metrics does not answer): then hits are read from usage or not
        at all."""
        totals = [0.0, 0.0]
        for base in self.bases:
            try:
                response = await self.clients[0].get(base + "/metrics", timeout=10.0)
                counters = (
                    prefix_cache_counters(response.text, self.model)
                    if response.status_code == 200
                    else None
                )
            except (httpx.HTTPError, ValueError):
                counters = None
            if counters is None:
                return None
            totals[0] += counters[0]
            totals[1] += counters[1]
        return totals[0], totals[1]

    def _body(self, shape: ShapeSpec, lane: int = 0) -> tuple[str, dict]:
        """Where to send one request of `shape` on `lane`, and what."""
        self._salt += 1
        prefix_len = shape.shared_prefix_len
        if prefix_len:
            ids = [*shared_prefix_token_ids(prefix_len, _shape_seed(shape))]
            ids += prompt_token_ids(shape.input_len - prefix_len, self._salt)
        else:
            ids = prompt_token_ids(shape.input_len, self._salt)
        common = {
            "model": self.model,
            "max_tokens": shape.output_len,
            "min_tokens": shape.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not shape.images:
            return self.urls[lane % len(self.urls)], {"model": self.model, "prompt": ids, **common}
        # Images need the chat API (vLLM's completions API takes none): text, then the images,
        # after the salted text so they never fall in the shared prefix.
        content = [{"type": "text", "text": prompt_words(ids)}]
        content += [image_part(self._salt, index) for index in range(shape.images)]
        chat_url = self.chat_urls[lane % len(self.chat_urls)]
        return chat_url, {**common, "messages": [{"role": "user", "content": content}]}

    async def complete(
        self,
        *,
        input_len: int,
        output_len: int,
        timeout_seconds: float,
        lane: int = 0,
        cache_hit_share: float = 0.0,
        images: int = 0,
    ) -> RequestResult:
        url, body = self._body(ShapeSpec(input_len, output_len, cache_hit_share, images), lane)
        started = time.perf_counter()
        first_token_at = None
        chunks_with_text = 0
        usage = None
        try:
            client = self.clients[(lane // STREAMS_PER_CLIENT) % len(self.clients)]
            async with client.stream("POST", url, json=body, timeout=timeout_seconds) as response:
                if response.status_code != 200:
                    detail = (await response.aread())[:200].decode(errors="replace")
                    return RequestResult(
                        ok=False,
                        started_s=started,
                        finished_s=time.perf_counter(),
                        error=f"HTTP {response.status_code}: {detail}",
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    # Decoding every chunk would make the client, not the engine, the limit at
                    # high concurrency: only the first token's chunk and the usage chunk are
                    # parsed. A quoted "prompt_tokens" key appears only in a usage object
                    # (inside generated text the quotes would be escaped).
                    if '"prompt_tokens"' in payload:
                        chunk = json.loads(payload)
                        usage = chunk.get("usage") or usage
                        if not any(_has_text(c) for c in chunk.get("choices") or []):
                            continue
                    elif first_token_at is not None:
                        chunks_with_text += 1
                        continue
                    else:
                        chunk = json.loads(payload)
                    if any(_has_text(choice) for choice in chunk.get("choices") or []):
                        chunks_with_text += 1
                        if first_token_at is None:
                            first_token_at = time.perf_counter()
        except (httpx.HTTPError, json.JSONDecodeError) as error:
            return RequestResult(
                ok=False,
                started_s=started,
                finished_s=time.perf_counter(),
                error=f"{type(error).__name__}: {error}"[:300],
            )
        finished = time.perf_counter()
        completion_tokens = int(usage["completion_tokens"]) if usage else chunks_with_text
        prompt_tokens = int(usage["prompt_tokens"]) if usage else input_len
        details = (usage or {}).get("prompt_tokens_details")
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


# The share of a point's measuring time spent before it, filling the batch.
WARMUP_SHARE = 0.25


async def measure_point(
    endpoint: Endpoint,
    *,
    input_len: int,
    output_len: int,
    concurrency: int,
    spec: SuiteSpec,
    cache_hit_share: float = 0.0,
    images: int = 0,
) -> PointResult:
    """Closed-loop load: `concurrency` workers send back to back.

    The first quarter of the time is a warm-up that fills the batch. Throughput counts each
    successful request by the share of its lifetime that falls inside the measuring window:
    identical requests started together finish together, so counting whole completions in a
    window would jump by a whole cohort at a time, while lifetime shares flow smoothly.
    """
    warmup_seconds = spec.duration_per_point_seconds * WARMUP_SHARE
    engines_before = await endpoint.engine_stats()
    # The ticker's own lateness with nothing else to run (the timer's granularity): what the
    # load adds on top of it is the client's overhead.
    idle_lag_ms = await _idle_lag_ms()
    lags_ms: list[float] = []
    start = time.perf_counter()
    window_start = start + warmup_seconds
    window_end = window_start + spec.duration_per_point_seconds
    results: list[RequestResult] = []

    async def worker(lane: int) -> None:
        while time.perf_counter() < window_end:
            results.append(
                await endpoint.complete(
                    input_len=input_len,
                    output_len=output_len,
                    timeout_seconds=spec.request_timeout_seconds,
                    lane=lane,
                    cache_hit_share=cache_hit_share,
                    images=images,
                )
            )

    async def ticker() -> None:
        # Inside the measuring window only: the warm-up's connection set-up is not the
        # steady state the TTFTs are read from.
        while time.perf_counter() < window_end:
            due = time.perf_counter() + LAG_TICK_SECONDS
            await asyncio.sleep(LAG_TICK_SECONDS)
            if due >= window_start:
                lags_ms.append(max(0.0, time.perf_counter() - due) * 1000)

    await asyncio.gather(ticker(), *(worker(lane) for lane in range(concurrency)))
    engines_after = await endpoint.engine_stats()
    seconds = spec.duration_per_point_seconds
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    request_share = 0.0
    input_tokens = 0.0
    output_tokens = 0.0
    cached_tokens = 0.0
    for r in ok:
        lifetime = max(r.finished_s - r.started_s, 1e-9)
        overlap = min(r.finished_s, window_end) - max(r.started_s, window_start)
        share = max(0.0, overlap) / lifetime
        request_share += share
        input_tokens += share * r.prompt_tokens
        output_tokens += share * r.completion_tokens
        cached_tokens += share * (r.cached_tokens or 0)
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
        request_count=len(ok),
        error_count=len(errors),
        slo_met=slo_met,
        first_error=errors[0].error if errors else "",
        client_lag_mean_ms=(
            max(0.0, sum(lags_ms) / len(lags_ms) - idle_lag_ms) if lags_ms else None
        ),
        client_lag_p99_ms=percentile(lags_ms, 0.99),
        **_engine_view(ok, engines_before, engines_after),
        cache_hit_share=cache_hit_share,
        images=images,
        cached_input_tokens_per_s=cached_tokens / seconds,
        cache_hits_from="usage" if any(r.cached_tokens is not None for r in ok) else "",
    )


async def _measure_cache_hits(
    endpoint: Endpoint, shape: ShapeSpec, concurrency: int, spec: SuiteSpec
) -> PointResult:
    """A point of a feature shape, its cache hits read back: from usage when the engine
    reports them per request, else from its prefix-cache counters, read when the measuring
    window opens and when the point ends: the share of the prompt tokens looked up in that
    time that hit (after the warm-up, so without the shape's very first prompt, which cannot
    hit), applied to the point's prompt tokens."""

    async def counters_at_window_start() -> tuple[float, float] | None:
        await asyncio.sleep(spec.duration_per_point_seconds * WARMUP_SHARE)
        return await endpoint.prefix_cache_counters()

    window_start = asyncio.ensure_future(counters_at_window_start())
    try:
        point = await measure_point(
            endpoint,
            input_len=shape.input_len,
            output_len=shape.output_len,
            concurrency=concurrency,
            spec=spec,
            cache_hit_share=shape.cache_hit_share,
            images=shape.images,
        )
    except BaseException:
        window_start.cancel()
        raise
    before = await window_start
    if point.cache_hits_from or before is None:
        return point
    after = await endpoint.prefix_cache_counters()
    if after is None or after[0] <= before[0]:
        return point
    hit_share = min(1.0, max(0.0, (after[1] - before[1]) / (after[0] - before[0])))
    return replace(
        point,
        cached_input_tokens_per_s=hit_share * point.input_tokens_per_s,
        cache_hits_from="metrics",
    )


async def _idle_lag_ms(ticks: int = 20) -> float:
    lags = []
    for _ in range(ticks):
        due = time.perf_counter() + LAG_TICK_SECONDS
        await asyncio.sleep(LAG_TICK_SECONDS)
        lags.append(max(0.0, time.perf_counter() - due) * 1000)
    return sum(lags) / len(lags)


def _engine_view(ok: list[RequestResult], before: list, after: list) -> dict:
    """The point's client and engine mean TTFT over the same requests (all the point's), and
    how many engines served them; nothing where an engine does not expose its metrics."""
    if not ok or any(b is None for b in before) or any(a is None for a in after):
        return {}
    moved = [(a[0] - b[0], a[1] - b[1], a[2] - b[2]) for b, a in zip(before, after, strict=True)]
    counted = sum(m[2] for m in moved)
    client_ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "client_ttft_mean_ms": 1000 * sum(client_ttfts) / len(client_ttfts)
        if client_ttfts
        else None,
        "engine_ttft_mean_ms": 1000 * sum(m[1] for m in moved) / counted if counted else None,
        "engines_measured": sum(1 for m in moved if m[0] > 0),
    }


async def sweep_shape(
    endpoint: Endpoint,
    *,
    input_len: int,
    output_len: int,
    spec: SuiteSpec,
    on_point: Callable[[PointResult], Awaitable[None]] | None = None,
    cache_hit_share: float = 0.0,
    images: int = 0,
) -> ShapeResult:
    wanted = ShapeSpec(input_len, output_len, cache_hit_share, images)
    shape = ShapeResult(
        input_len=input_len, output_len=output_len, cache_hit_share=cache_hit_share, images=images
    )
    concurrency = spec.concurrency_start
    while True:
        if wanted.has_features:
            point = await _measure_cache_hits(endpoint, wanted, concurrency, spec)
        else:
            point = await measure_point(
                endpoint,
                input_len=input_len,
                output_len=output_len,
                concurrency=concurrency,
                spec=spec,
            )
        shape.points.append(point)
        if on_point is not None:
            await on_point(point)
        if point.engines_measured is not None and point.engines_measured < len(endpoint.urls):
            raise RunnerError(
                f"only {point.engines_measured} of the {len(endpoint.urls)} benchmarked "
                f"replicas' engines counted requests at {wanted.describe()}, concurrency "
                f"{concurrency}: the measurement would not be per replica"
            )
        if point.error_rate > spec.max_error_rate:
            raise RunnerError(
                f"{point.error_count} of {point.request_count + point.error_count} requests "
                f"failed at {wanted.describe()} with concurrency {concurrency} "
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
    on_point: Callable[[PointResult], Awaitable[None]] | None = None,
    on_shape: Callable[[ShapeResult], Awaitable[None]] | None = None,
) -> list[ShapeResult]:
    clients = make_clients(
        spec.max_concurrency,
        timeout_seconds=spec.request_timeout_seconds,
        host_policy=host_policy,
    )
    try:
        endpoint = Endpoint(base_url, model, clients=clients)
        await endpoint.check()
        shapes = []
        for wanted in spec.shapes():
            shape = await sweep_shape(
                endpoint,
                input_len=wanted.input_len,
                output_len=wanted.output_len,
                spec=spec,
                on_point=on_point,
                cache_hit_share=wanted.cache_hit_share,
                images=wanted.images,
            )
            shapes.append(shape)
            if on_shape is not None:
                await on_shape(shape)
        return shapes
    finally:
        for client in clients:
            await client.aclose()
