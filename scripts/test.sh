#!/usr/bin/env bash
# make test: services up, then lint, format, import contracts, types, migration check and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin

export DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/controlplane}"
export REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
export SECRET_KEY="${SECRET_KEY:-test-only-secret-key-not-for-production-0123456789abcdef}"
export DEBUG=0
export SECURE_SSL_REDIRECT=0

$BIN/python scripts/services.py test
echo "== ruff check";            $BIN/ruff check .
echo "== ruff format --check";   $BIN/ruff format --check .
# The dependency order between packages and the pure modules' freedom from Django
# (pyproject.toml, [tool.importlinter]); strict types on the pure modules ([tool.mypy]).
echo "== lint-imports";           $BIN/lint-imports
echo "== mypy";                   $BIN/mypy
echo "== makemigrations --check"; $BIN/python manage.py makemigrations --check --dry-run
# 5 from pytest: the arguments selected no test for a pass (e.g. `-k` of a serial test), fine.
run_pass() { "$@" || { status=$?; [ "$status" -eq 5 ] || exit "$status"; }; }
# tests.support.worker_env gives each xdist worker its own Redis database; it must load before Django's
# settings, so it is a plugin (-p) and the repository is on the path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "== pytest (PostgreSQL, ${TEST_WORKERS:-3} workers)"
# The slowest tests are printed: the budget of make test is ten minutes.
run_pass $BIN/pytest -p tests.support.worker_env -n "${TEST_WORKERS:-3}" --maxschedchunk 1 --create-db \
  -m "not serial" --durations=15 "$@"
# Tests that measure real throughput or latency would measure the other worker's load too.
echo "== pytest (PostgreSQL, timing-sensitive tests alone)"
run_pass $BIN/pytest --create-db -m serial --durations=10 "$@"
# `make run` uses SQLite: the paths its demo exercises run again there (an in-memory test
# database), so a query that only PostgreSQL gets right cannot hide behind the test database.
echo "== pytest (SQLite: the paths the demo uses)"
DATABASE_URL="sqlite:///$PWD/var/test-sqlite.sqlite3" \
  run_pass $BIN/pytest -p tests.support.worker_env -n "${TEST_WORKERS:-3}" --create-db \
  -m "both_databases and not postgresql_only and not serial" "$@"
