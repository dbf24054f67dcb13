"""cudaMalloc + cudaFree pairs from Python (ctypes), DEPTH frames deep, for `cargo xtask bench`:
prints the CPU time per pair. usage: py_pairs.py LIBCUDART PAIRS DEPTH DELAY_S"""
import ctypes, json, sys, time

lib = ctypes.CDLL(sys.argv[1])
pairs, depth, delay = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
malloc, free = lib.cudaMalloc, lib.cudaFree
size = ctypes.c_size_t(4096)


def loop():
    p = ctypes.c_void_p()
    ref = ctypes.byref(p)
    start = time.process_time()
    for _ in range(pairs):
        malloc(ref, size)
        free(p)
    return time.process_time() - start


def nest(n):
    return loop() if n == 0 else nest(n - 1)


time.sleep(delay)  # the tracer registers new interpreters once a second
print(json.dumps({"cpu_s": nest(depth), "pairs": pairs}))
