"""Allocates on the simulated CUDA runtime from known lines, in nested functions and in several
threads, and writes, for every call, the stack traceback.extract_stack() saw at that call.

usage: call_sites.py LIBCUDART OUT.json [DELAY_S [LINGER_S]]
The end-to-end test compares these stacks with the ones `tracer trace --stack` recorded. It
runs the script with no delay and no linger: started after the trace, it lives well under 200 ms,
and tracer must still know every call's Python frames."""
import ctypes, json, sys, threading, time, traceback

lib = ctypes.CDLL(sys.argv[1])
records = []
lock = threading.Lock()


def record(stack):
    with lock:
        records.append({
            "tid": threading.get_native_id(),
            "frames": [[f.filename, f.lineno, f.name] for f in stack],
        })
    return True


def alloc(n):
    p = ctypes.c_void_p()
    rc = lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) if record(traceback.extract_stack()) else -1
    assert rc == 0, rc
    return p


def free(p):
    rc = lib.cudaFree(p) if record(traceback.extract_stack()) else -1
    assert rc == 0, rc


class Model:
    def forward(self, n):
        def inner(k):
            return alloc(k * 4096)
        return [inner(i + 1) for i in range(n)]


def step(model, n):
    bufs = model.forward(n)
    for b in bufs:
        free(b)


def worker(rounds):
    m = Model()
    for i in range(rounds):
        step(m, 3)


time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
step(Model(), 2)
threads = [threading.Thread(target=worker, args=(4,)) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
alloc(1 << 20)
with open(sys.argv[2], "w") as f:
    json.dump({"pid": __import__("os").getpid(), "version": list(sys.version_info[:2]), "calls": records}, f)
time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0)
