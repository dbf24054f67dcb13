"""What the GPU check's workloads share: waiting for tracer, timing steps, and reporting what they
did and what their allocator says about itself (the truth tracer is compared with)."""

import json
import os
import statistics
import threading
import time


def parse_common(parser):
    parser.add_argument("--ready", required=True, help="written (JSON: pid, main thread) once set up")
    parser.add_argument("--go", required=True, help="the workload starts when this file appears")
    parser.add_argument("--stats", required=True, help="where the results (JSON) go")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--empty-cache-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--oom", action="store_true", help="end with a request larger than the free memory")
    parser.add_argument("--until-oom", action="store_true",
                        help="after the steps, keep each step's output on the device until PyTorch raises "
                             "OutOfMemoryError by itself (no provoked request); the layout at that instant "
                             "is taken as PyTorch's out-of-memory observer sees it")
    return parser


def write_json(path, value):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def mapped_cuda_libraries():
    """The CUDA runtime, driver and PyTorch allocator libraries this process maps."""
    found = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            name = os.path.basename(path)
            if name.startswith(("libcudart", "libcuda.so", "libc10_cuda", "libc10.so", "libsimtorch")):
                found.add(os.path.realpath(path))
    return sorted(found)


def wait_for_go(args, timeout_s=300):
    write_json(args.ready, {"pid": os.getpid(), "main_tid": threading.get_native_id()})
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(args.go):
        if time.monotonic() > deadline:
            raise SystemExit(f"workload: {args.go} did not appear within {timeout_s} s")
        time.sleep(0.01)


def step_summary(step_s):
    return {
        "steps": len(step_s),
        "loop_s": sum(step_s),
        "step_ms_median": statistics.median(step_s) * 1e3 if step_s else 0.0,
        "step_ms_min": min(step_s) * 1e3 if step_s else 0.0,
    }


STAT_KEYS = (
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
    "num_ooms",
    "reserved_bytes.all.current",
    "reserved_bytes.all.peak",
    "reserved_bytes.all.allocated",
    "reserved_bytes.all.freed",
    "allocated_bytes.all.current",
    "segment.all.current",
    "inactive_split_bytes.all.current",
)


def stat_subset(stats):
    return {k: int(stats.get(k, 0)) for k in STAT_KEYS}
