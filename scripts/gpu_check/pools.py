"""Compares tracer's pools with PyTorch's own at each phase of a recorded case.

Usage: pools.py TRACER DB STATS.json

STATS.json is cases.py's account: each phase has its wall time and, from
torch.cuda.memory_snapshot(), per pool id ("0,0" the default pools, else a CUDA graph's or a
MemPool's) the segments, reserved, allocated and free bytes. For each phase this asks
`tracer layout --at WALL_NS --json` and prints one line per pool and figure: tracer's value,
PyTorch's, and whether they are equal. The last line counts the rows that differ. Exit 0 unless
tracer fails: a difference is data, not an error.
"""

import json
import subprocess
import sys

FIGURES = ("segments", "reserved", "allocated", "free")


def tracer_pools(tracer, db, wall_ns, pid):
    """Per pool id ("a,b"), tracer's figures summed over the process's devices."""
    out = subprocess.run([tracer, "layout", "--db", db, "--at", str(wall_ns), "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        if "no device allocations" in out.stderr:
            return {}
        sys.exit("pools.py: tracer layout --at %d: %s" % (wall_ns, out.stderr.strip()))
    pools = {}
    for proc in json.loads(out.stdout):
        if pid is not None and proc["pid"] != pid:
            continue
        for dev in proc["devices"]:
            default = pools.setdefault("0,0", dict.fromkeys(FIGURES, 0))
            for _name, p in dev.get("pools", []):
                default["reserved"] += p["reserved"]
                default["allocated"] += p["allocated"]
            segs = [s for s in proc.get("segments", [])
                    if s["device"] == dev["device"] and s.get("pool_id") is None]
            default["segments"] += len(segs)
            default["free"] += default_free(segs)
            for p in dev.get("private_pools", []):
                key = "%d,%d" % tuple(p["id"])
                mine = pools.setdefault(key, dict.fromkeys(FIGURES, 0))
                for f in FIGURES:
                    mine[f] += p[f]
    return pools


def default_free(segments):
    return sum(r["size"] for s in segments for r in s.get("runs", []) if r.get("kind") == "free")


def main():
    tracer, db, stats_path = sys.argv[1:4]
    stats = json.load(open(stats_path))
    pid = stats.get("pid")
    differ = rows = 0
    for phase in stats.get("phases", []):
        theirs = phase.get("pools")
        if theirs is None:
            continue
        ours = tracer_pools(tracer, db, phase["wall_ns"], pid)
        for key in sorted(set(theirs) | set(ours)):
            t = theirs.get(key, dict.fromkeys(FIGURES, 0))
            o = ours.get(key, dict.fromkeys(FIGURES, 0))
            for f in FIGURES:
                rows += 1
                same = o.get(f, 0) == t.get(f, 0)
                differ += 0 if same else 1
                print("%-40s pool %-6s %-9s tracer %14d pytorch %14d %s" % (
                    phase["phase"][:40], key, f, o.get(f, 0), t.get(f, 0), "equal" if same else "DIFFERS"))
    print("pools: %d of %d rows differ" % (differ, rows))


if __name__ == "__main__":
    main()
