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
# tests.support.worker_env gives each xdist worker its own Redis database; it must load before Django's
# settings, so it is a plugin (-p) and the repository is on the path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORKERS="${TEST_WORKERS:-4}"
# A pass's exit status: 5 means its arguments selected no test (e.g. `-k` of a serial test), fine.
passed() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }
mkdir -p var

# Two passes at once, on two cores:
# - the tests marked `serial` measure real throughput or latency (engines, the runner, a whole
#   `make run` within two minutes); they run one at a time at normal CPU priority. Most of
#   their time they wait on the processes they drive;
# - everything else runs on WORKERS xdist workers at nice 10, and so do the processes they
#   start: they take the CPU the timing-sensitive tests leave idle, and a tenth of it when
#   those want it all (nice 10 weighs 110 against nice 0's 1024: low enough not to disturb a
#   measurement, high enough that a process they start is never starved for a minute). The
#   end-to-end tests among them wait for real processes (ticks, probes), hence more workers
#   than cores. Linux shares the CPU equally between sessions (autogroup scheduling) whatever
#   their processes' nice, so the pass runs in a session of its own whose autogroup is niced
#   too.
# The timing-sensitive pass has its own Redis database (the one below the workers'), test
# database (no worker suffix), port slice (tests/support/processes.py) and temp folder.
echo "== pytest: timing-sensitive tests alone (PostgreSQL), beside the rest on $WORKERS workers at nice 10"
SERIAL_LOG=var/test-serial.log
REDIS_URL="${REDIS_URL%/*}/$(( ${REDIS_URL##*/} - WORKERS ))" \
  $BIN/pytest --create-db -m serial --durations=10 --basetemp=var/pytest-serial "$@" \
  > "$SERIAL_LOG" 2>&1 &
serial_pid=$!
# In a background job of a script (no job control) setsid need not fork: $! is pytest's pid,
# its session's and its process group's id.
( exec setsid bash -c 'echo 10 > /proc/self/autogroup 2>/dev/null || true; exec nice -n 10 "$@"' \
    niced $BIN/pytest -p tests.support.worker_env -n "$WORKERS" --maxschedchunk 1 --create-db \
    -m "not serial" --durations=15 "$@" ) &
parallel_pid=$!
# Interrupted (Ctrl-C), make test stops both passes (the niced one is in a session of its own).
trap 'kill "$serial_pid" 2>/dev/null; kill -- "-$parallel_pid" 2>/dev/null; exit 130' INT TERM
set +e
wait "$parallel_pid"
parallel_status=$?
wait "$serial_pid"
serial_status=$?
set -e
trap - INT TERM
echo "== pytest (PostgreSQL, timing-sensitive tests, run beside the pass above)"
cat "$SERIAL_LOG"
passed "$parallel_status" || exit "$parallel_status"
passed "$serial_status" || exit "$serial_status"

# `make run` uses SQLite: the paths its demo exercises run again there (an in-memory test
# database), so a query that only PostgreSQL gets right cannot hide behind the test database.
echo "== pytest (SQLite: the paths the demo uses)"
set +e
DATABASE_URL="sqlite:///$PWD/var/test-sqlite.sqlite3" \
  $BIN/pytest -p tests.support.worker_env -n "$WORKERS" --create-db \
  -m "both_databases and not postgresql_only and not serial" "$@"
status=$?
set -e
passed "$status" || exit "$status"
