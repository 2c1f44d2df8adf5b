"""Starting and stopping the real servers that tests run beside them (emulator, gunicorn,
Prometheus): wait until they answer, and never leave one behind."""

import subprocess
import time
from pathlib import Path

import httpx

# How long a process the tests start may take to answer: liveness only. One starts within
# seconds on an idle machine; make test runs most tests at the lowest CPU priority beside the
# timing-sensitive ones, and a start can then wait a minute for the CPU.
START_SECONDS = 90.0


def http_ok(url: str) -> bool:
    try:
        # trust_env=False: a proxy from the environment must not sit between test and server.
        return httpx.get(url, timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until_answering(
    url: str,
    process: subprocess.Popen,
    *,
    what: str,
    log_path: Path,
    timeout_seconds: float = START_SECONDS,
    poll_seconds: float = 0.1,
) -> None:
    """Return once GET `url` answers 200; raise with the server's log if it dies or never does."""
    deadline = time.monotonic() + timeout_seconds
    while not http_ok(url):
        if process.poll() is not None or time.monotonic() > deadline:
            log = log_path.read_text()[-3000:] if log_path.exists() else "(no log)"
            raise RuntimeError(f"{what} did not start answering at {url}:\n{log}")
        time.sleep(poll_seconds)


def stop(process: subprocess.Popen, *, timeout_seconds: float = 20) -> None:
    process.terminate()
    try:
        process.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
