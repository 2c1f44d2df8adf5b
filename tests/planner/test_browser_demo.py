"""A fresh `make run`, as a new user meets it: the fleet, customer and allocation pages show data
in every chart, at least one scaling decision, and no red box, within two minutes; and acme's
owner finds its chart and its live requests' receipts in the customer portal.

The real demo: `scripts/run.sh` itself (migrate, seed_demo with its week of simulated history,
gunicorn, the Celery workers and beat, the process supervisor and its emulator replicas, the
webhook emulator, the gateway and the traffic generator) on a fresh SQLite file, its own free
ports and a private Redis, driven by Chromium. Nothing of the test database is used.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import redis
from playwright.sync_api import expect

from tests.dataplane.supervisor.support import free_port_range
from tests.support.browser import log_in, screenshot
from tests.support.processes import ROOT, free_port

DEMO_PASSWORD = "demo-planner-password"
DEMO_PORTAL_PASSWORD = "demo-portal-password"
WITHIN_SECONDS = 120
# What a planner reads as trouble: the planner's problem boxes, error messages, failed pushes.
RED = ".problem, .messages li.error, .badge.failed"
# The settings a developer's shell would not have: the demo runs on its embedded defaults.
NOT_INHERITED = ("DATABASE_URL", "REDIS_URL", "CACHE_REDIS_URL", "ADMISSION_REDIS_URL",
                 "SECRET_KEY", "DEBUG", "SECURE_SSL_REDIRECT", "DJANGO_SETTINGS_MODULE",
                 "STATIC_ROOT", "PROMETHEUS_MULTIPROC_DIR")  # fmt: skip


@contextmanager
def private_redis(tmp_path: Path):
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis.from_url(url, socket_timeout=1).ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@contextmanager
def make_run(tmp_path: Path):
    """scripts/run.sh on free ports; yields (planner URL, the run's log folder)."""
    run_dir = tmp_path / "run"
    with private_redis(tmp_path) as redis_url:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
        env.update(
            PORT=str(port),
            GATEWAY_PORT=str(free_port()),
            EMULATOR_PORT=str(free_port()),
            SUPERVISOR_PORT=str(free_port()),
            REPLICA_BASE_PORT=str(free_port_range(8)),
            HOST="127.0.0.1",
            REDIS_URL=redis_url,
            DATABASE_URL=f"sqlite:///{tmp_path / 'demo.sqlite3'}",
            STATIC_ROOT=str(tmp_path / "static"),
            RUN_DIR=str(run_dir),
            TRAFFIC_SUMMARY_SECONDS="5",
        )
        log = open(tmp_path / "run.log", "w")  # noqa: SIM115 - closed below
        process = subprocess.Popen(
            ["./scripts/run.sh"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            yield f"http://127.0.0.1:{port}", run_dir / "log", process
        finally:
            # As Ctrl-C: run.sh stops what it started; then anything left in its session.
            if process.poll() is None:
                os.kill(process.pid, signal.SIGINT)
                with suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=40)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                time.sleep(2)
            log.close()


def wait_until(check, *, deadline: float, what: str, every: float = 2.0):
    from playwright.sync_api import Error as BrowserError

    last = None
    while True:
        try:
            value = check()
        except (AssertionError, BrowserError) as error:
            # Not yet: an assertion about the page, or the server not answering yet.
            value, last = None, error
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WITHIN_SECONDS} s: {what} ({last})")
        time.sleep(every)


def charts_with_data(page) -> dict[str, bool]:
    """Each drawn chart on the page: does any series hold a point?"""
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('canvas[data-chart]')].map(c => {
             const spec = JSON.parse(document.getElementById(c.dataset.chart).textContent);
             const drawn = !!(window.Chart && Chart.getChart(c));
             const points = spec.data.datasets.some(d => d.data.some(v => v !== null));
             return [c.getAttribute('aria-label') || c.dataset.chart, drawn && points];
           }))"""
    )


def red_boxes(page) -> list[str]:
    return [text.strip() for text in page.locator(RED).all_inner_texts()]


@pytest.mark.serial
def test_a_fresh_demo_shows_data_decisions_and_no_red_box_within_two_minutes(chromium, tmp_path):
    started = time.monotonic()
    deadline = started + WITHIN_SECONDS
    with make_run(tmp_path) as (site, logs, process):
        page = chromium.new_context(viewport={"width": 1360, "height": 900}).new_page()
        page.set_default_timeout(20_000)

        def planner_up():
            assert process.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            page.goto(site + "/login/")
            return True

        wait_until(planner_up, deadline=deadline, what="the planner answers", every=1.0)
        timeline = {"planner answers": time.monotonic() - started}
        log_in(page, site, "planner", DEMO_PASSWORD)

        def fleet_ready():
            page.goto(site + "/planner/")
            charts = charts_with_data(page)
            assert len(charts) == 2 and all(charts.values()), charts
            assert not red_boxes(page), red_boxes(page)
            return True

        wait_until(fleet_ready, deadline=deadline, what="the fleet page")
        timeline["fleet charts"] = time.monotonic() - started
        expect(page.get_by_test_id("demo-history")).to_be_visible()
        screenshot(page, "fleet")

        for slug in ("acme", "globex"):

            def customer_ready(slug=slug):
                page.goto(f"{site}/planner/customers/{slug}/")
                charts = charts_with_data(page)
                assert len(charts) == 1 and all(charts.values()), charts
                assert not red_boxes(page), red_boxes(page)
                return True

            wait_until(customer_ready, deadline=deadline, what=f"{slug}'s page")
            screenshot(page, f"customer-{slug}")
        page.goto(site + "/planner/customers/")
        screenshot(page, "customers")

        def live_decision():
            page.goto(site + "/planner/allocation/")
            decisions = page.locator("h2:text('Decisions') ~ table").first
            rows = decisions.locator("tbody tr").all_inner_texts()
            # A scaling decision of the live loop itself, applied through the process actuator.
            live = [row for row in rows if "process" in row and "applied" in row]
            assert live, rows[:5]
            assert not red_boxes(page), red_boxes(page)
            return live

        live = wait_until(live_decision, deadline=deadline, what="a live scaling decision")
        timeline["live decision"] = time.monotonic() - started
        screenshot(page, "allocation")

        def replica_chart():
            page.goto(site + "/planner/allocation/deployments/llama-8b-h100/")
            charts = charts_with_data(page)
            assert len(charts) == 1 and all(charts.values()), charts
            assert not red_boxes(page), red_boxes(page)
            return True

        wait_until(replica_chart, deadline=deadline, what="llama-8b-h100's replica chart")
        screenshot(page, "allocation-llama-8b-h100")

        def traffic_answered():
            text = (logs / "traffic.log").read_text()
            totals = re.findall(r"acme: .*?\(total sent (\d+) ok (\d+) ", text)
            assert totals and int(totals[-1][1]) > 0, text[-1500:]
            return totals[-1]

        # The live traffic went through the gateway and was answered.
        acme = wait_until(traffic_answered, deadline=deadline, what="acme's traffic answered")
        timeline["acme answered"] = time.monotonic() - started

        # acme's owner, in the customer portal, with the password run.sh printed: its chart,
        # and receipts of the live requests the gateway metered.
        page.get_by_role("button", name="Log out").click()
        log_in(page, site, "acme-owner", DEMO_PORTAL_PASSWORD)

        def portal_ready():
            page.goto(site + "/portal/acme/")
            charts = charts_with_data(page)
            assert len(charts) == 1 and all(charts.values()), charts
            page.goto(site + "/portal/acme/usage/")
            assert page.get_by_test_id("receipts").locator("tbody tr").count() > 0
            assert not red_boxes(page), red_boxes(page)
            return True

        wait_until(portal_ready, deadline=deadline, what="acme's portal")
        timeline["portal"] = time.monotonic() - started
        screenshot(page, "portal-acme-usage")
        print(
            "demo: "
            + ", ".join(f"{k} at {v:.0f} s" for k, v in timeline.items())
            + f"; acme sent/ok {acme}; live decision {live[0]!r}"
        )
        page.context.close()
