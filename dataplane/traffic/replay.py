"""Replay per-request LLM traces through an OpenAI-compatible gateway, as its customers.

    python -m dataplane.traffic --gateway-url http://127.0.0.1:8080/v1 \\
        --client acme=simulation/data/traces/AzureLLMInferenceTrace_conv_2023.csv@0.5 \\
        --client globex=simulation/data/traces/AzureLLMInferenceTrace_code_2023.csv@3

Each client replays its own trace (`simulation.engine.traces`: Azure's
`TIMESTAMP,ContextTokens,GeneratedTokens` or `timestamp,input_tokens,output_tokens`), scaled by
its `SCALE` the simulator's way (each request appears ⌊K⌋ or ⌈K⌉ times; under 1, a seeded
subset), at the trace's own arrival times from the start, over and over until stopped (or for
`--duration-seconds`, or `--passes`). A request is one chat completion of the trace's sizes: a
prompt of that many words (the emulator counts one token per word; four bytes each, as the
gateway's default estimate assumes) and exactly that many output tokens (`max_tokens` =
`min_tokens`). A customer's
key is read from the environment, `TRAFFIC_KEY_<NAME>` (upper case; a key is never a flag, which
`ps` would show).

Requests are not retried: a 429 is a refusal by admission, the demand the control plane should
see. At most `--max-in-flight` requests per client are outstanding; a request due while that
many are is skipped and counted, so a slow fleet is not buried under a backlog. Every
`--summary-seconds` one line is logged: per client, requests sent, answered ok, refused (429),
errors and skipped over the interval, and the totals so far.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from simulation.engine.traces import TraceError, TraceRequest, load_request_trace

log = logging.getLogger("dataplane.traffic")

KEY_ENV_PREFIX = "TRAFFIC_KEY_"
# Three letters and a space: four bytes per word, one emulator token per word.
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_WORD_BYTES = 4


class UsageError(ValueError):
    """A bad flag or a missing key; the message names it."""


@dataclass(frozen=True)
class ClientSpec:
    name: str
    trace_path: str
    scale: float = 1.0

    @property
    def key_env(self) -> str:
        return KEY_ENV_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", self.name).upper()


def parse_client(text: str) -> ClientSpec:
    """`NAME=TRACE[@SCALE]`."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise UsageError(f"--client {text!r}: expected NAME=TRACE[@SCALE]")
    path, at, scale_text = rest.rpartition("@") if "@" in rest else (rest, "", "")
    scale = 1.0
    if at:
        try:
            scale = float(scale_text)
        except ValueError:
            raise UsageError(f"--client {text!r}: scale {scale_text!r} is not a number") from None
        if not scale > 0:
            raise UsageError(f"--client {text!r}: scale must be > 0, got {scale_text}")
    return ClientSpec(name.strip(), path.strip(), scale)


@dataclass
class Counts:
    sent: int = 0
    ok: int = 0
    refused: int = 0
    errors: int = 0
    skipped: int = 0
    last_error: str = ""

    def add(self, other: Counts) -> None:
        self.sent += other.sent
        self.ok += other.ok
        self.refused += other.refused
        self.errors += other.errors
        self.skipped += other.skipped

    def text(self) -> str:
        return f"sent {self.sent} ok {self.ok} 429 {self.refused} errors {self.errors}" + (
            f" skipped {self.skipped}" if self.skipped else ""
        )


@dataclass(frozen=True)
class Settings:
    gateway_url: str
    model: str
    max_in_flight: int
    max_context_tokens: int
    timeout_seconds: float
    summary_seconds: float
    duration_seconds: float
    passes: int
    wait_ready_seconds: float
    seed: int


class Prompts:
    """Prompts of an exact number of words, cut from one seeded pool of three-letter words."""

    def __init__(self, rng: random.Random, max_words: int) -> None:
        self.rng = rng
        self.pool_words = 2 * max_words
        self.pool = " ".join(
            "".join(rng.choice(_LETTERS) for _ in range(3)) for _ in range(self.pool_words)
        )

    def words(self, count: int) -> str:
        start = self.rng.randrange(0, self.pool_words - count + 1)
        return self.pool[start * _WORD_BYTES : (start + count) * _WORD_BYTES - 1]


@dataclass
class Client:
    spec: ClientSpec
    key: str
    requests: list[TraceRequest]
    interval: Counts = field(default_factory=Counts)
    total: Counts = field(default_factory=Counts)
    in_flight: int = 0

    @property
    def period_s(self) -> float:
        """One pass of the trace: its span plus a mean gap, so passes do not overlap."""
        if not self.requests:
            return 1.0
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s
        return span + span / max(1, len(self.requests) - 1) or 1.0


async def _send(
    session: aiohttp.ClientSession, settings: Settings, client: Client, request: TraceRequest,
    prompts: Prompts,
) -> None:  # fmt: skip
    output = max(1, request.output_tokens)
    words = max(1, min(request.input_tokens, settings.max_context_tokens - output))
    body = {
        "model": settings.model,
        "messages": [{"role": "user", "content": prompts.words(words)}],
        "max_tokens": output,
        "min_tokens": output,
        "stream": False,
    }
    client.interval.sent += 1
    client.in_flight += 1
    try:
        async with session.post(
            settings.gateway_url.rstrip("/") + "/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {client.key}"},
        ) as response:
            text = await response.text()
            if response.status == 200:
                client.interval.ok += 1
            elif response.status == 429:
                client.interval.refused += 1
            else:
                client.interval.errors += 1
                client.interval.last_error = f"{response.status} {text[:160]}"
    except (aiohttp.ClientError, TimeoutError) as error:
        client.interval.errors += 1
        client.interval.last_error = f"{type(error).__name__}: {error}"[:200]
    finally:
        client.in_flight -= 1


async def _replay(
    session: aiohttp.ClientSession, settings: Settings, client: Client, prompts: Prompts,
    deadline: float | None,
) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    start = loop.time()
    first = client.requests[0].arrival_s if client.requests else 0.0
    passes = 0
    while client.requests and not (settings.passes and passes >= settings.passes):
        offset = start + passes * client.period_s - first
        for request in client.requests:
            due = offset + request.arrival_s
            if deadline is not None and due >= deadline:
                return
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if client.in_flight >= settings.max_in_flight:
                client.interval.skipped += 1
                continue
            task = asyncio.create_task(_send(session, settings, client, request, prompts))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        passes += 1


def _summary(clients: Sequence[Client], seconds: float) -> str:
    parts = []
    for client in clients:
        interval = client.interval
        client.total.add(interval)
        part = f"{client.spec.name}: {interval.text()} (total {client.total.text()})"
        if interval.last_error:
            part += f" last error: {interval.last_error}"
        parts.append(part)
        client.interval = Counts()
    return f"last {seconds:.0f} s | " + " | ".join(parts)


async def _summarise(clients: Sequence[Client], every_seconds: float) -> None:
    last = time.monotonic()
    while True:
        await asyncio.sleep(every_seconds)
        now = time.monotonic()
        log.info("%s", _summary(clients, now - last))
        last = now


async def _wait_ready(session: aiohttp.ClientSession, settings: Settings) -> None:
    """Until the gateway has read the control plane's contract (its /readyz)."""
    if settings.wait_ready_seconds <= 0:
        return
    root = re.sub(r"/v1/?$", "", settings.gateway_url.rstrip("/"))
    deadline = time.monotonic() + settings.wait_ready_seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(root + "/readyz") as response:
                if response.status == 200:
                    return
        await asyncio.sleep(1.0)
    log.warning("the gateway at %s is not ready after %.0f s; sending anyway", root,
                settings.wait_ready_seconds)  # fmt: skip


async def run(settings: Settings, clients: Sequence[Client]) -> None:
    timeout = aiohttp.ClientTimeout(total=settings.timeout_seconds)
    connector = aiohttp.TCPConnector(limit=settings.max_in_flight * max(1, len(clients)))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await _wait_ready(session, settings)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.duration_seconds if settings.duration_seconds else None
        rng = random.Random(settings.seed)  # noqa: S311 - prompt words, not secrets
        prompts = Prompts(rng, settings.max_context_tokens)
        started = time.monotonic()
        summary = asyncio.create_task(_summarise(clients, settings.summary_seconds))
        try:
            await asyncio.gather(
                *(_replay(session, settings, client, prompts, deadline) for client in clients)
            )
            # Let the last requests finish, within their timeout.
            while any(client.in_flight for client in clients):
                await asyncio.sleep(0.1)
        finally:
            summary.cancel()
            log.info("%s", _summary(clients, time.monotonic() - started))


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a number") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dataplane.traffic", description=__doc__.split("\n\n")[0]
    )
    env = os.environ.get
    parser.add_argument(
        "--gateway-url", default=env("TRAFFIC_GATEWAY_URL", "http://127.0.0.1:8080/v1"),
        help="the gateway's OpenAI base URL (TRAFFIC_GATEWAY_URL)",
    )  # fmt: skip
    parser.add_argument(
        "--model", default=env("TRAFFIC_MODEL", "llama-3.1-8b"),
        help="the model every request asks for (TRAFFIC_MODEL)",
    )  # fmt: skip
    parser.add_argument(
        "--client", action="append", default=[], metavar="NAME=TRACE[@SCALE]",
        help="a customer replaying TRACE scaled by SCALE (repeatable); its key is read from "
        "TRAFFIC_KEY_<NAME>",
    )  # fmt: skip
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="outstanding requests per client (TRAFFIC_MAX_IN_FLIGHT, 64)",
    )
    parser.add_argument(
        "--max-context-tokens",
        type=int,
        default=None,
        help="prompt + output cap; longer prompts are cut (TRAFFIC_MAX_CONTEXT_TOKENS, 8192)",
    )
    parser.add_argument(
        "--timeout-seconds",
        type=float,
        default=None,
        help="one request (TRAFFIC_TIMEOUT_SECONDS, 180)",
    )
    parser.add_argument(
        "--summary-seconds",
        type=float,
        default=None,
        help="interval of the summary line (TRAFFIC_SUMMARY_SECONDS, 30)",
    )
    parser.add_argument(
        "--duration-seconds",
        type=float,
        default=None,
        help="stop after this long; 0: run until stopped (TRAFFIC_DURATION_SECONDS, 0)",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=None,
        help="stop after replaying each trace this many times; 0: run until stopped "
        "(TRAFFIC_PASSES, 0)",
    )
    parser.add_argument(
        "--wait-ready-seconds",
        type=float,
        default=None,
        help="wait this long for the gateway's /readyz first; 0: do not "
        "(TRAFFIC_WAIT_READY_SECONDS, 120)",
    )
    parser.add_argument("--seed", type=int, default=None,
                        help="seeds the scaling and the prompts (TRAFFIC_SEED, 0)")  # fmt: skip
    return parser


def settings_and_clients(argv: Sequence[str] | None = None) -> tuple[Settings, list[Client]]:
    args = _parser().parse_args(argv)

    def number(value: float | int | None, name: str, default: float) -> float:
        chosen = _env_float(name, default) if value is None else float(value)
        if chosen < 0:
            raise UsageError(f"{name.lower()}: must be >= 0, got {chosen:g}")
        return chosen

    settings = Settings(
        gateway_url=args.gateway_url,
        model=args.model,
        max_in_flight=max(1, int(number(args.max_in_flight, "TRAFFIC_MAX_IN_FLIGHT", 64))),
        max_context_tokens=max(
            2, int(number(args.max_context_tokens, "TRAFFIC_MAX_CONTEXT_TOKENS", 8192))
        ),
        timeout_seconds=number(args.timeout_seconds, "TRAFFIC_TIMEOUT_SECONDS", 180),
        summary_seconds=max(1.0, number(args.summary_seconds, "TRAFFIC_SUMMARY_SECONDS", 30)),
        duration_seconds=number(args.duration_seconds, "TRAFFIC_DURATION_SECONDS", 0),
        passes=int(number(args.passes, "TRAFFIC_PASSES", 0)),
        wait_ready_seconds=number(args.wait_ready_seconds, "TRAFFIC_WAIT_READY_SECONDS", 120),
        seed=int(number(args.seed, "TRAFFIC_SEED", 0)),
    )
    if not args.client:
        raise UsageError("no --client given: nothing to replay")
    clients = []
    for index, text in enumerate(args.client):
        spec = parse_client(text)
        key = os.environ.get(spec.key_env, "")
        if not key:
            raise UsageError(f"--client {spec.name}: its key is not set ({spec.key_env})")
        try:
            requests = load_request_trace(
                spec.trace_path, scale=spec.scale, seed=settings.seed + index
            )
        except TraceError as error:
            raise UsageError(f"--client {spec.name}: {error}") from None
        clients.append(Client(spec=spec, key=key, requests=requests))
    return settings, clients


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("TRAFFIC_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings, clients = settings_and_clients(argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for client in clients:
        rate = len(client.requests) / client.period_s
        log.info(
            "%s replays %s ×%g: %d requests every %.0f s (%.2f req/s) through %s",
            client.spec.name, client.spec.trace_path, client.spec.scale, len(client.requests),
            client.period_s, rate, settings.gateway_url,
        )  # fmt: skip

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run(settings, clients)

    asyncio.run(serve())
    return 0
