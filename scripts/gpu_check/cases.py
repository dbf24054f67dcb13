"""The GPU check's recorded cases on real PyTorch: what PyTorch says of itself (memory_stats, its
own memory snapshot with `segment_pool_id` and history, mem_get_info, the OutOfMemoryError message
and its out-of-memory observer's figures) at each phase of a run that tracer traces, kept as test
data for the allocator's rules tracer cannot otherwise learn without a GPU.

    cases.py graphs   --ready R --go G --stats S --snapshot P   # CUDA graphs in a shared private pool
    cases.py compiled --ready R --go G --stats S --snapshot P   # torch.compile(mode="reduce-overhead")
    cases.py engine   --ready R --go G --stats S --snapshot P [--gpu-memory-utilization U]
    cases.py fraction --ready R --go G --stats S --snapshot P   # a per-process memory fraction refuses
    cases.py ring-oom --ready R --go G --stats S --snapshot P [--warm-steps N] [--history N]

Every case writes S (JSON: its phases, each with wall time, memory_stats subset, mem_get_info, the
snapshot's per-pool bytes) and P (gzip pickle of torch.cuda.memory._snapshot(), plain dicts).
"""

import argparse
import gzip
import os
import pickle
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import handshake  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

PHASES = []


def pools():
    """Per pool id: segments, reserved, allocated and free bytes, from PyTorch's own snapshot."""
    out = {}
    for seg in torch.cuda.memory_snapshot():
        key = "%d,%d" % tuple(seg.get("segment_pool_id", (0, 0)))
        p = out.setdefault(key, {"segments": 0, "reserved": 0, "allocated": 0, "free": 0, "largest_free": 0,
                                 "expandable": 0})
        p["segments"] += 1
        p["reserved"] += seg["total_size"]
        p["expandable"] += 1 if seg.get("is_expandable") else 0
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                p["allocated"] += b["size"]
            elif b["state"] == "inactive":
                p["free"] += b["size"]
                p["largest_free"] = max(p["largest_free"], b["size"])
    return out


def mark(name, **extra):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    stats = torch.cuda.memory_stats()
    PHASES.append(dict({
        "phase": name,
        "wall_ns": time.time_ns(),
        "stats": handshake.stat_subset(stats),
        "peak_allocated": int(stats.get("allocated_bytes.all.peak", 0)),
        "peak_reserved": int(stats.get("reserved_bytes.all.peak", 0)),
        "device_free": free,
        "device_total": total,
        "pools": pools(),
    }, **extra))
    print("phase %-28s reserved %14d allocated %14d device free %14d" % (
        name, PHASES[-1]["stats"]["reserved_bytes.all.current"],
        PHASES[-1]["stats"]["allocated_bytes.all.current"], free), flush=True)


def dump_snapshot(path, tag=""):
    snap = torch.cuda.memory._snapshot()
    target = path if not tag else path.replace(".pickle.gz", "-%s.pickle.gz" % tag)
    with gzip.open(target, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    return target


class MLP(nn.Module):
    def __init__(self, d=1024, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, 4 * d) if i % 2 == 0 else nn.Linear(4 * d, d)
                                    for i in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))  # intermediates freed inside a capture: free blocks in the pool
        return x


def case_graphs(args):
    """Captures one step at six batch sizes into one shared private pool (as serving engines do),
    graphs another module with make_graphed_callables, replays all, then makes eager requests."""
    model = MLP().cuda()
    mark("weights")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(torch.randn(32, 1024, device="cuda"))
    torch.cuda.current_stream().wait_stream(side)
    mark("warm-up")
    pool, graphs = None, {}
    for bs in (1, 2, 4, 8, 16, 32):
        static_in = torch.randn(bs * 64, 1024, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            static_out = model(static_in)
        if pool is None:
            pool = g.pool()
        graphs[bs] = (g, static_in, static_out)
        mark("capture bs=%d" % bs, pool=list(pool))
    m2 = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()
    sample = torch.randn(256, 512, device="cuda", requires_grad=True)
    gm2 = torch.cuda.make_graphed_callables(m2, (sample,))
    mark("make_graphed_callables")
    for _ in range(5):
        for g, _i, _o in graphs.values():
            g.replay()
        gm2(sample).sum().backward()
    mark("replays")
    eager = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (3, 24, 100, 700)]
    mark("eager requests")
    dump_snapshot(args.snapshot, "captured")
    del eager
    for g, _i, _o in graphs.values():
        g.reset()
    graphs.clear()
    del gm2
    torch.cuda.empty_cache()
    mark("graphs reset, empty_cache")


def case_mempool(args):
    """torch.cuda.MemPool and use_mem_pool: a user pool's free block that a default-pool request
    may not use; then a pool made with use_on_oom, used only after an OOM; then the pool freed."""
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        held = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 5, 30, 100, 3)]
    mark("pool filled", pool=list(pool.id))
    del held[3]
    mark("pool block freed")
    eager = torch.empty(60 << 20, dtype=torch.uint8, device="cuda")
    mark("default request beside the pool's free block")
    try:
        oom_pool = torch.cuda.MemPool(use_on_oom=True)
        with torch.cuda.use_mem_pool(oom_pool):
            spare = torch.empty(200 << 20, dtype=torch.uint8, device="cuda")
        del spare
        mark("use_on_oom pool made", oom_pool=list(oom_pool.id))
    except Exception as e:  # noqa: BLE001 - an older PyTorch without use_on_oom: said
        mark("use_on_oom not available", error="%s: %s" % (type(e).__name__, e))
    dump_snapshot(args.snapshot, "pools")
    del held, eager, pool
    torch.cuda.empty_cache()
    mark("pool released, empty_cache")


def case_graph_reset(args):
    """Graphs captured, then reset one by one (keep_graph default): the pool freed at use count
    0, its segments going back at the next empty_cache."""
    model = MLP(d=512).cuda()
    model(torch.randn(64, 512, device="cuda"))
    graphs = []
    for bs in (64, 128):
        x = torch.randn(bs, 512, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = model(x)
        graphs.append((g, x, y))
        mark("captured bs=%d" % bs, pool=list(g.pool()))
    for i, (g, _x, _y) in enumerate(graphs):
        g.reset()
        mark("reset graph %d" % i)
    graphs.clear()
    mark("graphs dropped")
    torch.cuda.empty_cache()
    mark("empty_cache")


def case_compiled(args):
    """torch.compile(mode="reduce-overhead"): CUDA graph trees, warm-up routed to the pool."""
    model = MLP(d=512).cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    mark("weights")
    for bs in (8, 16, 8, 32, 16, 8):
        for _ in range(3):
            compiled(torch.randn(bs, 512, device="cuda"))
        mark("compiled bs=%d" % bs)


def case_engine(args):
    """A serving engine's start-up, in vLLM's order: weights, a profiling pass at the largest batch,
    the KV cache sized from --gpu-memory-utilization less the profiled peak, then graph captures at
    several batch sizes into one pool. With a high utilization the captures run out of memory."""
    d, layers = 4096, 16
    weights = [torch.empty(d, d, dtype=torch.float16, device="cuda") for _ in range(layers * 4)]
    mark("weights")
    torch.cuda.reset_peak_memory_stats()

    def forward(x):
        for i in range(layers):
            x = torch.relu(x @ weights[4 * i])
            x = x @ weights[4 * i + 1]
        return x

    forward(torch.randn(args.profile_rows, d, dtype=torch.float16, device="cuda"))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    mark("profile", profiled_peak=peak)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    used_outside = total - free - torch.cuda.memory_reserved()
    budget = int(total * args.gpu_memory_utilization) - peak - max(used_outside, 0)
    kv = torch.empty(max(budget, 1 << 20), dtype=torch.uint8, device="cuda")
    mark("kv cache", kv_bytes=kv.numel(), budget=budget, used_outside=used_outside)
    pool, graphs = None, []
    try:
        for bs in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
            x = torch.randn(bs * args.rows_per_seq, d, dtype=torch.float16, device="cuda")
            forward(x)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                y = forward(x)
            pool = pool or g.pool()
            graphs.append((g, x, y))
            mark("capture bs=%d" % bs)
    except torch.cuda.OutOfMemoryError as e:
        message = str(e)
        torch.cuda.current_stream().synchronize()
        mark("capture failed", message=message, captured=len(graphs))


def case_fraction(args):
    """set_per_process_memory_fraction: the allocator refuses before asking the device."""
    torch.cuda.set_per_process_memory_fraction(args.fraction)
    kept = []
    try:
        while True:
            kept.append(torch.empty(192 << 20, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        mark("refused", message=str(e), blocks=len(kept))


def case_ring_oom(args):
    """A training loop whose memory history ring wraps (--history entries), traced from a step well
    after its start, run until a real OOM beside a co-tenant; the snapshot taken in PyTorch's
    out-of-memory observer (at the instant, before the error unwinds) and again after."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_workload import TinyLM, VOCAB, train_step  # noqa: E402
    import random
    rng = random.Random(1)
    model = TinyLM().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(args.warm_steps):
        train_step(model, opt, rng)
    mark("before trace")
    return model, opt, rng


def ring_oom_after_go(args, model, opt, rng):
    from torch_workload import VOCAB, train_step  # noqa: E402
    for _ in range(5):
        train_step(model, opt, rng)
    seen = {}

    def observer(device, alloc, device_total, device_free):
        seen.update({"device": device, "alloc": alloc, "device_total": device_total,
                     "device_free": device_free, "wall_ns": time.time_ns()})
        try:
            seen["snapshot"] = dump_snapshot(args.snapshot, "at-oom")
        except Exception as e:  # noqa: BLE001 - said in the results, the OOM goes on
            seen["snapshot_error"] = "%s: %s" % (type(e).__name__, e)

    torch._C._cuda_attach_out_of_memory_observer(observer)
    kept = []
    try:
        while True:
            tokens = torch.randint(0, VOCAB, (16, 512), device="cuda")
            kept.append(model(tokens).detach())
    except torch.cuda.OutOfMemoryError as e:
        seen["message"] = str(e)
    mark("oom", natural_oom=seen, kept=len(kept))
    del kept


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", choices=("graphs", "compiled", "engine", "fraction", "ring-oom", "mempool", "graph-reset"))
    p.add_argument("--snapshot", required=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--profile-rows", type=int, default=8192)
    p.add_argument("--rows-per-seq", type=int, default=4)
    p.add_argument("--fraction", type=float, default=0.02)
    p.add_argument("--warm-steps", type=int, default=40)
    p.add_argument("--history", type=int, default=3000)
    handshake.parse_common(p)
    args = p.parse_args()
    torch.cuda.init()
    torch.cuda.mem_get_info()
    history = args.history if args.case == "ring-oom" else 1_000_000
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=history)
    state = case_ring_oom(args) if args.case == "ring-oom" else None
    handshake.wait_for_go(args)
    mark("start")
    t0 = time.time_ns()
    error = None
    try:
        {"graphs": case_graphs, "compiled": case_compiled, "engine": case_engine,
         "fraction": case_fraction, "mempool": case_mempool, "graph-reset": case_graph_reset}.get(args.case, lambda a: ring_oom_after_go(a, *state))(args)
    except Exception as e:  # noqa: BLE001 - kept in the results: a case that fails is data too
        error = "%s: %s" % (type(e).__name__, e)
        print("cases: %s" % error, file=sys.stderr, flush=True)
    final = dump_snapshot(args.snapshot)
    handshake.write_json(args.stats, {
        "case": args.case,
        "argv": sys.argv,
        "pid": os.getpid(),
        "main_tid": threading.get_native_id(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda},
        "started_ns": t0,
        "phases": PHASES,
        "error": error,
        "snapshot": final,
        "final": handshake.stat_subset(torch.cuda.memory_stats()),
    })


if __name__ == "__main__":
    main()
