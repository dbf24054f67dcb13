"""Writes N synthetic calls in the simulated CUDA runtime's event-log format (what SIMCUDA_EVENTS
holds) for `cargo xtask bench-explain`, which stores them with `tracer import`: a cudaMalloc /
cudaFree stream from four threads of one process, up to 5000 allocations live, cudaMalloc latency
creeping from 60 to 110 us over the run."""
import random, sys

path, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(1)
t0 = 1_795_000_000_000_000_000
live = []
ts = t0
with open(path, "w") as out:
    lines = []
    for i in range(n):
        ts += 20_000
        tid = 1000 + (i % 4)
        if live and (len(live) > 5000 or rng.random() < 0.5):
            ptr, size = live.pop(rng.randrange(len(live)))
            lines.append(f"{ts} 5000 100 {tid} cudaFree 0 0 - {ptr} - -\n")
        else:
            size = rng.choice([2, 20, 40]) << 20
            ptr = 0x7F0000000000 + i * 4096
            live.append((ptr, size))
            lines.append(f"{ts} {60000 + (i * 50 // n) * 1000} 100 {tid} cudaMalloc 0 0 {size} {ptr} - -\n")
        if len(lines) >= 100_000:
            out.writelines(lines)
            lines.clear()
    out.writelines(lines)
