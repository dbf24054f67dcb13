#!/usr/bin/env bash
# The GPU check: runs a small PyTorch training loop under `tracer trace --stack` on a real NVIDIA
# GPU, once with the default caching allocator and once with expandable segments, and compares
# what tracer stored with what PyTorch says about itself (torch.cuda.memory_stats()); runs the loop
# to a natural OOM beside a co-tenant holding all but 3 GiB of the device and compares who tracer
# says held it with PyTorch's snapshot at the OOM; measures the cost (untraced, traced, traced
# --stack, interleaved); keeps `tracer explain`'s report. Needs no network. Run as root, with a tracer built elsewhere:
#
#   scripts/gpu-check.sh OUTDIR [--tracer PATH] [--steps N] [--rounds N (0: no cost)] [--python PATH]
#   scripts/gpu-check.sh OUTDIR --simulated     # the same check on the simulated runtime (no GPU;
#                                               # tests the check itself, says nothing of a GPU)
#
# OUTDIR receives summary.txt, summary.json, explain-default.txt, explain-expandable.txt,
# explain-co-tenant.txt, trace-default.db.gz, trace-expandable.db.gz, log.txt, and cases/ (the
# recorded cases: PyTorch's account, its snapshots, tracer's database, explain and layout of each).
# GPU_CHECK_KEEP=DIR keeps the working files (each run's statistics, database, logs) in DIR.
# Exit status: 0 every comparison equal or explained, or no GPU here (it says so); 1 a comparison
# differs or a step failed; 2 bad arguments; 3 tracing cannot work on this machine (it says why).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
tracer="${TRACER:-$repo/target/release/tracer}"
python="${PYTHON:-python3}"
steps=150
rounds=5
simulated=0
out=""

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --tracer) tracer=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --simulated) simulated=1; shift ;;
    -h|--help) usage ;;
    -*) echo "gpu-check: unknown option $1" >&2; usage ;;
    *) [ -z "$out" ] || usage; out=$1; shift ;;
  esac
done
[ -n "$out" ] || usage
case "$steps$rounds" in *[!0-9]*) echo "gpu-check: --steps and --rounds take whole numbers" >&2; exit 2 ;; esac
if [ ! -x "$tracer" ]; then
  echo "gpu-check: no tracer binary at $tracer: build it (cargo build --release -p tracer-cli) or pass --tracer PATH" >&2
  exit 2
fi
tracer=$(cd "$(dirname "$tracer")" && pwd)/$(basename "$tracer")
mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out"/summary.txt "$out"/summary.json "$out"/explain-*.txt "$out"/trace-*.db.gz "$out"/log.txt
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
children=()
cleanup() {
  for p in "${children[@]}"; do kill "$p" 2>/dev/null || true; done
  if [ -n "${GPU_CHECK_KEEP:-}" ]; then mkdir -p "$GPU_CHECK_KEEP" && cp -r "$work"/. "$GPU_CHECK_KEEP"/; fi
  rm -rf "$work"
}
trap cleanup EXIT
exec > >(tee -a "$out/log.txt") 2>&1

say() { printf 'gpu-check: %s\n' "$*"; }
# Ends the check with a one-line summary (kept in summary.txt) and an exit status.
finish() {
  local status=$1; shift
  say "$*"
  printf 'tracer GPU check\n\n%s\n' "$*" >"$out/summary.txt"
  exit "$status"
}

# 1. The machine -------------------------------------------------------------------------------
kernel=$(uname -r)
gvisor=no
if [ "$kernel" = "4.4.0" ] || { command -v dmesg >/dev/null && dmesg 2>/dev/null | grep -qi gvisor; }; then
  gvisor=yes
fi
say "kernel $kernel$([ $gvisor = yes ] && echo ' (gVisor)')"
say "tracer $("$tracer" --version)"
if [ "$simulated" = 1 ]; then
  gpu="simulated CUDA runtime (demos/simcuda): NOT a GPU; this run tests the check itself"
  driver="none"
  workload="$here/gpu_check/sim_workload.py"
  bash "$repo/demos/simcuda/build.sh" "$work/sim" >/dev/null
  workload_args=(--cudart "$work/sim/libcudart.so.12")
  torch_version="none"
else
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! smi=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1); then
    finish 0 "no NVIDIA GPU on this machine (nvidia-smi ${smi:-not found}): nothing to check here"
  fi
  gpu=$(printf '%s' "$smi" | head -1 | cut -d, -f1,3 | sed 's/, */, /')
  driver=$(printf '%s' "$smi" | head -1 | cut -d, -f2 | tr -d ' ')
  workload="$here/gpu_check/torch_workload.py"
  workload_args=()
  if ! torch_version=$("$python" -c 'import torch, sys; print(torch.__version__, "CUDA", torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)' 2>&1); then
    finish 1 "$python cannot use the GPU through PyTorch: $torch_version"
  fi
fi
say "GPU $gpu; driver $driver; PyTorch $torch_version; $("$python" --version 2>&1)"

"$tracer" check || true
if ! "$tracer" check --json >"$work/check.json" 2>"$work/check.err"; then
  why=$("$python" -c 'import json,sys; r=json.load(open(sys.argv[1])); print("; ".join(c["name"]+": "+c["detail"] for c in r["checks"] if c["required"] and not c["ok"]))' "$work/check.json" 2>/dev/null || cat "$work/check.err")
  if [ $gvisor = yes ]; then
    why="this machine runs under gVisor, a user-space kernel with no BPF and no uprobes, so no eBPF tracer can work here ($why)"
  fi
  finish 3 "tracing cannot work on this machine: $why"
fi

"$python" - "$work/machine.json" "$kernel" "$gvisor" "$gpu" "$driver" "$torch_version" "$("$tracer" --version)" "$simulated" <<'PY'
import json, sys, platform
keys = ("kernel", "gvisor", "gpu", "driver", "pytorch", "tracer", "simulated")
m = dict(zip(keys, sys.argv[2:]))
m["python"] = platform.python_version()
json.dump(m, open(sys.argv[1], "w"))
PY

# 2. Runs ----------------------------------------------------------------------------------------
wait_for() { # file, seconds, pid that must stay alive, what
  local i=0
  while [ ! -s "$1" ]; do
    kill -0 "$3" 2>/dev/null || return 1
    i=$((i + 1)); [ $i -lt $(($2 * 20)) ] || return 1
    sleep 0.05
  done
}

# run SETUP(untraced|traced|auto|stack) MODE(default|expandable) NAME [--oom]: the workload, traced as
# asked from its first allocation; leaves $work/NAME/{stats.json,trace.db,trace.jsonl}.
run() {
  local setup=$1 mode=$2 name=$3; shift 3
  # A stopped tracer leaves removing its paused probes to a process of that name: a timed run
  # must not pay for their traps.
  case $name in
    cost-*)
      local i=0
      while grep -qsx tracer-detach /proc/[0-9]*/comm && [ $i -lt 1200 ]; do sleep 0.1; i=$((i + 1)); done
      ;;
  esac
  local dir="$work/$name" env=() extra=()
  mkdir -p "$dir"
  if [ "$mode" = expandable ]; then
    if [ "$simulated" = 1 ]; then extra+=(--expandable); else env+=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); fi
  fi
  env "${env[@]}" PYTHONUNBUFFERED=1 "$python" "$workload" "${workload_args[@]}" "${extra[@]}" "$@" \
    --steps "$steps" --ready "$dir/ready" --go "$dir/go" --stats "$dir/stats.json" >"$dir/workload.log" 2>&1 &
  local wpid=$! tpid=""
  children+=("$wpid")
  if ! wait_for "$dir/ready" 180 "$wpid"; then
    cat "$dir/workload.log"; say "$name: the workload did not get ready"; return 1
  fi
  if [ "$setup" != untraced ]; then
    local flags=(--pid "$wpid" --json --quiet --db "$dir/trace.db")
    [ "$setup" = stack ] && flags+=(--stack)
    # auto: PyTorch's allocator probes armed only under pressure (none in this loop).
    [ "$setup" = auto ] && flags+=(--allocator auto)
    "$tracer" trace "${flags[@]}" >"$dir/trace.jsonl" 2>"$dir/trace.err" &
    tpid=$!
    children+=("$tpid")
    if ! wait_for "$dir/trace.jsonl" 60 "$tpid"; then
      cat "$dir/trace.err"; say "$name: tracer did not start"; return 1
    fi
  fi
  touch "$dir/go"
  local rc=0
  wait "$wpid" || rc=$?
  if [ -n "$tpid" ]; then
    # tracer stops by itself once the traced process is gone (it looks every second).
    local i=0
    while kill -0 "$tpid" 2>/dev/null && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
    kill -INT "$tpid" 2>/dev/null || true
    wait "$tpid" || { cat "$dir/trace.err"; say "$name: tracer failed"; return 1; }
  fi
  if [ $rc -ne 0 ] || [ ! -s "$dir/stats.json" ]; then
    cat "$dir/workload.log"; say "$name: the workload failed (exit $rc)"; return 1
  fi
}

# GPU_CHECK_ONLY_CASES=1: the recorded cases alone (2d; no comparisons, no cost).
only_cases=${GPU_CHECK_ONLY_CASES:-}
compared() {
for mode in default expandable; do
  say "checking the $mode allocator (traced with --stack, $steps steps, then a provoked OOM)"
  run stack "$mode" "check-$mode" --oom
  sed 's/^/    /' "$work/check-$mode/trace.err"
  "$python" "$here/gpu_check/report.py" compare --tracer "$tracer" --db "$work/check-$mode/trace.db" \
    --stats "$work/check-$mode/stats.json" --mode "$mode" -o "$work/compare-$mode.json"
  "$tracer" explain --db "$work/check-$mode/trace.db" >"$out/explain-$mode.txt" 2>&1 || true
  gzip -9 -c "$work/check-$mode/trace.db" >"$out/trace-$mode.db.gz"
done

# 2b. whatif: the default run's requests replayed with expandable segments, against that run --
"$tracer" whatif --db "$work/check-default/trace.db" --conf expandable_segments:True --no-search --json \
  >"$work/whatif.json" 2>"$work/whatif.err" || cat "$work/whatif.err"
"$python" - "$work/whatif.json" "$work/check-expandable/stats.json" <<'PY' || true
import json, sys
w, s = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
f, row = w["fidelity"], w["rows"][1]
real = s["final"]["reserved_bytes.all.peak"]
sim = row["peak_reserved"]
print("gpu-check: whatif: the default run %s (%d of %d blocks where the allocator put them); "
      "with expandable_segments:True it predicts %s and peak reserved %d B; the expandable run: "
      "%d OOMs, peak reserved %d B (%+.1f %%)" % (
          "reproduced" if f["holds"] else "NOT reproduced", f["placements_matched"], f["placements"],
          "no OOM" if row["oom_request"] is None else "an OOM at request %d" % row["oom_request"],
          sim, s["final"]["num_ooms"] - s["baseline"]["num_ooms"], real,
          100.0 * (sim - real) / real if real else 0.0))
PY

# 2c. A co-tenant: another process takes all but a few GiB of the device once the trace runs;
# the training loop then runs to a natural OOM. tracer traces both; what it says of who held the
# device is compared with PyTorch's snapshot at the OOM instant and with the other process.
co_tenant() {
  local dir="$work/co-tenant" leave=$((3 << 30)) holder_args=()
  mkdir -p "$dir"
  if [ "$simulated" = 1 ]; then
    export SIMCUDA_SHARED_DEVICES="$dir/shared-gpu"
    holder_args=(--cudart "$work/sim/libcudart.so.12")
  fi
  PYTHONUNBUFFERED=1 "$python" "$here/gpu_check/holder.py" "${holder_args[@]}" --leave "$leave" \
    --ready "$dir/holder-ready" --go "$dir/holder-go" --held "$dir/holder.json" --done "$dir/holder-done" \
    >"$dir/holder.log" 2>&1 &
  local hpid=$!
  children+=("$hpid")
  PYTHONUNBUFFERED=1 "$python" "$workload" "${workload_args[@]}" --steps 5 --until-oom \
    --ready "$dir/ready" --go "$dir/go" --stats "$dir/stats.json" >"$dir/workload.log" 2>&1 &
  local wpid=$!
  children+=("$wpid")
  wait_for "$dir/holder-ready" 180 "$hpid" || { cat "$dir/holder.log"; say "co-tenant: the other process did not start"; return 1; }
  wait_for "$dir/ready" 180 "$wpid" || { cat "$dir/workload.log"; say "co-tenant: the workload did not get ready"; return 1; }
  "$tracer" trace --pid "$hpid" --pid "$wpid" --stack --json --quiet --db "$dir/trace.db" >"$dir/trace.jsonl" 2>"$dir/trace.err" &
  local tpid=$!
  children+=("$tpid")
  wait_for "$dir/trace.jsonl" 60 "$tpid" || { cat "$dir/trace.err"; say "co-tenant: tracer did not start"; return 1; }
  touch "$dir/holder-go"
  wait_for "$dir/holder.json" 180 "$hpid" || { cat "$dir/holder.log"; say "co-tenant: the other process took nothing"; return 1; }
  touch "$dir/go"
  local rc=0
  wait "$wpid" || rc=$?
  touch "$dir/holder-done"
  wait "$hpid" || true
  local i=0
  while kill -0 "$tpid" 2>/dev/null && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
  kill -INT "$tpid" 2>/dev/null || true
  wait "$tpid" || { cat "$dir/trace.err"; say "co-tenant: tracer failed"; return 1; }
  unset SIMCUDA_SHARED_DEVICES
  if [ $rc -ne 0 ] || [ ! -s "$dir/stats.json" ]; then
    cat "$dir/workload.log"; say "co-tenant: the workload failed (exit $rc)"; return 1
  fi
  "$python" "$here/gpu_check/report.py" co-tenant --tracer "$tracer" --db "$dir/trace.db" \
    --stats "$dir/stats.json" --holder "$dir/holder.json" -o "$work/co-tenant.json"
  "$tracer" explain --db "$dir/trace.db" >"$out/explain-co-tenant.txt" 2>&1 || true
  sed -n '/^Who held/,/^$/p' "$out/explain-co-tenant.txt"
}
say "checking a co-tenant (another process holds all but 3 GiB; the loop runs to a natural OOM)"
co_tenant_json=()
if co_tenant; then co_tenant_json=(--co-tenant "$work/co-tenant.json"); fi
}
if [ -z "$only_cases" ]; then compared; fi

# 2d. Recorded cases (real GPU only): CUDA graphs in a shared private pool, torch.compile's graph
# trees, a serving engine's start-up (and one whose KV cache leaves too little for its captures), a
# per-process memory fraction's refusal, and a training loop run to an OOM beside a co-tenant with
# its memory history ring wrapped and the trace begun mid-run (default and expandable). Each traced
# with --stack; PyTorch's own account (phases, memory_stats, its snapshot with segment_pool_id) kept
# beside tracer's database in OUTDIR/cases/ as test data. GPU_CHECK_CASES picks some (space-separated).
recorded_case() { # NAME CASE CONF(default|expandable) HOLD(0|1) [args]
  local name=$1 kind=$2 conf=$3 hold=$4; shift 4
  local dir="$work/case-$name" env=() hpid="" pids=()
  mkdir -p "$dir" "$out/cases"
  [ "$conf" = expandable ] && env+=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
  if [ "$hold" = 1 ]; then
    PYTHONUNBUFFERED=1 "$python" "$here/gpu_check/holder.py" --leave $((3 << 30)) --ready "$dir/holder-ready" \
      --go "$dir/holder-go" --held "$dir/holder.json" --done "$dir/holder-done" >"$dir/holder.log" 2>&1 &
    hpid=$!; children+=("$hpid"); pids+=(--pid "$hpid")
    wait_for "$dir/holder-ready" 180 "$hpid" || { cat "$dir/holder.log"; say "case $name: the other process did not start"; return 1; }
  fi
  env "${env[@]}" PYTHONUNBUFFERED=1 timeout 150 "$python" "$here/gpu_check/cases.py" "$kind" "$@" \
    --snapshot "$dir/snapshot.pickle.gz" --ready "$dir/ready" --go "$dir/go" --stats "$dir/stats.json" \
    >"$dir/workload.log" 2>&1 &
  local wpid=$!; children+=("$wpid")
  wait_for "$dir/ready" 240 "$wpid" || { tail -20 "$dir/workload.log"; say "case $name: the workload did not get ready"; return 1; }
  local real; real=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$dir/ready")
  pids+=(--pid "$real")
  "$tracer" trace "${pids[@]}" --stack --json --quiet --db "$dir/trace.db" >"$dir/trace.jsonl" 2>"$dir/trace.err" &
  local tpid=$!; children+=("$tpid")
  wait_for "$dir/trace.jsonl" 60 "$tpid" || { cat "$dir/trace.err"; say "case $name: tracer did not start"; return 1; }
  if [ -n "$hpid" ]; then
    touch "$dir/holder-go"
    wait_for "$dir/holder.json" 180 "$hpid" || { cat "$dir/holder.log"; say "case $name: the other process took nothing"; return 1; }
  fi
  touch "$dir/go"
  local rc=0
  wait "$wpid" || rc=$?
  [ -n "$hpid" ] && { touch "$dir/holder-done"; wait "$hpid" || true; }
  local i=0
  while kill -0 "$tpid" 2>/dev/null && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
  kill -INT "$tpid" 2>/dev/null || true
  wait "$tpid" || say "case $name: tracer exited non-zero"
  grep '^phase' "$dir/workload.log" | sed 's/^/    /'
  grep -v '^phase' "$dir/workload.log" | tail -5 | sed 's/^/    /'
  say "case $name: workload exit $rc; $(wc -c <"$dir/trace.db" 2>/dev/null || echo 0) B of trace"
  "$tracer" explain --db "$dir/trace.db" >"$dir/explain.txt" 2>&1 || true
  sed -n '1,60p' "$dir/explain.txt" | sed 's/^/    | /'
  "$tracer" layout --db "$dir/trace.db" --at oom >"$dir/layout-oom.txt" 2>&1 || true
  # Each segment's pool as tracer saw the captures, and the start-up ledger, to compare with
  # PyTorch's snapshot (segment_pool_id) and its phases (stats.json) on this machine later.
  "$tracer" layout --db "$dir/trace.db" --json >"$dir/layout-end.json" 2>/dev/null || true
  "$tracer" explain --db "$dir/trace.db" --json >"$dir/explain.json" 2>/dev/null || true
  # tracer's pools (each segment's, from the captures and the allocator's pool calls it saw)
  # against PyTorch's own snapshot at every phase.
  "$python" "$here/gpu_check/pools.py" "$tracer" "$dir/trace.db" "$dir/stats.json" >"$dir/pools.txt" 2>&1 || true
  grep -E 'DIFFERS|rows differ' "$dir/pools.txt" | tail -12 | sed 's/^/    pools: /'
  gzip -9 -f "$dir/trace.db"
  cp "$dir"/stats.json "$out/cases/$name-stats.json" 2>/dev/null || true
  cp "$dir"/holder.json "$out/cases/$name-holder.json" 2>/dev/null || true
  cp "$dir"/trace.db.gz "$out/cases/$name-trace.db.gz" 2>/dev/null || true
  cp "$dir"/explain.txt "$out/cases/$name-explain.txt" 2>/dev/null || true
  cp "$dir"/layout-oom.txt "$out/cases/$name-layout-oom.txt" 2>/dev/null || true
  cp "$dir"/layout-end.json "$out/cases/$name-layout-end.json" 2>/dev/null || true
  cp "$dir"/explain.json "$out/cases/$name-explain.json" 2>/dev/null || true
  cp "$dir"/pools.txt "$out/cases/$name-pools.txt" 2>/dev/null || true
  cp "$dir"/workload.log "$out/cases/$name-workload.log" 2>/dev/null || true
  for s in "$dir"/snapshot*.pickle.gz; do [ -f "$s" ] && cp "$s" "$out/cases/$name-$(basename "$s")"; done
  return 0
}
if [ "$simulated" = 0 ]; then
  for c in ${GPU_CHECK_CASES:-graphs mempool engine engine-oom fraction ring-oom-default ring-oom-expandable compiled}; do
    say "recording case $c"
    case $c in
      graphs) recorded_case graphs graphs default 0 ;;
      compiled) recorded_case compiled compiled default 0 ;;
      mempool) recorded_case mempool mempool default 0 ;;
      graph-reset) recorded_case graph-reset graph-reset default 0 ;;
      engine) recorded_case engine engine default 0 --gpu-memory-utilization 0.90 ;;
      engine-oom) recorded_case engine-oom engine default 0 --gpu-memory-utilization 0.999 --profile-rows 1024 --rows-per-seq 16 ;;
      fraction) recorded_case fraction fraction default 0 --fraction 0.02 ;;
      ring-oom-default) recorded_case ring-oom-default ring-oom default 1 --warm-steps 40 --history 3000 ;;
      ring-oom-expandable) recorded_case ring-oom-expandable ring-oom expandable 1 --warm-steps 40 --history 3000 ;;
    esac || say "case $c failed"
  done
fi

# 3. Cost: the same steps untraced, traced, traced with --allocator auto and traced with --stack,
# interleaved ----------------------------------------------------------------------------------
if [ -n "$only_cases" ]; then
  say "results in $out: $(cd "$out" && ls | tr '\n' ' ')"
  exit 0
fi
cost_json=()
[ "$rounds" -gt 0 ] && cost_json=(--cost "$work/cost.json")
echo '[' >"$work/runs.json"
sep=""
for r in $(seq 1 "$rounds"); do
  for setup in untraced traced auto stack; do
    run "$setup" default "cost-$setup-$r"
    printf '%s{"setup": "%s", "round": %d, "stats": "%s", "trace": "%s"}\n' "$sep" "$setup" "$r" \
      "$work/cost-$setup-$r/stats.json" "$work/cost-$setup-$r/trace.jsonl" >>"$work/runs.json"
    sep=","
  done
done
echo ']' >>"$work/runs.json"
[ "$rounds" -gt 0 ] && "$python" "$here/gpu_check/report.py" cost --runs "$work/runs.json" -o "$work/cost.json"

# 4. Summary -------------------------------------------------------------------------------------
status=0
"$python" "$here/gpu_check/report.py" summary --machine "$work/machine.json" \
  --compare "$work/compare-default.json" "$work/compare-expandable.json" "${cost_json[@]}" "${co_tenant_json[@]}" \
  --out-text "$out/summary.txt" --out-json "$out/summary.json" || status=$?
say "results in $out: $(cd "$out" && ls | tr '\n' ' ')"
exit $status
