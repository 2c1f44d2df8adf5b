#!/usr/bin/env bash
# make test: services up, then lint, format, import contracts, types, migration check and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin

export DATABASE_URL="${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/controlplane}"
export REDIS_URL="${TEST_REDIS_URL:-redis://127.0.0.1:6379/15}"
export SECRET_KEY="${SECRET_KEY:-test-only-secret-key-not-for-production-0123456789abcdef}"
# A test-only Ed25519 pair (capacity/publication/signing.py): the control plane signs its
# publications, and every gateway a test starts verifies them.
export PUBLICATION_SIGNING_KEY="${PUBLICATION_SIGNING_KEY:-test:ncbmrhSrJXNCfQdaZVeooMVPM6bWLV0nsT/j5OyWiBw=}"
export GATEWAY_PUBLICATION_KEYS="${GATEWAY_PUBLICATION_KEYS:-test:HZ8I5mvoL/mJtCYV6U0Qh9CKe3+HUNfY64TWY5lRRKA=}"
export DEBUG=0
export SECURE_SSL_REDIRECT=0

$BIN/python scripts/services.py test
echo "== ruff check";            $BIN/ruff check .
echo "== ruff format --check";   $BIN/ruff format --check .
# The dependency order between packages and the pure modules' freedom from Django
# (pyproject.toml, [tool.importlinter]); types over every package ([tool.mypy]: strict on the
# pure modules, the data plane, the planner and the portal), read with django-stubs' plugin,
# which loads the settings from the environment exported above.
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
#
# `make run` uses SQLite: the paths its demo exercises run again there (an in-memory test
# database), so a query that only PostgreSQL gets right cannot hide behind the test database.
# That third pass runs beside the other two, on SQLITE_WORKERS workers in a niced session of
# its own: the PostgreSQL passes leave a core idle part of the time (tests waiting on the
# processes they drive), and run one after the other the three took 10.5 minutes on two cores.
# Its workers have Redis databases below the timing-sensitive pass's, port slices after the
# parallel pass's (TEST_PORT_SLICE_OFFSET) and a temp folder of their own.
SQLITE_WORKERS="${TEST_SQLITE_WORKERS:-2}"
echo "== pytest: timing-sensitive tests alone (PostgreSQL), beside the rest on $WORKERS workers at nice 10, and the SQLite pass on $SQLITE_WORKERS"
SERIAL_LOG=var/test-serial.log
SQLITE_LOG=var/test-sqlite.log
REDIS_URL="${REDIS_URL%/*}/$(( ${REDIS_URL##*/} - WORKERS ))" \
  $BIN/pytest --create-db -m serial --durations=10 --basetemp=var/pytest-serial "$@" \
  > "$SERIAL_LOG" 2>&1 &
serial_pid=$!
# The niced passes each run in a session of its own. Called as the last command of a background
# subshell, niced execs setsid, which need not fork there (no job control): the subshell's pid,
# $!, becomes pytest's pid, its session's and its process group's id.
niced() {
  exec setsid bash -c 'echo 10 > /proc/self/autogroup 2>/dev/null || true; exec nice -n 10 "$@"' niced "$@"
}
( niced $BIN/pytest -p tests.support.worker_env -n "$WORKERS" --maxschedchunk 1 --create-db \
    -m "not serial" --durations=15 "$@" ) &
parallel_pid=$!
( export DATABASE_URL="sqlite:///$PWD/var/test-sqlite.sqlite3" \
    REDIS_URL="${REDIS_URL%/*}/$(( ${REDIS_URL##*/} - WORKERS - 1 ))" \
    TEST_PORT_SLICE_OFFSET=$(( WORKERS + 1 ))
  exec > "$SQLITE_LOG" 2>&1
  niced $BIN/pytest -p tests.support.worker_env -n "$SQLITE_WORKERS" --create-db \
    --basetemp=var/pytest-sqlite -m "both_databases and not postgresql_only and not serial" \
    --durations=5 "$@" ) &
sqlite_pid=$!
# Interrupted (Ctrl-C), make test stops every pass (the niced ones are in sessions of their own).
trap 'kill "$serial_pid" 2>/dev/null; kill -- "-$parallel_pid" "-$sqlite_pid" 2>/dev/null; exit 130' INT TERM
set +e
wait "$parallel_pid"
parallel_status=$?
wait "$serial_pid"
serial_status=$?
wait "$sqlite_pid"
sqlite_status=$?
set -e
trap - INT TERM
echo "== pytest (PostgreSQL, timing-sensitive tests, run beside the pass above)"
cat "$SERIAL_LOG"
echo "== pytest (SQLite: the paths the demo uses, run beside the passes above)"
cat "$SQLITE_LOG"
passed "$parallel_status" || exit "$parallel_status"
passed "$serial_status" || exit "$serial_status"
passed "$sqlite_status" || exit "$sqlite_status"
