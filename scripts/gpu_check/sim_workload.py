"""The GPU check's training loop on the simulated CUDA runtime (no GPU): the same protocol and the
same report as torch_workload.py, through the project's PyTorch-style caching allocator, so the
whole check can be run and tested on a machine without a GPU. Not a GPU: its figures say nothing
about one.

Lines that make CUDA calls are marked "# cuda-call": tracer's Python call sites must be among them.
"""

import argparse
import os
import random
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "demos", "workloads"))
import handshake  # noqa: E402
from caching_allocator import MIB, CachingAllocator, OutOfMemoryError  # noqa: E402


def forward(alloc, rng, batch, seq, layers=6):
    """Activations of each layer, sized by the batch's sequence length."""
    acts = []
    for _ in range(layers):
        acts.append(alloc.malloc(batch * seq * rng.randint(2, 6) * 1024))  # cuda-call
        acts.append(alloc.malloc(rng.randint(1, 900) * 1024))  # cuda-call
    return acts


def train_step(alloc, rng, params, side=None):
    batch, seq = rng.choice((4, 8, 16)), rng.randint(32, 512)
    tokens = alloc.malloc(batch * seq * 8)  # cuda-call
    acts = forward(alloc, rng, batch, seq)
    grads = [alloc.malloc(p.size) for p in params]  # cuda-call
    if side is not None:
        # Two activations are also used by work on a side stream (Tensor.record_stream): freed
        # below, they stay out of the pool until that work is done.
        for t in rng.sample(acts, 2):
            alloc.record_stream(t, side)
            alloc.fill(t, side)  # cuda-call
    for t in acts + grads + [tokens]:
        alloc.free(t)
    alloc.rt.cudaStreamSynchronize(None)  # cuda-call


def provoke_oom(alloc):
    alloc.empty_cache()  # cuda-call
    free, total = alloc.mem_get_info()  # cuda-call
    request = free + 1024 * MIB
    try:
        alloc.malloc(request)  # cuda-call
    except OutOfMemoryError as e:
        return {"requested": request, "free_before": free, "total": total, "raised": True, "message": str(e)}
    return {"requested": request, "free_before": free, "total": total, "raised": False, "message": ""}


def layout_of(alloc):
    st = alloc.stats()
    return {"allocated": st["allocated"], "reserved": st["reserved"],
            "free_blocks": sum(1 for seg in alloc.segments for b in seg.blocks if b.free and b.mapped),
            "largest_free": st["largest_free_block"], "source": "the simulated allocator's own blocks"}


def run_until_oom(alloc, rng):
    """Keeps every step's output on the device until the allocator raises OutOfMemoryError; the
    layout is taken as it raises (as PyTorch's out-of-memory observer sees it)."""
    kept, seen = [], {}
    try:
        while True:
            kept.append(alloc.malloc(16 * 512 * 8192 * 4))  # cuda-call
    except OutOfMemoryError as e:
        free, total = alloc.mem_get_info()  # cuda-call
        seen.update({"device": 0, "alloc": 16 * 512 * 8192 * 4, "device_total": total,
                     "device_free": free, "layout": layout_of(alloc), "wall_ns": time.time_ns(),
                     "message": str(e)})
    seen["steps"] = len(kept)
    for t in kept:
        alloc.free(t)
    return seen


def main():
    parser = handshake.parse_common(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--cudart", required=True)
    parser.add_argument("--expandable", action="store_true")
    parser.add_argument("--streams", action="store_true", help="use some blocks on a side stream too (record_stream)")
    args = parser.parse_args()
    alloc = CachingAllocator(args.cudart, expandable=args.expandable)
    _free, total = alloc.mem_get_info()
    handshake.wait_for_go(args)
    baseline = handshake.stat_subset(alloc.memory_stats())
    rng = random.Random(args.seed)
    params = [alloc.malloc(rng.randint(1, 24) * MIB) for _ in range(8)]  # cuda-call
    step_s = []
    side = alloc.new_stream() if args.streams else None
    for step in range(args.steps):
        t0 = time.perf_counter()
        train_step(alloc, rng, params, side)
        step_s.append(time.perf_counter() - t0)
        if step % args.empty_cache_every == args.empty_cache_every - 1:
            alloc.empty_cache()  # cuda-call
    oom = provoke_oom(alloc) if args.oom else None
    natural_oom = run_until_oom(alloc, rng) if args.until_oom else None
    final = handshake.stat_subset(alloc.memory_stats())
    st = alloc.stats()
    layout = {"allocated": st["allocated"], "reserved": st["reserved"],
              "free_blocks": sum(1 for seg in alloc.segments for b in seg.blocks if b.free and b.mapped),
              "largest_free": st["largest_free_block"], "source": "the simulated allocator's own blocks"}
    final_wall_ns = time.time_ns()
    handshake.write_json(args.stats, {
        "backend": "simulated",
        "script": os.path.abspath(__file__),
        "pid": os.getpid(),
        "main_tid": threading.get_native_id(),
        "device": {"name": "simulated runtime (not a GPU)", "total_bytes": total},
        "alloc_conf": "expandable_segments:True" if args.expandable else "",
        "versions": {"python": sys.version.split()[0]},
        "libraries": handshake.mapped_cuda_libraries(),
        # The caller of an allocator's own CUDA calls (ctypes calls the runtime through libffi).
        "allocator_modules": ["libffi"],
        "baseline": baseline,
        "final": final,
        "final_wall_ns": final_wall_ns,
        "oom": oom,
        "natural_oom": natural_oom,
        "layout": layout,
        "timing": handshake.step_summary(step_s),
    })
    # A real PyTorch process takes a long while to tear CUDA down after its last call; this one
    # would exit within milliseconds, before a tracer (a debug build on a loaded machine above
    # all) has read the code objects of its last, new call sites from its memory.
    time.sleep(0.3)


if __name__ == "__main__":
    main()
