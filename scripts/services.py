"""Make sure PostgreSQL and Redis answer, starting installed-but-stopped servers.

    python scripts/services.py test   # PostgreSQL at DATABASE_URL and Redis at REDIS_URL,
                                      # the Prometheus binary the tests start and the Chromium
                                      # the browser tests drive, Pango (invoice PDFs) and
                                      # pdftotext (all installed with apt-get when missing)
    python scripts/services.py bench  # PostgreSQL, Redis, and wrk (apt-get)
    python scripts/services.py redis  # Redis only; starts a private one under var/ if needed

Uses the start commands of this project's machines (see README, "Services").
"""

import ctypes.util
import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import psycopg.sql
import redis

ROOT = Path(__file__).resolve().parent.parent
WAIT_SECONDS = 30
# The tests start their own Prometheus from this binary (tests/support/prometheus_server.py):
# Debian's
# `prometheus` package puts it here.
PROMETHEUS_BINARY = Path("/usr/bin/prometheus")
CHROMIUM_BINARY = Path(os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"))
PDFTOTEXT_BINARY = Path("/usr/bin/pdftotext")
DEJAVU_FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")


def _redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        return bool(client.ping())
    except redis.RedisError:
        return False


def _connect_to_server(url: str, **options):
    """A connection to the server the URL names (its maintenance database `postgres`)."""
    parsed = urlparse(url)
    return psycopg.connect(
        host=parsed.hostname or "127.0.0.1",
        port=parsed.port or 5432,
        user=parsed.username or "postgres",
        password=parsed.password or None,
        dbname="postgres",
        connect_timeout=2,
        **options,
    )


def _postgres_answers(url: str) -> str | None:
    """None when it answers, else the reason."""
    try:
        with _connect_to_server(url):
            return None
    except psycopg.Error as error:
        return str(error).strip()


def _wait(check, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    sys.exit(f"{what} did not start answering within {WAIT_SECONDS} s.")


def ensure_database(url: str) -> None:
    """Create the database the URL names, so Django's checks against it find it (the tests
    themselves run in a test_ copy that pytest creates)."""
    parsed = urlparse(url)
    name = parsed.path.lstrip("/")
    if not name:
        return
    with _connect_to_server(url, autocommit=True) as connection:
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [name]
        ).fetchone()
        if not exists:
            connection.execute(
                psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name))
            )
            print(f"Created database {name}.")


def ensure_postgres(url: str) -> None:
    """PostgreSQL answers at `url`, started from the machine's own service when it does not."""
    if _postgres_answers(url) is None:
        print(f"PostgreSQL answers at {urlparse(url).hostname}:{urlparse(url).port or 5432}.")
        ensure_database(url)
        return
    clusters = sorted(glob.glob("/etc/postgresql/*"))
    if not shutil.which("pg_ctlcluster") or not clusters:
        sys.exit(
            "PostgreSQL does not answer at DATABASE_URL and no local cluster is installed. "
            "Install it (Debian: apt-get install postgresql) or point DATABASE_URL at a server."
        )
    version = os.path.basename(clusters[-1])
    print(f"Starting PostgreSQL {version} ...")
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"], check=False
    )
    _wait(lambda: _postgres_answers(url) is None, "PostgreSQL")
    ensure_database(url)


def ensure_redis(url: str, *, private_dir: Path | None) -> None:
    """Redis answers at `url`; when it does not, one is started (in `private_dir`, if given)."""
    if _redis_answers(url):
        print(f"Redis answers at {url}.")
        return
    if not shutil.which("redis-server"):
        sys.exit(
            f"Nothing answers at REDIS_URL={url} and redis-server is not installed. "
            "Install it (Debian: apt-get install redis-server; macOS: brew install redis) "
            "or point REDIS_URL at a running Redis."
        )
    parsed = urlparse(url)
    port = str(parsed.port or 6379)
    if private_dir is None:
        print("Starting Redis ...")
        os.makedirs("/var/lib/redis", exist_ok=True)
        os.makedirs("/var/log/redis", exist_ok=True)
        command = [
            "redis-server",
            "--daemonize",
            "yes",
            "--bind",
            "127.0.0.1",
            "-::1",
            "--port",
            port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            "/var/lib/redis",
            "--logfile",
            "/var/log/redis/ci.log",
        ]
    else:
        private_dir.mkdir(parents=True, exist_ok=True)
        print(f"Starting a private Redis on port {port} under {private_dir} ...")
        command = [
            "redis-server",
            "--daemonize",
            "yes",
            "--bind",
            parsed.hostname or "127.0.0.1",
            "--port",
            port,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(private_dir),
            "--logfile",
            str(private_dir / "redis.log"),
            "--pidfile",
            str(private_dir / "redis.pid"),
        ]
    subprocess.run(command, check=True)
    _wait(lambda: _redis_answers(url), "Redis")


def _apt_get(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["apt-get", *args],
        # needrestart, when installed, would otherwise scan every process after the install.
        env=os.environ | {"DEBIAN_FRONTEND": "noninteractive", "NEEDRESTART_SUSPEND": "1"},
        check=False,
    )


def _apt_knows(package: str) -> bool:
    """Whether the package lists, as they are now, have a candidate version of the package."""
    result = subprocess.run(
        ["apt-cache", "policy", package], capture_output=True, text=True, check=False
    )
    return "Candidate:" in result.stdout and "Candidate: (none)" not in result.stdout


def _stop_packaged_prometheus() -> None:
    """Stops and disables the daemon the package installs to run on :9090.

    The tests start their own servers on free ports and never use it; left running (or
    starting at the next boot), it would scrape and store for nothing on every machine that
    `make test` installed it on. Only called right after this script installed the package,
    so nobody relied on that daemon.
    """
    quiet = {"check": False, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        subprocess.run(["systemctl", "disable", "--now", "prometheus.service"], **quiet)
    elif Path("/etc/init.d/prometheus").exists():
        subprocess.run(["/etc/init.d/prometheus", "stop"], **quiet)
        if shutil.which("update-rc.d"):
            subprocess.run(["update-rc.d", "prometheus", "disable"], **quiet)


def _ensure_debian_package(
    binary: Path, package: str, *, after_install=None, installed=None
) -> None:
    """Installs a Debian package when its binary is missing (or `installed()` says it is not).

    The tests that need it (a real Prometheus, a real browser, pdftotext) fail rather than
    skip without it, so that a fresh machine does not pass by testing less.
    """
    present = installed if installed is not None else binary.exists
    if present():
        print(f"{package} is installed ({binary}).")
        return
    if not shutil.which("apt-get"):
        sys.exit(
            f"{binary} is missing and this is not a Debian-like system: install {package} "
            "so that the binary is at that path (the tests start it themselves)."
        )
    if os.geteuid() != 0:
        sys.exit(
            f"{binary} is missing; installing it needs root. Run "
            f"`sudo apt-get install --no-install-recommends {package}`, then `make test` again."
        )
    print(f"Installing {package} (apt-get install {package}) ...", flush=True)
    # Refreshing the package lists is the slow part; only do it when they cannot serve the
    # install (never fetched, or stale enough that the install fails).
    if not _apt_knows(package):
        _apt_get("update", "-q")
    install = ("install", "-y", "-q", "--no-install-recommends", package)
    if _apt_get(*install).returncode != 0:
        _apt_get("update", "-q")
        if _apt_get(*install).returncode != 0:
            sys.exit(f"apt-get could not install {package}; see its output above.")
    if after_install is not None:
        after_install()
    if not present():
        sys.exit(f"the {package} package is installed but {binary} is not there.")


def ensure_prometheus() -> None:
    """The Prometheus reader's tests run against a real server scraping the engine emulator."""
    _ensure_debian_package(PROMETHEUS_BINARY, "prometheus", after_install=_stop_packaged_prometheus)


def ensure_chromium() -> None:
    """The planner UI's browser tests drive Debian's Chromium through Playwright."""
    _ensure_debian_package(CHROMIUM_BINARY, "chromium")


def ensure_wrk() -> None:
    """make bench measures the load runner against wrk's ceiling (bench/bench_runner.py)."""
    _ensure_debian_package(Path("/usr/bin/wrk"), "wrk")


def ensure_fonts() -> None:
    """The invoice PDF names DejaVu Sans; without any font Pango would lay out no glyphs."""
    _ensure_debian_package(DEJAVU_FONT, "fonts-dejavu-core")


def ensure_pdftotext() -> None:
    """The invoice PDF tests read what they rendered back with poppler's pdftotext."""
    _ensure_debian_package(PDFTOTEXT_BINARY, "poppler-utils")


def ensure_pango() -> None:
    """WeasyPrint (invoice PDFs, billing/pdf.py) lays text out with the system's Pango."""
    _ensure_debian_package(
        Path("libpangoft2-1.0.so.0"),
        "libpangoft2-1.0-0",
        installed=lambda: ctypes.util.find_library("pangoft2-1.0") is not None,
    )


def main() -> None:
    """`test` or `run`: make sure the services the mode needs answer."""
    mode = sys.argv[1] if len(sys.argv) > 1 else "test"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if mode == "test":
        ensure_postgres(os.environ["DATABASE_URL"])
        ensure_redis(redis_url, private_dir=None)
        ensure_prometheus()
        ensure_chromium()
        ensure_pango()
        ensure_fonts()
        ensure_pdftotext()
    elif mode == "bench":
        ensure_postgres(os.environ["DATABASE_URL"])
        ensure_redis(redis_url, private_dir=None)
        ensure_wrk()
    elif mode == "redis":
        ensure_redis(redis_url, private_dir=ROOT / "var" / "redis")
    else:
        sys.exit(f"unknown mode {mode!r}: use 'test', 'bench' or 'redis'")


if __name__ == "__main__":
    main()
