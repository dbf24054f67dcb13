#!/bin/bash
# Run as root in a scratch directory after `cargo build --release` and demos/simcuda/build.sh.
# Footprint under --max-db while a reader copies the database (VACUUM INTO) every 15 s.
ROOT=$(cd "$(dirname "$0")/../.." && pwd); S=$ROOT/target/simcuda; T=$ROOT/target/release/tracer; DB=$PWD/f.db
rm -f f.db* copy.db copies.log
$T trace --quiet --json --lib $S/libcudart.so.12 --lib $S/libsimtorch.so --db $DB --max-db 256MiB > trace.out 2> trace.err &
sleep 5
SIMCUDA_MEM=512MiB SIMCUDA_LATENCY=default=0 $S/simjob --cudart $S/libcudart.so.12 --seconds 180 --rate 600000 > job.out 2>&1 &
JOB=$!
peak=0; copies=0; last=$(date +%s)
while kill -0 $JOB 2>/dev/null; do
  f=$(( $(stat -c %s $DB 2>/dev/null || echo 0) + $(stat -c %s $DB-wal 2>/dev/null || echo 0) ))
  [ $f -gt $peak ] && peak=$f
  now=$(date +%s)
  if [ $((now - last)) -ge 15 ]; then last=$now; rm -f copy.db; (sqlite3 -readonly $DB "VACUUM INTO '$PWD/copy.db'" && echo copy >> copies.log) & fi
  sleep 0.2
done
wait $JOB
pkill -INT -f "tracer trace --quiet --json --lib $S/libcudart.so.12 --lib $S/libsimtorch.so --db $DB"
sleep 5
echo "peak footprint $peak bytes ($(echo "scale=1; $peak/1048576" | bc) MiB), copies $(wc -l < copies.log)"
grep -o '"dropped_ring_full":[0-9]*' trace.out
