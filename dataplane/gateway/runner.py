"""Starting the gateway: GATEWAY_WORKERS processes, each with one asyncio event loop, all
listening on the same port with SO_REUSEPORT (the kernel spreads connections over them).
Each loop is uvloop's (a dependency): sockets, timers and callbacks cost about half of what
they cost on asyncio's own loop.

With more than one worker, prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR,
a private temporary directory unless set) makes `/metrics` report the sum of the workers.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from types import FrameType

import uvloop

from .errors import error_json
from .settings import Settings, SettingsError

log = logging.getLogger("dataplane.gateway")
JOIN_AFTER_GRACE_SECONDS = 10
# More than this many worker deaths within CRASH_LOOP_SECONDS stop the gateway (a crash loop
# is not served through).
CRASH_LOOP_DEATHS = 5
CRASH_LOOP_SECONDS = 60
# After the grace: how long the requests cut get to record themselves.
CUT_SECONDS = 1.0


def serve(settings: Settings) -> None:
    """One worker: one event loop serving until SIGTERM (or SIGINT, when it is not ignored)."""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )
    # The cyclic GC: what was imported and built at start is frozen (never scanned again), and
    # a collection waits for 10,000 new container objects instead of 700. With a few hundred
    # requests in flight, each holding dozens of futures, frames and dicts, the default
    # collected some 40 times a second in bench_gateway (about a tenth of a busy worker's
    # time) for nothing: a request's objects go with their reference counts, and the rare cycle
    # is still collected (with these settings a few times a minute, at the same memory).
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_run(settings))
    finally:
        loop.close()


async def _run(settings: Settings) -> None:
    # Imported in the workers only: the parent that starts and watches them never serves, and
    # is spared the worker's stack (aiohttp, redis, the admission scripts: some 0.3 s).
    from .http import serve as listen
    from .server import Gateway

    loop = asyncio.get_running_loop()
    gateway = Gateway(settings)
    await gateway.start()
    server, connections = await listen(
        gateway.dispatch,
        error_json,
        host=settings.host,
        port=settings.port,
        max_body_bytes=settings.max_body_bytes,
        reuse_port=True,
        limits=settings.limits,
    )
    stopping = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        loop.add_signal_handler(signal.SIGINT, stopping.set)
    await stopping.wait()
    # No new connections; idle kept-alive ones are closed now, busy ones after their answer.
    server.close()
    for connection in list(connections):
        if connection.idle():
            connection.close()
    # The grace for requests in flight (Gateway.drain), then the rest is cut: closing a
    # connection cancels the task answering it, which records its request as cancelled.
    await gateway.drain()
    for connection in list(connections):
        connection.close()
    deadline = loop.time() + CUT_SECONDS
    while gateway.answering and loop.time() < deadline:
        await asyncio.sleep(0.01)
    await gateway.stop()


def _worker(settings: Settings) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    serve(settings)


def main() -> int:
    try:
        settings = Settings.from_env()
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    base_url = f"http://{settings.host}:{settings.port}"
    if settings.workers == 1:
        print(f"Gateway serving on {base_url} (1 worker)", flush=True)
        serve(settings)
        return 0
    own_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        own_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = own_dir
    context = multiprocessing.get_context("spawn")

    def spawn(index: int) -> multiprocessing.process.BaseProcess:
        worker = context.Process(
            target=_worker, args=(settings,), name=f"gateway-{index}", daemon=False
        )
        worker.start()
        return worker

    workers = [spawn(i) for i in range(settings.workers)]
    print(f"Gateway serving on {base_url} ({settings.workers} workers)", flush=True)
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for worker in workers:
            if worker.is_alive() and worker.pid is not None:
                os.kill(worker.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = 0
    deaths: list[float] = []  # when workers died, for the crash loop's bound
    try:
        # A worker that dies is started again (the others keep serving on the shared port):
        # its requests in flight are lost with it, and their admissions closed by the control
        # plane's reaper once its heartbeat is old. Workers dying over and over stop the
        # gateway: a supervisor restarts it whole, or someone reads the log.
        while not stopping:
            for index, worker in enumerate(workers):
                worker.join(timeout=0.5 / len(workers))
                if worker.exitcode is None or stopping:
                    continue
                now = time.monotonic()
                deaths = [at for at in deaths if now - at < CRASH_LOOP_SECONDS] + [now]
                log.error("gateway worker %s exited (%s)", worker.name, worker.exitcode)
                if len(deaths) > CRASH_LOOP_DEATHS:
                    log.error(
                        "%d worker deaths within %d s: stopping the gateway",
                        len(deaths), CRASH_LOOP_SECONDS,
                    )  # fmt: skip
                    status = 1
                    stop(signal.SIGTERM, None)
                    break
                workers[index] = spawn(index)
        for worker in workers:
            # Its grace for requests in flight, then 10 s to cancel the rest and hand over
            # its unsent usage.
            worker.join(timeout=settings.shutdown_grace_seconds + JOIN_AFTER_GRACE_SECONDS)
            if worker.is_alive():
                worker.kill()
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
    return status
