"""Writes N allocator requests (pytorch:malloc / pytorch:free) in the simulated runtime's
event-log format for `cargo xtask bench-whatif`, which stores them with `tracer import` and
times `tracer whatif` over them: a training loop's pattern (per step a few activations sized by
a varying sequence length, small tensors, one activation of 150 kept across steps). The
pointers are made up (no allocator placed them), so the fidelity gate does not hold: the bench
measures speed."""
import random, sys

path, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(1)
ts, ptr, written = 1_795_000_000_000_000_000, 0x7F0000000000, 0
kept, out = [], open(path, "w")


def line(op, size, p):
    global ts, written
    ts += 1000
    written += 1
    return f"{ts} 0 100 1000 {op} 0 0 {size} {p} 0 -\n"


lines = []
while written < n:
    seq = rng.randint(64, 1024)
    step = []
    for size in [seq * rng.randint(20, 48) * 1024 for _ in range(3)] + [rng.randint(1, 900) * 1024 for _ in range(4)]:
        ptr += 1 << 20
        step.append(ptr)
        lines.append(line("pytorch:malloc", size, ptr))
    kept.append(step.pop(0))
    while len(kept) > 150:
        lines.append(line("pytorch:free", 0, kept.pop(0)))
    for p in step:
        lines.append(line("pytorch:free", 0, p))
    if len(lines) >= 100_000:
        out.writelines(lines)
        lines.clear()
out.writelines(lines)
out.close()
