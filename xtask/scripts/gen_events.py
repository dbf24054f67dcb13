"""Writes N synthetic calls in the simulated CUDA runtime's event-log format (what SIMCUDA_EVENTS
holds) for `cargo xtask bench-explain`, which stores them with `tracer import`: cudaMalloc /
cudaFree streams from four threads of each of P processes, up to 5000 allocations live per
process, cudaMalloc latency creeping from 60 to 110 us over the run. Lines come in the order the
calls returned (entry time + duration), as a trace's ring buffer delivers them, so entry times
are slightly out of order."""
import heapq, random, sys

path, n, procs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1
rng = random.Random(1)
t0 = 1_795_000_000_000_000_000
live = [[] for _ in range(procs)]
pending = []  # (return time, line): released once no earlier return can come
ts = t0
with open(path, "w") as out:
    lines = []
    for i in range(n):
        ts += 20_000
        p = i % procs
        pid, tid = 100 + p, 1000 + p * 10 + (i // procs) % 4
        mine = live[p]
        pick = rng.randrange(len(mine)) if mine else None
        # Only an allocation that has returned can be freed.
        if pick is not None and mine[pick][2] <= ts and (len(mine) > 5000 or rng.random() < 0.5):
            ptr, size, _ = mine.pop(pick)
            dur = 5000
            line = f"{ts} {dur} {pid} {tid} cudaFree 0 0 - {ptr} - -\n"
        else:
            size = rng.choice([2, 20, 40]) << 20
            ptr = 0x7F0000000000 + i * 4096
            dur = 60000 + (i * 50 // n) * 1000
            mine.append((ptr, size, ts + dur))
            line = f"{ts} {dur} {pid} {tid} cudaMalloc 0 0 {size} {ptr} - -\n"
        heapq.heappush(pending, (ts + dur, i, line))
        # Every call still running began after ts - 110 us; anything returned before that is final.
        while pending and pending[0][0] <= ts - 110_000:
            lines.append(heapq.heappop(pending)[2])
        if len(lines) >= 100_000:
            out.writelines(lines)
            lines.clear()
    while pending:
        lines.append(heapq.heappop(pending)[2])
    out.writelines(lines)
