#!/usr/bin/env bash
# make run: migrate, seed a demo, start web + worker + beat on the embedded defaults, the demo's
# data plane (supervisor, emulators, gateway) and its traffic. Ctrl-C stops everything this
# script started.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin

export DEBUG="${DEBUG:-1}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
PORT="${PORT:-8000}"
EMULATOR_PORT="${EMULATOR_PORT:-8101}"
SUPERVISOR_PORT="${SUPERVISOR_PORT:-8190}"
REPLICA_BASE_PORT="${REPLICA_BASE_PORT:-8111}"
GATEWAY_PORT="${GATEWAY_PORT:-8080}"
HOST="${HOST:-127.0.0.1}"
DEMO_PLANNER="${DEMO_PLANNER:-planner}"
export PLANNER_PASSWORD="${DEMO_PLANNER_PASSWORD:-demo-planner-password}"
# acme's owner and member in the customer portal (seed_demo makes them with this password).
export DEMO_PORTAL_PASSWORD="${DEMO_PORTAL_PASSWORD:-demo-portal-password}"
# The traffic generator: 0 turns it off; DEMO_TRAFFIC_SCALE multiplies its request rates.
DEMO_TRAFFIC="${DEMO_TRAFFIC:-1}"
DEMO_TRAFFIC_SCALE="${DEMO_TRAFFIC_SCALE:-1}"
# Logs and beat's pid file go here (a second demo, e.g. the browser test's, uses its own).
RUN_DIR="${RUN_DIR:-var}"
LOG="$RUN_DIR/log"
mkdir -p "$LOG"

# The demo's webhook deployment is signed with a secret made for this run: the emulator checks
# it (EMULATOR_WEBHOOK_SECRET) and the control plane reads it under a name its actuators may
# read (ACTUATOR_SECRET_ENV_NAMES allows MU_ACTUATOR_* by default; seed_demo names it).
MU_ACTUATOR_DEMO_WEBHOOK_SECRET="$($BIN/python -c 'import secrets; print(secrets.token_hex(32))')"
export MU_ACTUATOR_DEMO_WEBHOOK_SECRET
export EMULATOR_WEBHOOK_SECRET="$MU_ACTUATOR_DEMO_WEBHOOK_SECRET"
# Likewise the process supervisor's bearer token (PROCESS_SUPERVISOR_TOKEN on its side).
MU_ACTUATOR_DEMO_SUPERVISOR_TOKEN="$($BIN/python -c 'import secrets; print(secrets.token_hex(32))')"
export MU_ACTUATOR_DEMO_SUPERVISOR_TOKEN
# Each secret goes only to the listener it belongs to (a config naming it for any other host or
# port is refused): the token to this run's supervisor, the signing secret to its emulator.
printf -v DEMO_SECRET_DESTINATIONS '{"MU_ACTUATOR_DEMO_SUPERVISOR_TOKEN": {"supervisor": ["http://%s:%s"]}, "MU_ACTUATOR_DEMO_WEBHOOK_SECRET": {"webhook": ["http://%s:%s"]}}' \
  "$HOST" "$SUPERVISOR_PORT" "$HOST" "$EMULATOR_PORT"
export ACTUATOR_SECRET_DESTINATIONS="${ACTUATOR_SECRET_DESTINATIONS:-$DEMO_SECRET_DESTINATIONS}"
# Publications to the gateway are signed with a key pair made for this run (manage.py
# publication_keys): the control plane holds the private half, the gateway the public one.
if [ -z "${PUBLICATION_SIGNING_KEY:-}" ]; then
  PUBLICATION_KEY_PAIR="$($BIN/python -c 'from capacity.publication.signing import generate; print(" ".join(generate("run")))')"
  PUBLICATION_SIGNING_KEY="${PUBLICATION_KEY_PAIR%% *}"
  GATEWAY_PUBLICATION_KEYS="${PUBLICATION_KEY_PAIR#* }"
fi
export PUBLICATION_SIGNING_KEY
export GATEWAY_PUBLICATION_KEYS="${GATEWAY_PUBLICATION_KEYS:-$($BIN/python -c 'import os, sys; from capacity.publication.signing import public_spec; print(public_spec(os.environ["PUBLICATION_SIGNING_KEY"]))')}"
# Everything runs on $HOST; the default allow-list covers loopback only.
case "$HOST" in
  127.*|localhost|::1) ;;
  *) export OUTBOUND_ALLOWED_HOSTS="${OUTBOUND_ALLOWED_HOSTS:-127.0.0.0/8,::1/128,localhost,$HOST}" ;;
esac

pids=()
cleanup() {
  trap - INT TERM EXIT
  echo; echo "Stopping ..."
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -f var/redis/redis.pid ]; then
    kill "$(cat var/redis/redis.pid)" 2>/dev/null || true
    rm -f var/redis/redis.pid
  fi
}
trap cleanup INT TERM EXIT

$BIN/python scripts/services.py redis
$BIN/python manage.py migrate --noinput
# migrate ran Django's system checks; the commands after it skip them (~1.5 s each).
$BIN/python manage.py collectstatic --noinput --verbosity 0 --skip-checks
$BIN/python manage.py create_planner "$DEMO_PLANNER" --skip-password-validation --skip-checks
echo "== demo data"
SEED_OUTPUT="$($BIN/python manage.py seed_demo --skip-checks --emulator-url "http://$HOST:$EMULATOR_PORT" \
  --supervisor-url "http://$HOST:$SUPERVISOR_PORT" --replica-base-port "$REPLICA_BASE_PORT")"
printf '%s\n' "$SEED_OUTPUT"
# The keys' secrets are shown once, on the terminal, and kept in this process's memory only:
# the log keeps each key's prefix (what the admin and the API show), never its secret.
printf '%s\n' "$SEED_OUTPUT" | sed -E 's/(key: *[A-Za-z0-9]+)\.[^ ]+/\1.<secret shown once>/' \
  > "$LOG/seed_demo.log"
seed_key() { printf '%s\n' "$SEED_OUTPUT" | sed -n "s/^$1  *key: *//p" | tail -1; }
# The gateway posts usage with the demo's service key; the traffic comes with the customers'.
GATEWAY_SERVICE_KEY="$(seed_key 'Service  *gateway')"
export GATEWAY_SERVICE_KEY
DEMO_CUSTOMER_KEY="$(seed_key 'Customer acme')"
GLOBEX_KEY="$(seed_key 'Customer globex')"
$BIN/python manage.py setup_periodic_tasks --skip-checks

# The engine emulator stands in for the data plane (a vLLM fleet) in the demo, with priority
# scheduling, as seed_demo's priority_scheduling=True on its deployments says (admission's
# classes and the health probes send vLLM `priority`, refused under fcfs):
# - llama-8b-h100: the process actuator; the supervisor runs one emulator process per replica
#   on consecutive ports from REPLICA_BASE_PORT, the way a GPU host runs vLLM processes;
# - llama-8b-l40s: the webhook actuator; one emulator scales its in-process replicas.
PROCESS_SUPERVISOR_TOKEN="$MU_ACTUATOR_DEMO_SUPERVISOR_TOKEN" \
  $BIN/python -m dataplane.supervisor --host "$HOST" --port "$SUPERVISOR_PORT" \
  --log-dir "$LOG/replicas" \
  --engine "llama-3.1-8b=$PWD/$BIN/python -m dataplane.emulator --host $HOST --port {port} --config dataplane/emulator/demo-replica.json --scheduling-policy priority" \
  > "$LOG/supervisor.log" 2>&1 &
pids+=($!)
$BIN/python -m dataplane.emulator --host "$HOST" --port "$EMULATOR_PORT" \
  --config dataplane/emulator/demo.json --scheduling-policy priority \
  > "$LOG/emulator.log" 2>&1 &
pids+=($!)

# The gateway in front of the emulator: reads the contract the control plane publishes to Redis
# (docs/gateway-contract.md), admits, routes, posts usage to the API.
# A demo stopped with Ctrl-C need not wait a minute for the traffic generator's streams.
GATEWAY_HOST="$HOST" GATEWAY_PORT="$GATEWAY_PORT" GATEWAY_REDIS_URL="$REDIS_URL" \
  GATEWAY_CONTROL_PLANE_URL="http://$HOST:$PORT" GATEWAY_SHUTDOWN_GRACE_SECONDS=5 \
  $BIN/python -m dataplane.gateway > "$LOG/gateway.log" 2>&1 &
pids+=($!)

$BIN/gunicorn controlplane.wsgi:application --bind "$HOST:$PORT" --workers 2 \
  --access-logfile "$LOG/web.log" --error-logfile "$LOG/web.log" &
pids+=($!)
# Three workers (controlplane/workers.py): the long work (benchmarks, what-ifs, billing), the
# allocation tick with what feeds it (never behind a long task), and the health probes.
for worker in main loop health; do
  # shellcheck disable=SC2046  # the arguments are words
  $BIN/celery -A controlplane worker $($BIN/python -m controlplane.workers "$worker") \
    --loglevel INFO --logfile "$LOG/$worker-worker.log" &
  pids+=($!)
done
$BIN/celery -A controlplane beat --loglevel INFO --logfile "$LOG/beat.log" \
  --pidfile "$RUN_DIR/beat.pid" &
pids+=($!)

# Demo traffic through the gateway (dataplane/traffic): Azure's conversation trace as acme, well
# within its 300 MU/min reservation (~5 req/s, ~13 MU/min), and its bursty code trace as globex,
# best-effort (~7 req/s), which the fleet grows for. seed_demo's week of history
# (simulation/data/scenarios/demo_week_*.csv) averages the same rates.
if [ "$DEMO_TRAFFIC" != "0" ]; then
  traffic_scale() { awk -v base="$1" -v k="$DEMO_TRAFFIC_SCALE" 'BEGIN { print base * k }'; }
  TRAFFIC_KEY_ACME="$DEMO_CUSTOMER_KEY" TRAFFIC_KEY_GLOBEX="$GLOBEX_KEY" \
    $BIN/python -m dataplane.traffic --gateway-url "http://$HOST:$GATEWAY_PORT/v1" \
    --model llama-3.1-8b \
    --client "acme=simulation/data/traces/AzureLLMInferenceTrace_conv_2023.csv@$(traffic_scale 0.9)" \
    --client "globex=simulation/data/traces/AzureLLMInferenceTrace_code_2023.csv@$(traffic_scale 2.7)" \
    > "$LOG/traffic.log" 2>&1 &
  pids+=($!)
  TRAFFIC_LINE="acme and globex replay Azure traces through the gateway ($LOG/traffic.log;
               DEMO_TRAFFIC=0 turns it off)"
else
  TRAFFIC_LINE="off (DEMO_TRAFFIC=0)"
fi

# The URLs below are printed once the web server and the gateway answer (a first request sent
# as soon as the banner shows would otherwise find nothing listening yet).
$BIN/python - "http://$HOST:$PORT/healthz" "http://$HOST:$GATEWAY_PORT/healthz" <<'PY' || true
import sys, time, urllib.request
deadline = time.monotonic() + 60
for url in sys.argv[1:]:
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        print(f"(not answering yet after 60 s: {url})")
PY

cat <<MSG

Model-Unit Control Plane is running (logs in $LOG/):
  Planner UI   http://$HOST:$PORT/planner/   user: $DEMO_PLANNER  password: $PLANNER_PASSWORD
  Portal       http://$HOST:$PORT/portal/   user: acme-owner (or acme-member, read-only)  password: $DEMO_PORTAL_PASSWORD
  API docs     http://$HOST:$PORT/api/docs/
  API          http://$HOST:$PORT/api/v1/
  Admin        http://$HOST:$PORT/admin/   user: $DEMO_PLANNER  password: $PLANNER_PASSWORD
  Health       http://$HOST:$PORT/healthz   http://$HOST:$PORT/readyz
  Replicas     llama-8b-h100's emulators on ports $REPLICA_BASE_PORT+ (/v1/models, /metrics), run by the
               process supervisor at http://$HOST:$SUPERVISOR_PORT (its API takes only this run's token)
  Emulator     http://$HOST:$EMULATOR_PORT/v1/models   (llama-8b-l40s, scaled by webhook; metrics: /metrics)
  Gateway      http://$HOST:$GATEWAY_PORT/v1   (OpenAI-compatible, with a customer key above; metrics: /metrics)
  Traffic      $TRAFFIC_LINE

Try a request through the gateway with acme's demo key (once the health probes found the
replica ready, within a minute of starting):
  curl -N http://$HOST:$GATEWAY_PORT/v1/chat/completions -H "Authorization: Bearer $DEMO_CUSTOMER_KEY" \
    -H 'Content-Type: application/json' \
    -d '{"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hello"}], "stream": true}'

Try a benchmark of the demo deployment against the emulator (a few minutes):
  .venv/bin/python manage.py run_benchmark --suite demo-quick --deployment llama-8b-h100 --wait
Press Ctrl-C to stop.
MSG
# Stop everything as soon as any one of them dies.
wait -n "${pids[@]}"
echo "A process exited; see $LOG/."
