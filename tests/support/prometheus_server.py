"""A real Prometheus server for tests: Debian's binary, a private config, storage and port.

`make test` installs the `prometheus` package when it is missing (scripts/services.py), so a
missing binary fails the tests that need it instead of skipping them: a fresh machine must not
pass by testing less.
"""

import json
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.processes import free_port

PROMETHEUS_BINARY = Path("/usr/bin/prometheus")
START_TIMEOUT_SECONDS = 30


@contextmanager
def prometheus_server(
    targets: Sequence[str],
    directory: Path,
    *,
    job: str = "engine",
    scrape_interval_seconds: int = 1,
    scrape_configs: Sequence[dict] | None = None,
) -> Iterator[str]:
    """Runs Prometheus scraping `targets` ("host:port") every second; yields its base URL.
    `scrape_configs`, when given, replaces that one job (Prometheus's own scrape_config
    entries: a metrics path, an authorization, several jobs)."""
    if not PROMETHEUS_BINARY.exists():
        pytest.fail(
            f"{PROMETHEUS_BINARY} is missing. `make test` installs it (scripts/services.py); "
            "by hand: apt-get install --no-install-recommends prometheus",
            pytrace=False,
        )
    interval = f"{scrape_interval_seconds}s"
    config = {
        "global": {
            "scrape_interval": interval,
            # Prometheus refuses a scrape timeout longer than the interval (default 10 s).
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "scrape_configs": (
            list(scrape_configs)
            if scrape_configs is not None
            else [{"job_name": job, "static_configs": [{"targets": list(targets)}]}]
        ),
    }
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    config_path = directory / "prometheus.yml"
    config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    log_path = directory / "prometheus.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                str(PROMETHEUS_BINARY),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            while not _ready(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    log_tail = log_path.read_text()[-3000:]
                    pytest.fail(
                        f"Prometheus did not become ready at {url}:\n{log_tail}", pytrace=False
                    )
                time.sleep(0.1)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_samples(url: str, metric: str, *, count: int, timeout_seconds: float = 20) -> None:
    """Waits until Prometheus holds `count` scraped samples of every `metric` series, so that
    rates over a window have something to work with."""
    query = f"min(count_over_time({metric}[5m]))"
    deadline = time.monotonic() + timeout_seconds
    while True:
        result = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5).json()
        samples = result["data"]["result"]
        if samples and float(samples[0]["value"][1]) >= count:
            return
        if time.monotonic() > deadline:
            pytest.fail(
                f"Prometheus at {url} has not scraped {count} samples of {metric}: {result}"
            )
        time.sleep(0.2)
