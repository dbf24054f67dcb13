"""A long training job on the simulated CUDA runtime, through the caching allocator with PyTorch's
probes: the weights are allocated in the first moments and held to the end, then steps of
activations whose sizes vary (a few live on for a while, pinning segments), then a request no
cached block holds: PyTorch's out-of-memory, with the cache full of holes (fragmentation).

    python3 long_job.py --cudart PATH [--seconds 10] [--until FILE] [--account FILE]
                        [--warmup-steps N] [--ready FILE --go FILE]

At the end it writes the allocator's own account (its segments and blocks, and its figures) to
--account, for tests to compare with what tracer rebuilt, and prints one JSON line.
"""

import argparse
import collections
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from caching_allocator import MIB, CachingAllocator, OutOfMemoryError  # noqa: E402

KIB = 1024


def account(alloc):
    """The allocator's segments and blocks, as it holds them."""
    segments = []
    for seg in sorted(alloc.segments, key=lambda s: s.ptr):
        segments.append({
            "ptr": seg.ptr,
            "size": seg.size,
            "pool": "small" if seg.small else "large",
            "blocks": [
                {"ptr": b.ptr, "size": b.size, "allocated": not b.free, "requested": b.requested}
                for b in seg.blocks if b.mapped
            ],
        })
    return {"stats": alloc.stats(), "segments": segments}


def fragmented_request(stats, device_free):
    """A request no cached block holds and the device cannot serve in a new segment."""
    largest = stats["largest_free_block"]
    return max(largest, device_free + stats["releasable"]) + 2 * MIB


def step(alloc, rng, kept, n):
    """One training step: activations whose sizes vary with the sequence length; one of them
    lives on for 24 steps (gradient accumulation), pinning the segment it sits in."""
    seq = rng.randint(16, 256)
    tensors = [alloc.malloc(seq * rng.randint(8, 40) * KIB) for _ in range(4)]
    tensors += [alloc.malloc(rng.randint(1, 900) * KIB) for _ in range(6)]
    kept.append(tensors.pop(rng.randrange(4)))
    while len(kept) > 24:
        alloc.free(kept.popleft())
    for t in reversed(tensors):
        alloc.free(t)
    if n % 20 == 0:
        alloc.mem_get_info()


def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.01)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cudart", required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--account")
    parser.add_argument("--ready", help="written (the pid) once the weights are allocated and the warm-up done")
    parser.add_argument("--go", help="the steps begin when this file appears")
    parser.add_argument("--until", help="the steps go on until this file appears (after --seconds at least)")
    parser.add_argument("--step-pause", type=float, default=0.0)
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="steps before --ready (from 17,003 steps on, seed 7 reserves no new segment)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    alloc = CachingAllocator(args.cudart)
    # The weights: allocated first, held to the end.
    weights = [alloc.malloc(rng.randint(1, 6) * MIB + rng.randint(0, 1023) * KIB) for _ in range(24)]
    weights += [alloc.malloc(rng.randint(1, 512) * KIB) for _ in range(16)]
    kept = collections.deque()
    n = 0
    # Steps until the cache has grown to what the job needs (a job at hour 70 reserves no new
    # segment a step); then ready.
    while n < args.warmup_steps:
        step(alloc, rng, kept, n)
        n += 1
    if args.ready:
        with open(args.ready + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(args.ready + ".tmp", args.ready)
    if args.go:
        wait_for(args.go)
    end = time.time() + args.seconds
    while time.time() < end or (args.until and not os.path.exists(args.until)):
        step(alloc, rng, kept, n)
        if args.step_pause:
            time.sleep(args.step_pause)
        n += 1
    # The device fills with what the job keeps (a bigger batch, an evaluation's buffers) ...
    free, _total = alloc.mem_get_info()
    held = []
    while free > 24 * MIB:
        held.append(alloc.malloc(20 * MIB))
        free, _total = alloc.mem_get_info()
    alloc.empty_cache()
    free, _total = alloc.mem_get_info()
    request = fragmented_request(alloc.stats(), free)
    status = 0
    message = None
    try:
        alloc.malloc(request)
    except OutOfMemoryError as e:
        message = str(e)
        status = 1
    if args.account:
        with open(args.account, "w") as f:
            json.dump(dict(account(alloc), request=request, message=message, steps=n), f)
    print(json.dumps({"result": alloc.stats(), "pid": os.getpid(), "steps": n, "request": request}), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
