"""The load-generation client: the endpoints a run loads (one, or each replica held for it),
the client processes that share the load at high concurrency, and one streamed request timed
as its pieces arrive (TTFT, TPOT, the engine's usage). Also each engine's own counters, read
from its /metrics before and after a point."""

import asyncio
import json
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from benchmarking.runner.prompts import chat_messages, shape_prompt_ids
from benchmarking.runner.results import RequestResult
from benchmarking.runner.spec import GridShape, RunnerError
from benchmarking.streams import ClientError, StreamClient
from core import outbound

# Below this many streams per process a second process costs more than it saves.
MIN_STREAMS_PER_PROCESS = 64


def _has_text(choice: dict) -> bool:
    """A completion chunk's text, or a chat chunk's delta content."""
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


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


def _warm(_: int) -> int:
    time.sleep(0.2)  # long enough that each of the pool's processes takes one
    return os.getpid()
