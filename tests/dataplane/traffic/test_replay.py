"""The demo's traffic generator replays a trace through the real gateway as two customers:
one admitted, one refused by admission; one line per interval says what happened."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.dataplane.gateway import contract as C
from tests.dataplane.gateway.conftest import set_limits, usage_events, wait_for
from tests.support.processes import ROOT

# 20 requests over 2 s, small enough for the emulator's fast model.
TRACE = "timestamp,input_tokens,output_tokens\n" + "".join(
    f"{i * 0.1:.1f},{8 + i},{2 + i % 3}\n" for i in range(20)
)


def traffic(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dataplane.traffic", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def two_customers(world, start_emulator, start_gateway, tmp_path):
    """acme may send 1,000 MU/min; globex (customer 2) is allowed the model but has no allowance."""
    url, _process = start_emulator()
    globex = C.key(customer_id=2, customer="globex")
    world.publication.keys[globex.prefix] = globex.doc
    world.publication.entitlements[2] = ["tiny"]
    world.publication.models["tiny"] = C.model(7, [C.replica(url)])
    world.publish()
    set_limits(world.rds, {(1, 7): (1000.0, 0.0), (2, 7): (0.0, 0.0)})
    gateway = start_gateway()
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    return world, gateway, trace, globex


def test_it_replays_the_trace_as_each_customer_and_sums_up_every_interval(
    two_customers, usage_server
):
    world, gateway, trace, globex = two_customers
    done = traffic(
        "--gateway-url", f"{gateway.url}/v1", "--model", "tiny", "--max-context-tokens", "2048",
        "--client", f"acme={trace}@2", "--client", f"globex={trace}",
        "--passes", "1", "--summary-seconds", "1",
        env={"TRAFFIC_KEY_ACME": world.acme.plaintext, "TRAFFIC_KEY_GLOBEX": globex.plaintext},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    log = done.stderr
    # Scaled ×2, acme's one pass is 40 requests; globex's 20, all refused by admission.
    assert "acme replays" in log and "40 requests" in log
    final = log.strip().splitlines()[-1]
    assert re.search(r"acme: .*\(total sent 40 ok 40 429 0 errors 0\)", final), final
    assert re.search(r"globex: .*\(total sent 20 ok 0 429 20 errors 0\)", final), final
    # Summaries came every interval while it ran, not only at the end.
    assert len(re.findall(r"last \d+ s \|", log)) >= 2
    # Every request reached the gateway as that customer: one usage event each.
    events = wait_for(lambda: len(usage_events(usage_server)) >= 60 and usage_events(usage_server))
    by_customer = {}
    for event in events:
        by_customer.setdefault(event["customer"], []).append(event["outcome"])
    assert sorted(by_customer["acme"]) == ["completed"] * 40
    assert sorted(by_customer["globex"]) == ["refused"] * 20


def test_a_customer_without_its_key_in_the_environment_is_refused_by_name(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAFFIC_")}
    done = subprocess.run(
        [sys.executable, "-m", "dataplane.traffic", "--client", f"acme={trace}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert "TRAFFIC_KEY_ACME" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "dataplane.traffic", "--client", f"acme={tmp_path}/missing.csv"],
        cwd=ROOT, env={**env, "TRAFFIC_KEY_ACME": "mu0.x"}, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert done.returncode == 2
    assert "missing.csv" in done.stderr
