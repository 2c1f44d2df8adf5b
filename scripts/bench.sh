#!/usr/bin/env bash
# make bench: services up, then every bench/bench_*.py on a throwaway PostgreSQL database.
# Arguments select benchmarks by substring: ./scripts/bench.sh api_auth
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin

export DATABASE_URL="${BENCH_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/controlplane_bench}"
export REDIS_URL="${BENCH_REDIS_URL:-redis://127.0.0.1:6379/14}"
export SECRET_KEY="bench-only-secret-key-not-for-production-0123456789abcdef"
# A test-only Ed25519 pair (capacity/publication/signing.py): the control plane signs its
# publications, and every gateway a test starts verifies them.
export PUBLICATION_SIGNING_KEY="${PUBLICATION_SIGNING_KEY:-test:ncbmrhSrJXNCfQdaZVeooMVPM6bWLV0nsT/j5OyWiBw=}"
export GATEWAY_PUBLICATION_KEYS="${GATEWAY_PUBLICATION_KEYS:-test:HZ8I5mvoL/mJtCYV6U0Qh9CKe3+HUNfY64TWY5lRRKA=}"
export DEBUG=0
export SECURE_SSL_REDIRECT=0
# The benches measure the code path, not the per-key limits a production deployment sets.
export API_THROTTLE_WRITES=none API_THROTTLE_USAGE=none API_THROTTLE_READS=none API_THROTTLE_EXPORTS=none

$BIN/python scripts/services.py bench
$BIN/python -m bench "$@"
