"""Allocates on one CPU and frees on another, PAIRS times: each cudaMalloc returns while the
thread runs on the last CPU it may use, each cudaFree while it runs on the first, so that a
free waits in the first CPU's stage while its allocation waits in the last one's, and the ring
receives each round's frees before their allocations (the reader empties the stages every 10
ms, the first CPU's first; a pause after each pair spreads the pairs over many rounds). Every allocation has its own size and
reuses the pointer just freed, so a free joined to the wrong allocation gets the wrong size.
Prints what it did as JSON. usage: cross_cpu.py LIBCUDART PAIRS"""
import ctypes
import json
import os
import sys
import time

lib = ctypes.CDLL(sys.argv[1])
pairs = int(sys.argv[2])
cpus = sorted(os.sched_getaffinity(0))
if len(cpus) < 2:
    sys.exit(f"cross_cpu.py needs two CPUs, this process may use {cpus}")
first, last = cpus[0], cpus[-1]
ptr = ctypes.c_void_p()
sizes, ptrs = [], []
for i in range(pairs):
    size = 4096 * (i + 1)
    os.sched_setaffinity(0, {last})
    if lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(size)) != 0:
        sys.exit(f"cudaMalloc({size}) failed")
    os.sched_setaffinity(0, {first})
    if lib.cudaFree(ptr) != 0:
        sys.exit("cudaFree failed")
    time.sleep(0.001)
    sizes.append(size)
    ptrs.append(ptr.value)
print(json.dumps({"pid": os.getpid(), "cpus": [first, last], "sizes": sizes,
                  "distinct_ptrs": len(set(ptrs))}))
