"""A leak as users make one: 600 tensors of 64 KiB to 1 MiB allocated through a PyTorch-style
caching allocator (demos/workloads/caching_allocator.py, with PyTorch's probes) and kept in a
list that is never cleared. Prints the line that allocates them.

usage: leak.py LIBCUDART"""
import json, os, random, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../demos/workloads"))
from caching_allocator import KIB, MIB, CachingAllocator  # noqa: E402

allocator = CachingAllocator(sys.argv[1])
history = []


def step(rng):
    history.append(allocator.malloc(rng.randint(64 * KIB, MIB)))  # the leak


def main():
    rng = random.Random(7)
    for _ in range(600):
        step(rng)
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith("# the leak"))
    print(json.dumps({"pid": os.getpid(), "file": os.path.basename(__file__), "line": line,
                      "held": allocator.stats()["allocated"]}))


main()
