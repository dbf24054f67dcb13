"""A failure the allocator recovers from, then, seconds later, the OOM it raises: a request no
cached block holds fails, the cache is released and the retry succeeds; two seconds later a
request the device cannot hold fails twice and OutOfMemoryError is raised. Runs on a simulated
device of 256 MiB (SIMCUDA_MEM). Prints the allocator's own figures when it raised.

usage: recovered_oom.py LIBCUDART"""
import json, os, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../demos/workloads"))
from caching_allocator import MIB, CachingAllocator, OutOfMemoryError  # noqa: E402

allocator = CachingAllocator(sys.argv[1])
held = [allocator.malloc(40 * MIB) for _ in range(5)]
for block in held[3:]:
    allocator.free(block)
del held[3:]
recovered = allocator.malloc(100 * MIB)  # fails, the cache is released, the retry succeeds
assert allocator.num_alloc_retries == 1 and allocator.num_ooms == 0
time.sleep(2)
try:
    allocator.malloc(200 * MIB)
    raise SystemExit("the 200 MiB request did not fail")
except OutOfMemoryError:
    raised_ns = time.time_ns()
    s = allocator.stats()
print(json.dumps({"pid": os.getpid(), "raised_ns": raised_ns, "allocated": s["allocated"],
                  "reserved": s["reserved"], "retries": allocator.num_alloc_retries,
                  "ooms": allocator.num_ooms}))
