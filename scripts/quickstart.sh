#!/usr/bin/env bash
# Installs what is missing, then traces a workload on the simulated CUDA runtime (no GPU needed)
# and shows what was stored. Needs root for the tracing itself.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --locked --release -p tracer-cli >&2
sim=target/simcuda
bash demos/simcuda/build.sh "$sim" >/dev/null
tracer=target/release/tracer
db=${TRACER_DB:-target/quickstart.db}
rm -f "$db" "$db-wal" "$db-shm"
"$tracer" trace --db "$db" --lib "$sim/libcudart.so.12" --lib "$sim/libcuda.so.1" --duration 4s --quiet &
trace_pid=$!
sleep 1.5   # attach
SIMCUDA_DEVICES=2 SIMCUDA_LATENCY="cudaMalloc=80us,cudaFree=20us,default=2us" \
  "$sim/simdriver" --mix all --threads 2 --iters 200 --device 0 >/dev/null
wait "$trace_pid"
echo
echo "== calls per op, from $db =="
"$tracer" query --db "$db" "SELECT op, count(*) AS calls, sum(ret != 0) AS errors,
  sum(CASE WHEN ret = 0 THEN size END) AS bytes, cast(avg(duration_ns) AS int) AS avg_ns
  FROM events GROUP BY op ORDER BY calls DESC"
