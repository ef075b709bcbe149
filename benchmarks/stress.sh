#!/usr/bin/env bash
# Hostile load on a real server: `fulcrum serve` on stories260K (loopback), 1,000 concurrent
# streams x 3 rounds, 30% hanging up mid-stream, 5% never reading; then the server is stopped
# with SIGTERM and must exit 0. Extra flags pass through to `fulcrum bench stress`.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8137}
fulcrum serve ../shared/models/stories260K --port "$PORT" --uvicorn-log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    sleep 1
done
fulcrum bench stress --base-url "http://127.0.0.1:$PORT" --num-clients 1000 --rounds 3 \
    --save-result benchmarks/results/stress_stories260k.json "$@"
kill -TERM $SERVER
wait $SERVER
trap - EXIT
