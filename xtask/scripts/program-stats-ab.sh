#!/usr/bin/env bash
# Side by side: the eBPF programs' own time per pair (kernel BPF stats), old vs new binary.
set -u
# usage: program-stats-ab.sh OLD_TRACER NEW_TRACER SIMCUDA_DIR (run as root)
OLD=$1 NEW=$2
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
SIM=$3 LIB=$SIM/libcudart.so.12 N=200000
one() { # bin label mode workload
  local bin=$1 label=$2 mode=$3 wl=$4 db=$work/ps-$RANDOM.db
  $bin trace --program-stats --json --quiet --lib $LIB $mode --db $db >$work/ps.out 2>$work/ps.err &
  local tp=$!
  for i in $(seq 100); do grep -q '"started"' $work/ps.out 2>/dev/null && break; sleep 0.1; done
  if [ "$wl" = c ]; then SIMCUDA_LATENCY=default=0 $SIM/simdriver --iters $N --mix pairs >/dev/null; pairs=$N
  else python3 "$(dirname "$0")/py_pairs.py" $LIB 20000 20 1.5 >/dev/null; pairs=20000; fi
  kill -INT $tp; wait $tp
  python3 - "$label" "$mode" "$wl" "$pairs" "$work/ps.out" <<'P'
import json,sys
label,mode,wl,pairs=sys.argv[1],sys.argv[2],sys.argv[3],int(sys.argv[4])
for l in open(sys.argv[5]):
    j=json.loads(l)
    if j.get('type')=='summary' or 'programs' in j:
        progs=[p for p in j.get('programs',[]) if p['name'] in ('call_entry','call_return','call_site','flush_stage')]
        tot=sum(p['run_time_ns'] for p in progs)
        print(f"{label:4} {mode or 'plain':8} {wl:2} {tot/pairs:8.0f} ns/pair  " + ", ".join(f"{p['name']} {p['ns_per_run']:.0f}" for p in progs))
P
  rm -f $db*
}
for r in 1 2 3; do
  for mode in "" "--stack"; do for wl in c py; do
    [ "$mode" = "" ] && [ "$wl" = py ] && continue
    one $OLD old "$mode" $wl; one $NEW new "$mode" $wl
  done; done
done
