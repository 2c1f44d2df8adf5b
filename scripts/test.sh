#!/usr/bin/env bash
# make test: services up, then lint, format check, migration check and pytest on PostgreSQL.
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
echo "== makemigrations --check"; $BIN/python manage.py makemigrations --check --dry-run
echo "== pytest (PostgreSQL)"
$BIN/pytest --create-db "$@"
# `make run` uses SQLite: the paths its demo exercises run again there (an in-memory test
# database), so a query that only PostgreSQL gets right cannot hide behind the test database.
echo "== pytest (SQLite: the paths the demo uses)"
status=0
DATABASE_URL="sqlite:///$PWD/var/test-sqlite.sqlite3" \
  $BIN/pytest --create-db -m "both_databases and not postgresql_only" "$@" || status=$?
# 5: the arguments selected no such test (e.g. `-k` of a PostgreSQL-only test), not a failure.
if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then exit "$status"; fi
