"""Make sure PostgreSQL and Redis answer, starting installed-but-stopped servers.

    python scripts/services.py test   # PostgreSQL at DATABASE_URL and Redis at REDIS_URL
    python scripts/services.py redis  # Redis only; starts a private one under var/ if needed

Uses the start commands of this project's machines (see README, "Services").
"""

import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import redis

ROOT = Path(__file__).resolve().parent.parent
WAIT_SECONDS = 30


def _redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        return bool(client.ping())
    except redis.RedisError:
        return False


def _postgres_answers(url: str) -> str | None:
    """None when it answers, else the reason."""
    parsed = urlparse(url)
    try:
        with psycopg.connect(
            host=parsed.hostname or "127.0.0.1",
            port=parsed.port or 5432,
            user=parsed.username or "postgres",
            password=parsed.password or None,
            dbname="postgres",
            connect_timeout=2,
        ):
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


def ensure_postgres(url: str) -> None:
    if _postgres_answers(url) is None:
        print(f"PostgreSQL answers at {urlparse(url).hostname}:{urlparse(url).port or 5432}.")
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


def ensure_redis(url: str, *, private_dir: Path | None) -> None:
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


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "test"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if mode == "test":
        ensure_postgres(os.environ["DATABASE_URL"])
        ensure_redis(redis_url, private_dir=None)
    elif mode == "redis":
        ensure_redis(redis_url, private_dir=ROOT / "var" / "redis")
    else:
        sys.exit(f"unknown mode {mode!r}: use 'test' or 'redis'")


if __name__ == "__main__":
    main()
