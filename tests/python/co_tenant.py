"""Two processes on one GPU, as on a shared node (the simulated runtime with
SIMCUDA_SHARED_DEVICES: both count against one device).

usage: co_tenant.py hold LIBCUDART MIB READY_FILE DONE_FILE
           allocates MIB MiB (in 256 MiB cudaMallocs), creates READY_FILE, waits for DONE_FILE,
           frees it all and exits
       co_tenant.py train LIBCUDART [libraries]
           a PyTorch-style training loop that takes 64 MiB tensors until its allocator raises
           OutOfMemoryError (no provoked request); with `libraries`, first cuBLAS-like and
           NCCL-like libraries beside LIBCUDART take their own device memory (2 x 32 MiB and
           64 MiB) past the runtime
Each prints one JSON line: its pid and what it held."""
import ctypes, json, os, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../demos/workloads"))
from caching_allocator import MIB, CachingAllocator, OutOfMemoryError  # noqa: E402


def hold(lib, mib, ready, done):
    rt = ctypes.CDLL(lib)
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaFree.argtypes = [ctypes.c_void_p]
    held = []
    for _ in range(mib // 256):
        p = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(p), 256 * MIB) == 0
        held.append(p)
    open(ready, "w").close()
    print(json.dumps({"pid": os.getpid(), "held": mib * MIB}), flush=True)
    while not os.path.exists(done):
        time.sleep(0.02)
    for p in held:
        rt.cudaFree(p)


def libraries(lib):
    """cuBLAS's workspaces and NCCL's buffer, taken by the libraries' own cuMemAlloc_v2."""
    here = os.path.dirname(os.path.abspath(lib))
    taken = []
    for name, entry, sizes in (("libsimcublas.so", "simcublasWorkspace", (32, 32)),
                               ("libsimnccl.so", "simncclBuffer", (64,))):
        fn = getattr(ctypes.CDLL(os.path.join(here, name)), entry)
        fn.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)]
        for mib in sizes:
            ptr = ctypes.c_uint64()
            assert fn(mib * MIB, ctypes.byref(ptr)) == 0
            taken.append(ptr)
    return taken


def train(lib, with_libraries=False):
    # Held until the process ends, as the libraries hold them.
    taken = libraries(lib) if with_libraries else []
    allocator = CachingAllocator(lib)
    tensors = []
    try:
        while True:
            tensors.append(allocator.malloc(64 * MIB))
    except OutOfMemoryError as e:
        print(json.dumps({"pid": os.getpid(), "held": len(tensors) * 64 * MIB, "message": str(e)}), flush=True)
        # As a job does after its OOM (the traceback, its handlers): it is still there a moment
        # later, when tracer reads what /proc says of it.
        time.sleep(0.5)


if sys.argv[1] == "hold":
    hold(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
else:
    train(sys.argv[2], sys.argv[3:] == ["libraries"])
