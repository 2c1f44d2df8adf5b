"""The gateway's cost at 256 concurrent streams, beside the emulator alone and LiteLLM's proxy.

One engine emulator (one process; one replica that fits every stream in one batch, 10 ms decode
steps, outputs of exactly MAX_TOKENS tokens) is driven from ONE client (one aiohttp session in
this process, a closed loop of 256 streamed chat completions) in three setups, round by round
so that a slow spell of the shared machine hits all of them:

- direct: straight to the emulator;
- gateway: `python -m dataplane.gateway` (GATEWAY_WORKERS processes) with admission and usage
  on: real Redis (BENCH_REDIS_URL), the control plane's Lua admission for every request, one
  usage event per request posted in batches to a recording HTTP server in this process that
  answers 200 to `POST /api/v1/usage/events` (no control plane is run: its ingestion would
  compete for the same two cores, and it is measured by bench_usage). The contract documents
  are written here exactly as docs/gateway-contract.md says (this branch has no publisher), with
  a reservation big enough that every request is admitted as guaranteed;
- litellm: LiteLLM's proxy (`litellm --config … --num_workers GATEWAY_WORKERS`), pointed at the
  same emulator as an OpenAI-compatible backend (`openai/<model>`, `api_base`), installed from
  bench/litellm-requirements.txt (exact versions, sha256 hashes) into its own virtual
  environment, var/bench/litellm-venv, built once and reused while the lock file is unchanged.
  If it cannot be installed or started, its figures are "n/a" with the reason.

The first baseline is the emulator's engine driven in this process with no HTTP and no client
(as in bench_runner). Latency is end to end (request sent to `[DONE]` read); TTFT is the first
content chunk. Added latency = the setup's percentile minus the direct one.

Two loads, because a closed loop cannot measure the hop's own latency:

- closed loop (the throughput target, >= 0.8x direct): CONCURRENCY lanes, each sending its
  next request when the last one ends. With N requests always in flight, Little's law makes the
  latency N / throughput, so at 0.8x direct's throughput the p50 is 1.25x direct's, tens of ms
  more, whatever the hop itself costs: "+p50 <= 2 ms" can only hold there at about 1.0x. Its
  +p50 is printed against the target all the same, marked as the queue it is;
- open loop (the latency target, +p50 <= 2 ms and <= 5 % of the emulator's own p50 TTFT):
  Poisson arrivals at OPEN_LOAD (50 %) of direct's closed-loop rate measured in the same run,
  the same seeded schedule for direct and the gateway, at most CONCURRENCY in flight (an
  arrival that finds them all busy waits, and is counted). Latency counts from when a request
  was due, so no wait is hidden. The difference is what the hop adds to a request at that rate
  (its own work and its queue on cores it shares with the emulator and the client). It runs at
  OPEN_LOAD_LIGHT (25 %) too, for information. LiteLLM is not offered these rates: its whole
  capacity is a few percent of them;
- one stream at a time (no queue anywhere): the hop's cost on an idle machine.

The CPU each process tree spends per request (user + system, /proc) is printed beside: on two
shared cores, the gateway's CPU is what it takes from the emulator and the client.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import httpx
import redis

from bench.bench_runner import _lifetime_rate, _start_emulator
from bench.figures import Figure
from benchmarking import runner
from dataplane.emulator.config import parse_config
from dataplane.emulator.engine import Listener
from dataplane.emulator.fleet import ModelFleet
from tests.support.publication import write_signed

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "bench" / "litellm-requirements.txt"
LITELLM_VENV = ROOT / "var" / "bench" / "litellm-venv"
LITELLM_VERSION = "1.106.12"

CONCURRENCY = 256
MAX_TOKENS = 8
# GATEWAY_WORKERS, and LiteLLM's --num_workers (BENCH_GATEWAY_WORKERS to try another count).
WORKERS = int(os.environ.get("BENCH_GATEWAY_WORKERS", "2"))
ROUNDS = 3
WARMUP_SECONDS = 1.0
WINDOW_SECONDS = 3.0
PREWARM_SECONDS = 1.0
PREWARM_LANES = 8
LITELLM_WARMUP_SECONDS = 8.0
LITELLM_WINDOW_SECONDS = 16.0
ONE_STREAM_ROUNDS = 6
ONE_STREAM_REQUESTS = 5
START_TIMEOUT_SECONDS = 120.0
VENV_BUILD_TIMEOUT_SECONDS = 1200.0

MODEL = {
    "name": "gwbench",
    "replicas": 1,
    "cold_start_seconds": 0,
    "max_num_seqs": 1024,
    "kv_cache_tokens": 1_000_000,
    "context_length": 4096,
    "prefill_seconds_per_token": 0.0,
    "decode_step_base_seconds": 0.010,
    "decode_seconds_per_sequence": 0.0,
    "decode_seconds_per_context_token": 0.0,
    # Long natural outputs: every request stops at max_tokens (no ignore_eos needed, which a
    # proxy might not pass through).
    "mean_output_tokens": 10**9,
}
CONFIG = {"seed": 1, "models": [MODEL]}
PROMPT = "Say something short about model units and capacity planning, please."

# The contract (docs/gateway-contract.md): one customer, one model, ids unique to this bench.
CUSTOMER_ID = 990_001
CUSTOMER = "gwbench-demo"
MODEL_ID = 990_001
WEIGHTS = {"input_tokens": 1e-4, "output_tokens": 2e-3, "request": 1e-3}
RESERVATION_MU_PER_MINUTE = 1e9  # every request admitted as guaranteed
SERVICE_KEY = "mu000000000000.gwbench-service-key-for-usage"
LITELLM_MASTER_KEY = "sk-gwbench-master-key"
GW_KEYS = ("gw:v1:keys", "gw:v1:models", "gw:v1:entitlements", "gw:v1:meta", "gw:v1:waiting")

TARGET_RATIO = 0.8
TARGET_ADDED_P50_MS = 2.0
TARGET_ADDED_P50_SHARE_OF_TTFT = 0.05

# The open loop: Poisson arrivals (the same seeded schedule for every setup) at this share of
# direct's closed-loop rate in the same run, at most CONCURRENCY in flight.
OPEN_LOAD = 0.5
# And at a quarter, for information: what the hop adds with more headroom on the shared cores.
OPEN_LOAD_LIGHT = 0.25
OPEN_ROUNDS = 2
OPEN_WARMUP_SECONDS = 0.5
OPEN_WINDOW_SECONDS = 3.0
OPEN_SEED = 18


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    return runner.percentile(values, q) or float("nan")


# -- the client ------------------------------------------------------------------------------


@dataclass
class Sample:
    """One setup's requests, pooled over rounds."""

    rates: list[float] = field(default_factory=list)  # requests/s of each round's window
    latencies: list[float] = field(default_factory=list)  # seconds, end to end
    ttfts: list[float] = field(default_factory=list)  # seconds, first content chunk
    sent: int = 0
    errors: Counter = field(default_factory=Counter)
    # Open loop: arrivals that found CONCURRENCY requests in flight and waited (their latency
    # counts from when they were due).
    capped: int = 0
    # CPU seconds of each process tree over the rounds, and the requests those rounds finished.
    cpu: Counter = field(default_factory=Counter)
    finished: int = 0

    @property
    def rps(self) -> float:
        return statistics.mean(self.rates) if self.rates else float("nan")

    def cpu_us(self, what: str) -> float:
        """CPU microseconds per request of a process tree (nan when not measured)."""
        if what not in self.cpu or not self.finished:
            return float("nan")
        return self.cpu[what] / self.finished * 1e6

    def p(self, q: float) -> float:
        return _pct(self.latencies, q) * 1000

    def ttft(self, q: float) -> float:
        return _pct(self.ttfts, q) * 1000


def _has_content(line: bytes) -> bool:
    if b'"content"' not in line:
        return False
    try:
        doc = json.loads(line[5:])
    except ValueError:
        return False
    return any((c.get("delta") or {}).get("content") for c in doc.get("choices") or ())


BODY = json.dumps(
    {
        "model": MODEL["name"],
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
).encode()


async def _one(session: aiohttp.ClientSession, url: str, headers: dict, body: bytes):
    """(started, first content, finished, content chunks) of one streamed request, or the
    reason it failed. The response is read to its end, as the official openai client does
    (so the connection is kept alive for the next request)."""
    began = time.perf_counter()
    first = None
    chunks = 0
    done = False
    async with session.post(url, data=body, headers=headers) as response:
        if response.status != 200:
            text = (await response.read())[:200]
            return f"HTTP {response.status}: {text!r}"
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            if line.startswith(b"data: [DONE]"):
                done = True
            elif first is None:
                if _has_content(line):
                    first = time.perf_counter()
                    chunks += 1
            elif b'"content"' in line:
                chunks += 1
    if not done:
        return "the stream ended without [DONE]"
    return began, first or time.perf_counter(), time.perf_counter(), chunks


async def _drive(
    url: str,
    headers: dict,
    sample: Sample,
    warmup_seconds: float = WARMUP_SECONDS,
    window_seconds: float = WINDOW_SECONDS,
    lanes: int = CONCURRENCY,
) -> None:
    """One round: `lanes` streams in a closed loop for warm-up + window seconds, then the
    requests still running are awaited (their share of the window counts)."""
    body = BODY
    headers = {"Content-Type": "application/json", **headers}
    spans: list[tuple[float, float]] = []
    start = time.perf_counter()
    window_start = start + warmup_seconds
    window_end = window_start + window_seconds
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trust_env=False, auto_decompress=False
    ) as session:

        async def lane() -> None:
            while time.perf_counter() < window_end:
                sample.sent += 1
                try:
                    result = await _one(session, url, headers, body)
                except (aiohttp.ClientError, TimeoutError) as error:
                    result = f"{type(error).__name__}: {error}"
                if isinstance(result, str):
                    sample.errors[result] += 1
                    await asyncio.sleep(0.05)
                    continue
                began, first, finished, chunks = result
                if chunks != MAX_TOKENS:
                    sample.errors[f"{chunks} content chunks, not {MAX_TOKENS}"] += 1
                sample.finished += 1
                spans.append((began, finished))
                if window_start <= finished <= window_end:
                    sample.latencies.append(finished - began)
                    sample.ttfts.append(first - began)

        await asyncio.gather(*(lane() for _ in range(lanes)))
    sample.rates.append(_lifetime_rate(spans, window_start, window_end))


async def _drive_open(url: str, headers: dict, sample: Sample, rate: float) -> None:
    """One open-loop round: requests sent at Poisson arrival times (`rate` per second, the
    same seeded schedule for every setup) for warm-up + window seconds, whatever the answers,
    at most CONCURRENCY in flight (an arrival that finds them all busy waits). Latency and TTFT
    count from when the request was due, so a wait is never hidden; the requests due in the
    window are the sample."""
    headers = {"Content-Type": "application/json", **headers}
    schedule = random.Random(OPEN_SEED)
    slots = asyncio.Semaphore(CONCURRENCY)
    tasks: set[asyncio.Task] = set()
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trust_env=False, auto_decompress=False
    ) as session:
        start = time.perf_counter()
        window_start = start + OPEN_WARMUP_SECONDS
        window_end = window_start + OPEN_WINDOW_SECONDS
        done_in_window = 0

        async def one(due: float) -> None:
            nonlocal done_in_window
            try:
                result = await _one(session, url, headers, BODY)
            except (aiohttp.ClientError, TimeoutError) as error:
                result = f"{type(error).__name__}: {error}"
            finally:
                slots.release()
            if isinstance(result, str):
                sample.errors[result] += 1
                return
            _began, first, finished, chunks = result
            if chunks != MAX_TOKENS:
                sample.errors[f"{chunks} content chunks, not {MAX_TOKENS}"] += 1
            sample.finished += 1
            if window_start <= finished < window_end:
                done_in_window += 1
            if window_start <= due < window_end:
                sample.latencies.append(finished - due)
                sample.ttfts.append(first - due)

        due = start
        while due < window_end:
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            if slots.locked():
                sample.capped += 1
            await slots.acquire()
            sample.sent += 1
            task = asyncio.create_task(one(due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            due += schedule.expovariate(rate)
        await asyncio.gather(*tasks)
    sample.rates.append(done_in_window / OPEN_WINDOW_SECONDS)


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        used[int(entry)] = int(fields[11]) + int(fields[12])
    tree = {pid}
    grown = True
    while grown:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grown = bool(more)
    return sum(used.get(p, 0) for p in tree) / ticks


def _measured(sample: Sample, pids: dict[str, int], drive) -> None:
    """Runs one round (`drive`, a coroutine) and adds to `sample` the CPU of each process tree
    in `pids` and of this process (the client, and the usage recorder's threads)."""
    before = {name: _tree_cpu_seconds(pid) for name, pid in pids.items()}
    client = time.process_time()
    asyncio.run(drive)
    sample.cpu["client"] += time.process_time() - client
    for name, pid in pids.items():
        sample.cpu[name] += _tree_cpu_seconds(pid) - before[name]


# -- the in-process ceiling (as bench_runner) -------------------------------------------------


async def _engine_closed_loop() -> tuple[float, float]:
    """(requests/s, p50 e2e seconds) of the engine driven directly: no HTTP, no client."""
    fleet = ModelFleet(parse_config(CONFIG).models[0], seed=1)
    fleet.start()
    prompt = list(range(100, 116))
    spans: list[tuple[float, float]] = []
    counter = iter(range(10**9))
    window_start = time.perf_counter() + WARMUP_SECONDS
    window_end = window_start + WINDOW_SECONDS

    async def worker() -> None:
        while time.perf_counter() < window_end:
            listener = Listener(streaming=False)
            seq = fleet.new_sequence(
                request_id=f"g{next(counter)}",
                prompt_token_ids=prompt,
                max_tokens=MAX_TOKENS,
                min_tokens=MAX_TOKENS,
                ignore_eos=True,
                priority=0,
                request_seed=None,
                prompt_index=0,
                listener=listener,
            )
            began = time.perf_counter()
            fleet.submit(seq)
            while not seq.done:
                await listener.wait()
            spans.append((began, time.perf_counter()))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    await fleet.stop()
    settled = [f - b for b, f in spans if window_start <= b and f <= window_end]
    return _lifetime_rate(spans, window_start, window_end), _pct(settled, 0.5)


# -- usage events: a recording server ---------------------------------------------------------


class UsageRecorder:
    """Answers 200 to POST /api/v1/usage/events (every event accepted) and counts them."""

    def __init__(self) -> None:
        self.outcomes: Counter = Counter()
        self.classes: Counter = Counter()
        self.posts = 0
        self.bad_auth = 0
        self._lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                events = []
                if self.path == "/api/v1/usage/events":
                    events = json.loads(raw).get("events") or []
                    with recorder._lock:
                        recorder.posts += 1
                        if self.headers.get("Authorization") != f"Bearer {SERVICE_KEY}":
                            recorder.bad_auth += 1
                        for event in events:
                            recorder.outcomes[event.get("outcome")] += 1
                            recorder.classes[event.get("admission_class")] += 1
                answer = json.dumps(
                    {"accepted": [e.get("event_id") for e in events], "duplicates": []}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format, *args):  # noqa: A002 - http.server's signature
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def events(self) -> int:
        with self._lock:
            return sum(self.outcomes.values())

    def __enter__(self) -> UsageRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


# -- the gateway ------------------------------------------------------------------------------


def _publish_contract(client: redis.Redis, emulator_url: str) -> str:
    """The four documents of docs/gateway-contract.md and the admission limits; returns the
    customer's API key."""
    from accounts.keys import mint
    from capacity.admission.bucket import Floor
    from capacity.admission.redis_buckets import Buckets

    key = mint()
    key_doc = {
        "secret_sha256": key.secret_sha256,
        "kind": "customer",
        "customer_id": CUSTOMER_ID,
        "customer": CUSTOMER,
        "scopes": ["read", "admission"],
        "expires_at": None,
        "revoked": False,
    }
    model_doc = {
        "model_id": MODEL_ID,
        "engine_model_id": MODEL["name"],
        "context_length_tokens": MODEL["context_length"],
        "cost_model": {"weights_replica_seconds": WEIGHTS, "replica_mu_per_minute": 100.0},
        "output_cap_tokens": None,
        "bytes_per_token": 4.0,
        "degradation": {
            "level": 0,
            "refuse_best_effort": False,
            "max_tokens_cap": None,
            "fallback_model": None,
        },
        "replicas": [
            {
                "endpoint": emulator_url,
                "deployment": "gwbench",
                "gpu_type": "emulated",
                "priority_scheduling": False,
            }
        ],
    }
    client.delete(*GW_KEYS)
    write_signed(  # signed as the control plane signs (bench.sh's test-only key pair)
        client,
        {
            "gw:v1:keys": {key.prefix: json.dumps(key_doc)},
            "gw:v1:models": {MODEL["name"]: json.dumps(model_doc)},
            "gw:v1:entitlements": {str(CUSTOMER_ID): json.dumps([MODEL["name"]])},
        },
    )
    buckets = Buckets(client, burst_seconds=10, idle_ttl_seconds=600, record_ttl_s=3600)
    # The customer's reservation floor (what a sale writes); no best-effort allowance.
    pair = (CUSTOMER_ID, MODEL_ID)
    buckets.publish_floors({pair: Floor(RESERVATION_MU_PER_MINUTE)}, pairs=[pair])
    buckets.publish_limits({pair: 0.0}, ttl_s=600)
    return key.plaintext


def _wait_answering(url: str, process: subprocess.Popen, what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            if httpx.get(url, timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    raise RuntimeError(f"{what} did not answer {url} (exit {process.poll()}):\n{tail}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def _start_gateway(
    folder: Path, usage_url: str, **extra_env: str
) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    env = {
        **os.environ,
        **extra_env,
        "GATEWAY_PORT": str(port),
        "GATEWAY_WORKERS": str(WORKERS),
        "GATEWAY_REDIS_URL": os.environ["REDIS_URL"],
        "GATEWAY_CONTROL_PLANE_URL": usage_url,
        "GATEWAY_SERVICE_KEY": SERVICE_KEY,
        "GATEWAY_LOG_LEVEL": "WARNING",
        "GATEWAY_SHUTDOWN_GRACE_SECONDS": "5",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    log = folder / "gateway.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dataplane.gateway"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_answering(url + "/readyz", process, "the gateway", log)
    except Exception:
        _stop(process)
        raise
    return process, url, log


def _start_relay(emulator_port: int) -> tuple[subprocess.Popen, str]:
    """bench/relay.py in front of the emulator, with the gateway's worker count: the floor."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.relay", "127.0.0.1", str(emulator_port), str(port),
         str(WORKERS)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_answering(url + "/health", process, "the relay", Path(os.devnull))
    except Exception:
        _stop(process)
        raise
    return process, url


# -- LiteLLM ----------------------------------------------------------------------------------


def _litellm_venv() -> Path:
    """var/bench/litellm-venv with the locked LiteLLM, built when absent or when the lock file
    changed (its sha256 is kept in the venv). Raises RuntimeError saying why it cannot."""
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()
    marker = LITELLM_VENV / ".lock-sha256"
    litellm = LITELLM_VENV / "bin" / "litellm"
    if litellm.exists() and marker.exists() and marker.read_text().strip() == digest:
        return litellm
    if sys.version_info[:2] != (3, 11) or sys.platform != "linux":
        raise RuntimeError("the lock file holds CPython 3.11 Linux x86_64 wheels only")
    print(f"   building {LITELLM_VENV.relative_to(ROOT)} (litellm {LITELLM_VERSION})", flush=True)
    started = time.perf_counter()
    shutil.rmtree(LITELLM_VENV, ignore_errors=True)
    LITELLM_VENV.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    steps = [
        [sys.executable, "-m", "venv", str(LITELLM_VENV)],
        [
            str(LITELLM_VENV / "bin" / "pip"),
            "install",
            "--quiet",
            "--require-hashes",
            "--no-deps",
            "--only-binary=:all:",
            # Compiling every module of every package took 28 s; the proxy's start compiles
            # the ones it imports (6 s), once.
            "--no-compile",
            "-r",
            str(LOCK),
        ],
    ]
    for step in steps:
        try:
            done = subprocess.run(
                step,
                env=env,
                capture_output=True,
                text=True,
                timeout=VENV_BUILD_TIMEOUT_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{step[0]} took over {VENV_BUILD_TIMEOUT_SECONDS:.0f} s") from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if "is ignored" not in line]
            raise RuntimeError(f"pip install failed: {' '.join(lines[-3:])[:300]}")
    if not litellm.exists():
        raise RuntimeError("the install left no bin/litellm")
    marker.write_text(digest + "\n")
    print(f"   built in {time.perf_counter() - started:.0f} s", flush=True)
    return litellm


def _start_litellm(folder: Path, emulator_url: str) -> tuple[subprocess.Popen, str, Path]:
    litellm = _litellm_venv()
    port = _free_port()
    config = folder / "litellm.yaml"
    # JSON is YAML: no YAML writer needed.
    config.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": MODEL["name"],
                        "litellm_params": {
                            "model": f"openai/{MODEL['name']}",
                            "api_base": f"{emulator_url}/v1",
                            "api_key": "none",
                        },
                    }
                ],
                "general_settings": {"master_key": LITELLM_MASTER_KEY},
                "litellm_settings": {"drop_params": True, "telemetry": False},
            },
            indent=1,
        )
    )
    # Only what it needs: never the bench's DATABASE_URL or REDIS_URL (it would use them).
    env = {
        "PATH": f"{litellm.parent}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(folder)),
        "LANG": "C.UTF-8",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": os.environ.get("BENCH_LITELLM_LOG", "ERROR"),
        "LITELLM_MODE": "PRODUCTION",
        "NO_PROXY": "*",
    }
    log = folder / "litellm.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [
                str(litellm),
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                str(WORKERS),
            ],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_answering(url + "/health/liveliness", process, "LiteLLM's proxy", log)
    except Exception:
        _stop(process)
        raise
    return process, url, log


# -- the run ----------------------------------------------------------------------------------


def _run_rounds(
    setups: dict[str, tuple[str, dict]], pids: dict[str, dict[str, int]]
) -> dict[str, Sample]:
    """The 256-stream closed loops: direct and gateway interleaved round by round; LiteLLM,
    whose requests take seconds at this load, in one longer round (a short one would end
    before its first wave of requests does)."""
    samples = {name: Sample() for name in setups}
    for name, (url, headers) in setups.items():
        # Unmeasured: first connections, lazy imports and caches (LiteLLM's first requests
        # take seconds).
        prewarm = Sample()
        asyncio.run(_drive(url, headers, prewarm, 0.0, PREWARM_SECONDS, lanes=PREWARM_LANES))
        samples[name].sent += prewarm.sent
        samples[name].errors += prewarm.errors
    for _ in range(ROUNDS):
        for name, (url, headers) in setups.items():
            if name != "litellm":
                _measured(samples[name], pids[name], _drive(url, headers, samples[name]))
    if "litellm" in setups:
        url, headers = setups["litellm"]
        drive = _drive(
            url, headers, samples["litellm"], LITELLM_WARMUP_SECONDS, LITELLM_WINDOW_SECONDS
        )
        _measured(samples["litellm"], pids["litellm"], drive)
    return samples


def _run_open(
    setups: dict[str, tuple[str, dict]], pids: dict[str, dict[str, int]], rate: float
) -> dict[str, Sample]:
    """The open loops at `rate` requests/s, direct and gateway interleaved round by round.
    LiteLLM is not offered this rate: its whole closed-loop capacity is a small fraction of it,
    so it would only measure its queue."""
    samples = {name: Sample() for name in ("direct", "gateway")}
    for _ in range(OPEN_ROUNDS):
        for name, sample in samples.items():
            url, headers = setups[name]
            _measured(sample, pids[name], _drive_open(url, headers, sample, rate))
    return samples


async def _one_stream(setups: dict[str, tuple[str, dict]]) -> dict[str, Sample]:
    """One request at a time, the setups taking turns: the cost of the hop itself, with no
    queue in front of any process."""
    samples = {name: Sample() for name in setups}
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        for round_ in range(ONE_STREAM_ROUNDS + 1):
            for name, (url, headers) in setups.items():
                for _ in range(ONE_STREAM_REQUESTS):
                    sample = samples[name]
                    sample.sent += 1
                    result = await _one(
                        session, url, {"Content-Type": "application/json", **headers}, BODY
                    )
                    if isinstance(result, str):
                        sample.errors[result] += 1
                    elif round_ > 0:  # round 0 warms the connections
                        began, first, finished, _chunks = result
                        sample.latencies.append(finished - began)
                        sample.ttfts.append(first - began)
    return samples


def _check(name: str, sample: Sample) -> None:
    if sample.errors:
        worst = ", ".join(f"{n}× {reason}" for reason, n in sample.errors.most_common(3))
        raise AssertionError(f"{name}: {sum(sample.errors.values())} requests failed: {worst}")
    if not sample.latencies:
        raise AssertionError(f"{name}: no request finished inside the window")


def _wait_for_events(recorder: UsageRecorder, expected: int) -> None:
    deadline = time.monotonic() + 10
    while recorder.events < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    if recorder.events != expected:
        raise AssertionError(f"{recorder.events} usage events for {expected} gateway requests")
    if set(recorder.outcomes) != {"completed"} or set(recorder.classes) != {"guaranteed"}:
        raise AssertionError(
            f"usage events: outcomes {dict(recorder.outcomes)}, classes {dict(recorder.classes)}"
        )
    if recorder.bad_auth:
        raise AssertionError("usage posted without the service key")


def _budget_ms(direct_ttft_p50_ms: float) -> float:
    """The added-p50 target: at most 2 ms and at most 5 % of the emulator's own p50 TTFT."""
    return min(TARGET_ADDED_P50_MS, TARGET_ADDED_P50_SHARE_OF_TTFT * direct_ttft_p50_ms)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _cpu(sample: Sample, what: str) -> str:
    value = sample.cpu_us(what)
    return f"{value:6.0f}" if value == value else f"{'-':>6}"


def _open_block(opened: dict[str, Sample], rate: float, load: float) -> list[str]:
    direct_open = opened["direct"]
    header = (
        f"{'setup':<8} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'TTFT50':>7} {'TTFT99':>7} "
        f"{'+p50 ms':>8} {'+p99 ms':>8} {'+TTFT50':>8} {'+TTFT99':>8} {'hop CPU':>7} "
        f"{'waited':>6}"
    )
    lines = [
        "",
        f"open loop: Poisson arrivals at {rate:.0f} requests/s ({load:.0%} of direct's "
        f"closed-loop rate), at most {CONCURRENCY} in flight ('waited': arrivals that found "
        "them all busy)",
        header,
        "-" * len(header),
    ]
    for name in ("direct", "gateway"):
        sample = opened[name]
        lines.append(
            f"{name:<8} {sample.rps:7.0f} {sample.p(0.5):7.1f} {sample.p(0.99):7.1f} "
            f"{sample.ttft(0.5):7.1f} {sample.ttft(0.99):7.1f} "
            f"{sample.p(0.5) - direct_open.p(0.5):8.2f} "
            f"{sample.p(0.99) - direct_open.p(0.99):8.2f} "
            f"{sample.ttft(0.5) - direct_open.ttft(0.5):8.2f} "
            f"{sample.ttft(0.99) - direct_open.ttft(0.99):8.2f}  {_cpu(sample, 'gateway')} "
            f"{sample.capped:6d}"
        )
    lines.append(f"litellm  n/a: its closed-loop capacity is below the offered {rate:.0f}/s")
    return lines


def _table(
    samples: dict[str, Sample],
    single: dict[str, Sample],
    opened: dict[str, Sample],
    rate: float,
    light: dict[str, Sample],
    light_rate: float,
    engine_rps: float,
    litellm_reason: str | None,
) -> str:
    direct, direct1, direct_open = samples["direct"], single["direct"], opened["direct"]
    budget = _budget_ms(direct.ttft(0.5))
    budget1 = _budget_ms(direct1.ttft(0.5))
    budget_open = _budget_ms(direct_open.ttft(0.5))
    header = (
        f"{'setup':<8} {'req/s':>7} {'x direct':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'TTFT50':>7} {'+p50 ms':>8} {'+p99 ms':>8} {'hop CPU':>7} {'emu CPU':>7} | "
        f"{'1 stream: p50':>13} {'+p50 ms':>8}"
    )
    lines = [
        f"closed loop: {CONCURRENCY} streams, {MAX_TOKENS} tokens each; engine in-process, no "
        f"client: {engine_rps:.0f} requests/s; CPU in us per request (the hop's processes, the "
        "emulator's)",
        header,
        "-" * len(header),
    ]
    for name in ("direct", "relay", "gateway", "litellm"):
        sample, one = samples.get(name), single.get(name)
        if sample is None or one is None:
            lines.append(f"{name:<8} n/a: {litellm_reason}")
            continue
        hop = {"litellm": "proxy", "relay": "relay"}.get(name, "gateway")
        lines.append(
            f"{name:<8} {sample.rps:7.0f} {sample.rps / direct.rps:8.2f} {sample.p(0.5):7.1f} "
            f"{sample.p(0.99):7.1f} {sample.ttft(0.5):7.1f} "
            f"{sample.p(0.5) - direct.p(0.5):8.1f} {sample.p(0.99) - direct.p(0.99):8.1f} "
            f" {_cpu(sample, hop)}  {_cpu(sample, 'emulator')} | {one.p(0.5):13.1f} "
            f"{one.p(0.5) - direct1.p(0.5):8.2f}"
        )
    lines += _open_block(opened, rate, OPEN_LOAD)
    lines += _open_block(light, light_rate, OPEN_LOAD_LIGHT)

    gateway, gateway1, gateway_open = samples["gateway"], single["gateway"], opened["gateway"]
    relay = samples["relay"]
    ratio = gateway.rps / direct.rps
    lines += [
        "",
        f"relay: a hop that forwards bytes and does nothing else (bench/relay.py, {WORKERS} "
        f"processes): {relay.rps / direct.rps:.2f}x direct, {_cpu(relay, 'relay').strip()} us "
        f"of CPU per request; the gateway: {gateway.rps / relay.rps:.2f}x the relay's "
        "throughput, its own work beyond forwarding "
        f"{gateway.cpu_us('gateway') - relay.cpu_us('relay'):.0f} us per request",
    ]
    added = gateway.p(0.5) - direct.p(0.5)
    added1 = gateway1.p(0.5) - direct1.p(0.5)
    added_open = gateway_open.p(0.5) - direct_open.p(0.5)
    added_light = light["gateway"].p(0.5) - light["direct"].p(0.5)
    budget_light = _budget_ms(light["direct"].ttft(0.5))
    lines += [
        "",
        "targets (gateway):",
        f"  throughput at {CONCURRENCY} streams >= {TARGET_RATIO}x direct: {ratio:.2f}x "
        f"-> {_met(ratio >= TARGET_RATIO)}",
        f"  open loop at {OPEN_LOAD:.0%}: +p50 <= {budget_open:.2f} ms (2 ms, 5 % of direct's "
        f"TTFT p50 {direct_open.ttft(0.5):.1f} ms): {added_open:+.2f} ms "
        f"-> {_met(added_open <= budget_open)}",
        f"  (open loop at {OPEN_LOAD_LIGHT:.0%}, for information: +p50 {added_light:+.2f} ms "
        f"against {budget_light:.2f} ms -> {_met(added_light <= budget_light)})",
        f"  1 stream: +p50 <= {budget1:.2f} ms (2 ms, 5 % of direct's TTFT p50 "
        f"{direct1.ttft(0.5):.1f} ms): {added1:+.2f} ms -> {_met(added1 <= budget1)}",
        f"  closed loop: +p50 <= {budget:.2f} ms (2 ms, 5 % of direct's TTFT p50 "
        f"{direct.ttft(0.5):.1f} ms): {added:+.1f} ms -> {_met(added <= budget)} (with "
        f"{CONCURRENCY} streams in a closed loop, p50 ~ {CONCURRENCY} / throughput: below 1.0x "
        "direct's throughput the added p50 is the queue, not the hop)",
    ]
    litellm, litellm1 = samples.get("litellm"), single.get("litellm")
    if litellm is None or litellm1 is None:
        lines.append(f"  ahead of LiteLLM: n/a ({litellm_reason})")
    else:
        ahead_rps = gateway.rps > litellm.rps
        ahead_p50 = gateway.p(0.5) < litellm.p(0.5) and gateway1.p(0.5) < litellm1.p(0.5)
        lines.append(
            f"  ahead of LiteLLM: throughput {gateway.rps:.0f} vs {litellm.rps:.0f} req/s -> "
            f"{_met(ahead_rps)}; p50 {gateway.p(0.5):.1f} vs {litellm.p(0.5):.1f} ms, 1 stream "
            f"{gateway1.p(0.5):.1f} vs {litellm1.p(0.5):.1f} ms -> {_met(ahead_p50)}"
        )
    return "\n".join(lines)


def _figures(name: str, sample: Sample, direct: Sample, one: Sample, direct1: Sample):
    return [
        Figure(
            name=f"{name}_requests_per_s_at_{CONCURRENCY}_streams",
            value=sample.rps,
            unit="requests/s",
            baseline=direct.rps,
            baseline_name=f"direct to the emulator (target >= {TARGET_RATIO}x)",
        ),
        Figure(
            name=f"{name}_added_p50_latency",
            value=sample.p(0.5) - direct.p(0.5),
            unit="ms",
            baseline=direct.ttft(0.5),
            baseline_name=(
                f"emulator p50 TTFT, direct (target <= {TARGET_ADDED_P50_MS:g} ms "
                f"and <= {TARGET_ADDED_P50_SHARE_OF_TTFT:.2f}x)"
            ),
        ),
        Figure(
            name=f"{name}_added_p99_latency",
            value=sample.p(0.99) - direct.p(0.99),
            unit="ms",
            baseline=direct.p(0.99),
            baseline_name="emulator p99 e2e, direct",
        ),
        Figure(
            name=f"{name}_ttft_p50",
            value=sample.ttft(0.5),
            unit="ms",
            baseline=direct.ttft(0.5),
            baseline_name="emulator p50 TTFT, direct",
        ),
        Figure(
            name=f"{name}_added_p50_latency_1_stream",
            value=one.p(0.5) - direct1.p(0.5),
            unit="ms",
            baseline=direct1.ttft(0.5),
            baseline_name="emulator p50 TTFT, direct, 1 stream",
        ),
    ]


def _open_figures(opened: dict[str, Sample], rate: float, load: float) -> list[Figure]:
    direct, gateway = opened["direct"], opened["gateway"]
    where = f"open loop at {rate:.0f} requests/s"
    tag = "open_loop" if load == OPEN_LOAD else f"open_loop_{load * 100:.0f}pct"
    return [
        Figure(
            name=f"gateway_{tag}_added_p50_latency",
            value=gateway.p(0.5) - direct.p(0.5),
            unit="ms",
            baseline=direct.ttft(0.5),
            baseline_name=(
                f"emulator p50 TTFT, direct, {where} (target <= {TARGET_ADDED_P50_MS:g} ms "
                f"and <= {TARGET_ADDED_P50_SHARE_OF_TTFT:.2f}x)"
            ),
        ),
        Figure(
            name=f"gateway_{tag}_added_p99_latency",
            value=gateway.p(0.99) - direct.p(0.99),
            unit="ms",
            baseline=direct.p(0.99),
            baseline_name=f"emulator p99 e2e, direct, {where}",
        ),
        Figure(
            name=f"gateway_{tag}_added_ttft_p50",
            value=gateway.ttft(0.5) - direct.ttft(0.5),
            unit="ms",
            baseline=direct.ttft(0.5),
            baseline_name=f"emulator p50 TTFT, direct, {where}",
        ),
        Figure(
            name=f"gateway_{tag}_cpu_per_request",
            value=gateway.cpu_us("gateway"),
            unit="us",
            baseline=direct.cpu_us("emulator"),
            baseline_name=f"the emulator's CPU per request, direct, {where}",
        ),
    ]


def _na_figures(reason: str) -> list[Figure]:
    nan = float("nan")
    return [
        Figure(
            name=f"litellm_{what}",
            value=nan,
            unit="n/a",
            baseline=nan,
            baseline_name=f"n/a: {reason}",
        )
        for what in (f"requests_per_s_at_{CONCURRENCY}_streams", "added_p50_latency")
    ]


def run() -> list[Figure]:
    rds = redis.Redis.from_url(os.environ["REDIS_URL"])
    processes: list[subprocess.Popen] = []
    litellm_reason: str | None = None
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp, UsageRecorder() as recorder:
        folder = Path(tmp)
        config_path = folder / "emulator.json"
        config_path.write_text(json.dumps(CONFIG))
        port = _free_port()
        try:
            emulator = _start_emulator(config_path, port)
            processes.append(emulator)
            emulator_url = f"http://127.0.0.1:{port}"
            key = _publish_contract(rds, emulator_url)
            gateway, gateway_url, _ = _start_gateway(folder, recorder.url)
            processes.append(gateway)
            relay, relay_url = _start_relay(port)
            processes.append(relay)
            pids = {
                "direct": {"emulator": emulator.pid},
                "gateway": {"emulator": emulator.pid, "gateway": gateway.pid},
                "relay": {"emulator": emulator.pid, "relay": relay.pid},
            }
            setups = {
                "direct": (f"{emulator_url}/v1/chat/completions", {}),
                "gateway": (
                    f"{gateway_url}/v1/chat/completions",
                    {"Authorization": f"Bearer {key}"},
                ),
                "relay": (f"{relay_url}/v1/chat/completions", {}),
            }
            if os.environ.get("BENCH_LITELLM", "1") == "0":
                litellm_reason = "skipped: BENCH_LITELLM=0"
            else:
                try:
                    started = time.perf_counter()
                    litellm, litellm_url, _ = _start_litellm(folder, emulator_url)
                    processes.append(litellm)
                    print(
                        f"   litellm {LITELLM_VERSION} ready in "
                        f"{time.perf_counter() - started:.1f} s",
                        flush=True,
                    )
                    setups["litellm"] = (
                        f"{litellm_url}/v1/chat/completions",
                        {"Authorization": f"Bearer {LITELLM_MASTER_KEY}"},
                    )
                    pids["litellm"] = {"emulator": emulator.pid, "proxy": litellm.pid}
                except (RuntimeError, OSError) as error:
                    litellm_reason = str(error).splitlines()[0][:200]
                    print(f"   litellm n/a: {error}", flush=True)
            started = time.perf_counter()
            samples = _run_rounds(setups, pids)
            print(f"   {CONCURRENCY} streams: {time.perf_counter() - started:.1f} s", flush=True)
            started = time.perf_counter()
            rate = OPEN_LOAD * samples["direct"].rps
            opened = _run_open(setups, pids, rate)
            light_rate = OPEN_LOAD_LIGHT * samples["direct"].rps
            light = _run_open(setups, pids, light_rate)
            print(f"   open loop: {time.perf_counter() - started:.1f} s", flush=True)
            started = time.perf_counter()
            single = asyncio.run(_one_stream(setups))
            print(f"   1 stream: {time.perf_counter() - started:.1f} s", flush=True)
            for name in setups:
                _check(name, samples[name])
                _check(f"{name} (1 stream)", single[name])
            for name, sample in [*opened.items(), *light.items()]:
                _check(f"{name} (open loop)", sample)
            _wait_for_events(
                recorder,
                samples["gateway"].sent
                + opened["gateway"].sent
                + light["gateway"].sent
                + single["gateway"].sent,
            )
        finally:
            for process in reversed(processes):
                _stop(process)
            rds.delete(*GW_KEYS)
            # The admission records (one per request, kept for days) and buckets of this run.
            stale = list(rds.scan_iter(match=f"adm:*:{MODEL_ID}:{CUSTOMER_ID}*", count=5000))
            for start in range(0, len(stale), 5000):
                rds.delete(*stale[start : start + 5000])
            rds.close()
    engine_rps, _engine_p50 = asyncio.run(_engine_closed_loop())
    table = _table(samples, single, opened, rate, light, light_rate, engine_rps, litellm_reason)
    print(table, flush=True)
    direct, direct1 = samples["direct"], single["direct"]
    figures = [
        Figure(
            name=f"direct_requests_per_s_at_{CONCURRENCY}_streams",
            value=direct.rps,
            unit="requests/s",
            baseline=engine_rps,
            baseline_name="engine in-process, no client",
        ),
        *_figures("gateway", samples["gateway"], direct, single["gateway"], direct1),
        Figure(
            name=f"gateway_cpu_per_request_at_{CONCURRENCY}_streams",
            value=samples["gateway"].cpu_us("gateway"),
            unit="us",
            baseline=direct.cpu_us("emulator"),
            baseline_name=f"the emulator's CPU per request, direct, {CONCURRENCY} streams",
        ),
        Figure(
            name=f"relay_requests_per_s_at_{CONCURRENCY}_streams",
            value=samples["relay"].rps,
            unit="requests/s",
            baseline=direct.rps,
            baseline_name="direct to the emulator (a hop that only forwards bytes: the floor)",
        ),
        Figure(
            name=f"gateway_requests_per_s_over_relay_at_{CONCURRENCY}_streams",
            value=samples["gateway"].rps,
            unit="requests/s",
            baseline=samples["relay"].rps,
            baseline_name="the relay (bench/relay.py) in front of the same emulator",
        ),
        *_open_figures(opened, rate, OPEN_LOAD),
        *_open_figures(light, light_rate, OPEN_LOAD_LIGHT),
    ]
    if "litellm" in samples:
        figures += _figures("litellm", samples["litellm"], direct, single["litellm"], direct1)
    else:
        figures += _na_figures(litellm_reason or "not run")
    return figures
