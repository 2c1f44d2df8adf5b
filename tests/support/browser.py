"""A real browser on the real server: Debian's Chromium driven by Playwright, against the
control plane under gunicorn on the test database. Nothing is downloaded at run time.

Screenshots go to var/screenshots/ (SCREENSHOT_DIR overrides), one per page a test visits.
"""

import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.once import run_folder, run_lock
from tests.support.servers import ROOT, gunicorn_server

CHROMIUM_PATH = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
SCREENSHOT_DIR = Path(os.environ.get("SCREENSHOT_DIR", ROOT / "var" / "screenshots"))
# Chromium without the calls home a closed network refuses (and waits on).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PLANNER_PASSWORD = "planner-password-123"


@contextmanager
def async_unsafe_allowed():
    """Playwright's sync API keeps an event loop on this thread; the test's own ORM calls are
    plain synchronous code, so Django's guard against ORM use inside a loop is lifted while
    the browser is open."""
    old = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = old


# Per module, not per session: Django's async-unsafe guard is lifted only while a browser
# is open, so the rest of the suite (and `check --deploy`) runs with it in place.
@pytest.fixture(scope="module")
def chromium():
    if not Path(CHROMIUM_PATH).exists():
        pytest.fail(
            f"{CHROMIUM_PATH} is missing: `make test` installs Debian's chromium package "
            "(scripts/services.py); set CHROMIUM_PATH to use another Chromium."
        )
    from playwright.sync_api import sync_playwright

    with async_unsafe_allowed(), sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM_PATH, headless=True, args=CHROMIUM_ARGS
        )
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def collected_static(tmp_path_factory) -> Path:
    """The static files as a deployment serves them (collectstatic, then WhiteNoise).

    Collected once per pytest run, not once per xdist worker (tests/support/once.py):
    WhiteNoise compresses every file, half a minute of CPU each time."""
    root = run_folder(tmp_path_factory) / "collected-static"
    with run_lock(tmp_path_factory, "collected-static"):
        if not (root / ".complete").exists():
            subprocess.run(
                [sys.executable, "manage.py", "collectstatic", "--noinput", "--verbosity", "0"],
                cwd=ROOT,
                env=os.environ | {"STATIC_ROOT": str(root)},
                check=True,
            )
            (root / ".complete").touch()
    return root


# One server for the whole session: it holds no state between tests (the database is
# flushed between transactional tests, sessions included), and each start costs seconds.
@pytest.fixture(scope="session")
def site(django_db_setup, django_db_blocker, collected_static, tmp_path_factory):
    """The base URL of the control plane under gunicorn, over plain HTTP on loopback."""
    env = {
        "STATIC_ROOT": str(collected_static),
        # Loopback HTTP: the cookies cannot be Secure-only here.
        "SESSION_COOKIE_SECURE": "0",
        "CSRF_COOKIE_SECURE": "0",
    }
    folder = tmp_path_factory.mktemp("site")
    with (
        django_db_blocker.unblock(),
        gunicorn_server(folder, workers=2, threads=4, env=env) as url,
    ):
        yield url


@pytest.fixture
def page(chromium, request):
    context = chromium.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.shots = []
    yield page
    context.close()


def screenshot(page, name: str) -> Path:
    """Save the whole page as var/screenshots/<test>--<name>.png and return the path."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "test").split("::")[-1].split(" ")[0]
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOT_DIR / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', test)}--{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def log_in(page, site: str, username: str, password: str = PLANNER_PASSWORD) -> None:
    page.goto(site + "/login/")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_load_state("networkidle")


def chart_points(page, selector="canvas[data-chart]") -> list[int]:
    """Points Chart.js drew per dataset of the first chart: proof the chart rendered."""
    page.wait_for_function(
        "s => { const c = document.querySelector(s); return c && Chart.getChart(c); }",
        arg=selector,
    )
    return page.evaluate(
        "s => Chart.getChart(document.querySelector(s)).data.datasets"
        ".map(d => d.data.filter(v => v !== null).length)",
        selector,
    )
