"""Training-like workloads on a CUDA runtime (the simulated one), through the caching allocator.

    python3 train.py SCENARIO [--duration 20] [--speed 1.0] [--cudart PATH] [--seed 1] [--steps N] [--final-request BYTES]

Scenarios: incident, periodic-spike, leak, oom, cpu-contention, multi-gpu, multi-node, co-tenant, graphs, engine,
mempool. Each prints
one JSON line of the allocator's own statistics at the end ("result"), and exits 1 with PyTorch's
message on OOM. multi-gpu launches its ranks as torchrun does (one process per device, RANK,
LOCAL_RANK and WORLD_SIZE in their environment) and ends them all when one fails. co-tenant starts
another job's inference server on the GPU (SIMCUDA_SHARED_DEVICES: one device for both), then a
training job that would fit the GPU alone.
"""

import argparse
import collections
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from caching_allocator import MIB, CachingAllocator, Graph, OutOfMemoryError  # noqa: E402


def dataloader_worker(stop_at):
    """A DataLoader worker decoding samples: pure CPU."""
    x = 0
    while time.time() < stop_at:
        for i in range(20000):
            x = (x * 31 + i) % 1000003


def start_workers(n, seconds):
    stop_at = time.time() + seconds
    procs = [multiprocessing.Process(target=dataloader_worker, args=(stop_at,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return procs


def step_pause(args, seconds):
    time.sleep(seconds / args.speed)


def incident(alloc, args, rng, dataloader_workers=4):
    """Variable sequence lengths fragment the cache: long-lived activations (gradient
    accumulation, a KV cache) pin segments that short-lived ones of other sizes leave full of
    holes, empty_cache() returns the segments between them, DataLoader workers compete for the
    CPU. The device fills; at the end a request larger than any cached block, and than what the
    device has left, fails although the cache holds more than it in free bytes."""
    workers = start_workers(dataloader_workers, args.duration)
    kept = collections.deque()
    end = time.time() + args.duration * 0.85
    step = 0
    # --steps: the same requests whatever the pace (to run a recorded job again).
    while (step < args.steps) if args.steps else (time.time() < end):
        seq = rng.randint(64, 1024)
        # Activations scale with the sequence length: sizes vary from step to step, so cached
        # blocks seldom fit and new segments keep being reserved.
        tensors = [alloc.malloc(seq * rng.randint(20, 48) * 1024) for _ in range(3)]
        tensors += [alloc.malloc(rng.randint(1, 900) * 1024) for _ in range(4)]
        # One activation per step lives on (two per step while the working set fills up).
        for _ in range(2 if len(kept) < KEPT else 1):
            kept.append(tensors.pop(rng.randrange(len(tensors) - 4)) if len(tensors) > 5 else alloc.malloc(seq * 32 * 1024))
        while len(kept) > KEPT:
            alloc.free(kept.popleft())
        for t in tensors:
            alloc.free(t)
        if step % 10 == 0:
            alloc.mem_get_info()  # what a monitoring sidecar would see
        if step % 50 == 49:
            alloc.empty_cache()  # "to save memory": returns segments between live ones
        alloc.rt.cudaStreamSynchronize(None)
        step_pause(args, 0.03)
        step += 1
    alloc.empty_cache()  # what is left in the cache is pinned between live blocks
    free, _total = alloc.mem_get_info()
    request = args.final_request or fragmented_request(alloc.stats(), free)
    alloc.final_request = request
    print(f"step {step}: cudaMemGetInfo reports {free / MIB:.0f} MiB free; allocating {request / MIB:.0f} MiB", flush=True)
    try:
        alloc.malloc(request)
    finally:
        for w in workers:
            w.terminate()


# Long-lived activations the incident keeps: enough to fill its 3 GiB device.
KEPT = 150


def fragmented_request(stats, device_free):
    """A request no cached block holds and the device cannot serve in a new segment, yet smaller
    than the free bytes inside the cached segments when the cache is that fragmented."""
    largest, cached = stats["largest_free_block"], stats["reserved"] - stats["allocated"]
    floor = max(largest, device_free + stats["releasable"]) + 2 * MIB
    return max(floor, min(cached - MIB, floor + 16 * MIB))


def periodic_spike(alloc, args, rng):
    """Every 25 steps a checkpoint empties the cache and allocates a large staging buffer."""
    end = time.time() + args.duration * 0.9
    step = 0
    while time.time() < end:
        tensors = [alloc.malloc(rng.randint(1, 8) * MIB) for _ in range(4)]
        for t in tensors:
            alloc.free(t)
        if step % 25 == 24:
            alloc.empty_cache()
            staging = alloc.malloc(512 * MIB)
            alloc.free(staging)
        step_pause(args, 0.02)
        step += 1


def leak(alloc, args, rng):
    """Losses are kept on the GPU across steps (appended without .item())."""
    history = []
    end = time.time() + args.duration * 0.9
    while time.time() < end:
        tensors = [alloc.malloc(rng.randint(1, 4) * MIB) for _ in range(3)]
        history.append(alloc.malloc(256 * 1024))
        for t in tensors:
            alloc.free(t)
        step_pause(args, 0.02)


def oom(alloc, args, rng):
    """The batch grows every step until the device is full."""
    kept = []
    batch = 64 * MIB
    end = time.time() + args.duration * 0.9
    while time.time() < end:
        kept.append(alloc.malloc(batch))
        batch += 32 * MIB
        alloc.mem_get_info()
        step_pause(args, 0.6)


def cpu_contention(alloc, args, rng):
    """Six busy workers on a small machine: the training loop waits for the CPU."""
    workers = start_workers(6, args.duration)
    end = time.time() + args.duration * 0.9
    while time.time() < end:
        tensors = [alloc.malloc(rng.randint(1, 8) * MIB) for _ in range(4)]
        alloc.rt.cudaStreamSynchronize(None)
        for t in tensors:
            alloc.free(t)
        step_pause(args, 0.01)
    for w in workers:
        w.terminate()


# The multi-GPU job: its ranks, and the one whose data shard has uneven sequence lengths.
WORLD_SIZE = 4
FRAGMENTING_RANK = 2


def launch_ranks(args):
    """As torchrun: one process per rank and device; when one fails, the others are ended and
    the job fails with it. multi-node: two nodes of two ranks each (SIMCUDA_NODE_EVENTS names
    each node's runtime log, "A,B": each node's tracer reads its own), the rendezvous on the
    first node's address."""
    ranks = []
    # torchrun's rendezvous names the job: the same for every rank, another for another job.
    run_id = f"demo-{os.getpid()}"
    nodes = os.environ.get("SIMCUDA_NODE_EVENTS", "").split(",") if args.scenario == "multi-node" else []
    per_node = WORLD_SIZE // max(len(nodes), 1)
    for rank in range(WORLD_SIZE):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(WORLD_SIZE),
                   MASTER_ADDR="10.0.0.1" if nodes else "127.0.0.1", MASTER_PORT="29500",
                   TORCHELASTIC_RUN_ID=run_id)
        if nodes:
            env["SIMCUDA_EVENTS"] = nodes[rank // per_node]
        command = [sys.executable, os.path.abspath(__file__), "multi-gpu", "--duration", str(args.duration),
                   "--speed", str(args.speed), "--seed", str(args.seed + rank), "--cudart", args.cudart]
        ranks.append(subprocess.Popen(command, env=env))
    status = 0
    while any(p.poll() is None for p in ranks):
        failed = [r for r, p in enumerate(ranks) if p.returncode not in (None, 0)]
        if failed and status == 0:
            status = 1
            print(f"launcher: rank {failed[0]} exited with status {ranks[failed[0]].returncode}; "
                  "ending the other ranks", file=sys.stderr, flush=True)
            for p in ranks:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.1)
    return 1 if status or any(p.returncode for p in ranks) else 0


def steady_rank(alloc, args, rng):
    """A rank whose batches all have one shape: the cache settles and is reused step after step."""
    kept = collections.deque()
    end = time.time() + args.duration * 0.9
    seq = 384
    while time.time() < end:
        tensors = [alloc.malloc(seq * 32 * 1024) for _ in range(3)]
        tensors += [alloc.malloc(512 * 1024) for _ in range(4)]
        kept.append(tensors.pop(0))
        while len(kept) > KEPT // 2:
            alloc.free(kept.popleft())
        for t in tensors:
            alloc.free(t)
        alloc.rt.cudaStreamSynchronize(None)
        step_pause(args, 0.03)


def multi_gpu(alloc, args, rng):
    """One rank of the multi-GPU job: the fragmenting one runs the incident's steps (without
    DataLoader workers, four ranks share the CPU), the others steady ones."""
    if int(os.environ["RANK"]) == FRAGMENTING_RANK:
        incident(alloc, args, rng, dataloader_workers=0)
    else:
        steady_rank(alloc, args, rng)


def launch_co_tenants(args):
    """Another job's inference server takes its memory on the GPU; then a training job starts
    there. Both use one simulated device (a file both map: SIMCUDA_SHARED_DEVICES)."""
    import tempfile
    shared = tempfile.NamedTemporaryFile(prefix="simcuda-gpu-", delete=False)
    shared.close()
    command = [sys.executable, os.path.abspath(__file__), "co-tenant", "--duration", str(args.duration),
               "--speed", str(args.speed), "--seed", str(args.seed), "--cudart", args.cudart]
    env = dict(os.environ, SIMCUDA_SHARED_DEVICES=shared.name)
    try:
        server = subprocess.Popen(command, env=dict(env, CO_TENANT_ROLE="server"), stdout=subprocess.PIPE, text=True)
        # The server says when its weights and KV cache are on the GPU.
        server.stdout.readline()
        trainer = subprocess.run(command, env=dict(env, CO_TENANT_ROLE="trainer"))
        server.terminate()
        server.wait()
        return trainer.returncode
    finally:
        os.unlink(shared.name)


def inference_server(alloc, args):
    """Another job's server: its weights and KV cache (1.25 GiB) taken at start, held until it is
    ended."""
    held = [alloc.malloc(256 * MIB) for _ in range(5)]
    print("ready", flush=True)
    time.sleep(args.duration * 4 / args.speed)
    del held


def co_tenant_trainer(alloc, args, rng):
    """Training whose peak fits the device alone: 512 MiB of weights, and activations of 384 MiB a
    step, 1.5 GiB every 20th (its longest sequences)."""
    weights = [alloc.malloc(128 * MIB) for _ in range(4)]
    end = time.time() + args.duration * 0.9
    step = 0
    while time.time() < end:
        seq = 1024 if step % 20 == 19 else 256
        activations = [alloc.malloc(seq * 256 * 1024) for _ in range(6)]
        for a in activations:
            alloc.free(a)
        alloc.rt.cudaStreamSynchronize(None)
        step += 1
        step_pause(args, 0.1)
    del weights


def co_tenant(alloc, args, rng):
    if os.environ.get("CO_TENANT_ROLE") == "server":
        inference_server(alloc, args)
    else:
        co_tenant_trainer(alloc, args, rng)


def graphs(alloc, args, rng):
    """A model served with CUDA graphs, as serving engines run it: weights loaded, then one
    graph captured per batch size (largest first) into one shared pool on a side stream, each
    capture's activations freed inside it (they stay in the pool for the next capture), its
    output kept; replays allocate nothing. Then an eager request on the default stream (a
    prefill larger than any captured shape) that the device cannot hold: the pool's free blocks
    are for its graphs' requests only, and no flush gives them back while the graphs live."""
    _free, total = alloc.mem_get_info()
    unit = 2 * MIB

    def share(fraction):
        return max(unit, int(total * fraction) // unit * unit)

    weights = alloc.malloc(share(0.55))
    side = alloc.new_stream()
    alloc.wait_stream(side, 0)
    pool = alloc.graph_pool_handle()
    graphs, outputs = [], []
    for batch in (8, 4, 2, 1):
        g = Graph()
        alloc.capture_begin(g, side, pool)
        first = alloc.malloc(share(0.0125 * batch), side)
        second = alloc.malloc(share(0.0125 * batch), side)
        outputs.append(alloc.malloc(share(0.0025 * batch), side))
        alloc.free(first)
        alloc.free(second)
        alloc.capture_end(g)
        graphs.append(g)
        step_pause(args, 0.05)
    for _ in range(args.steps or 5):
        for g in graphs:
            alloc.replay(g)
        step_pause(args, 0.05)
    alloc.final_request = share(0.25)
    prefill = alloc.malloc(alloc.final_request)
    alloc.free(prefill)
    del weights


def engine(alloc, args, rng):
    """A serving engine's start-up in vLLM's order: weights; a profiling pass at the largest
    batch (activations made and freed), the cache emptied; the KV cache sized from
    --gpu-memory-utilization less the profiled peak; then one graph per batch size captured
    (largest first, after a warm-up run) into one shared pool on a side stream, with
    CUDAGraph.capture_begin directly (torch.cuda.graph would also empty the cache before each
    capture, returning the warm-up's cached segment). At a high
    utilization the KV cache leaves the captures too little and one runs out of memory. Prints
    a `phase` JSON line at each step with the allocator's own figures."""
    _free, total = alloc.mem_get_info()
    unit = 2 * MIB
    time.sleep(0.3)  # reading the model's files

    def share(fraction):
        return max(unit, int(total * fraction) // unit * unit)

    def phase(name, **extra):
        s = alloc.stats()
        private = sum(p["reserved"] for p in alloc.private_pools())
        print(json.dumps({"phase": name, "reserved": s["reserved"], "allocated": s["allocated"],
                          "private_reserved": private, "peak_reserved": alloc.reserved_peak, **extra}), flush=True)

    weights = [alloc.malloc(share(0.02)) for _ in range(10)]
    phase("weights")
    activations = [alloc.malloc(share(0.03)) for _ in range(4)]
    for a in activations:
        alloc.free(a)
    peak = alloc.reserved_peak
    alloc.empty_cache()
    phase("profile", profiled_peak=peak)
    free, total = alloc.mem_get_info()
    budget = int(total * args.gpu_memory_utilization) - peak
    kv = alloc.malloc(max(budget, unit) // unit * unit)
    phase("kv cache", kv_bytes=kv.size, budget=budget)
    side = alloc.new_stream()
    pool = alloc.graph_pool_handle()
    graphs = []
    for batch in (8, 4, 2, 1):
        warm = alloc.malloc(share(0.01 * batch), side)
        alloc.free(warm)
        g = Graph()
        alloc.capture_begin(g, side, pool)
        x = alloc.malloc(share(0.01 * batch), side)
        y = alloc.malloc(share(0.005 * batch), side)
        alloc.free(x)
        alloc.capture_end(g)
        graphs.append((g, y))
        phase("capture", batch=batch)
        step_pause(args, 0.02)
    for _ in range(3):
        for g, _y in graphs:
            alloc.replay(g)


def mempool(alloc, args, rng):
    """torch.cuda.MemPool as PyTorch runs it: a pool filled under use_mem_pool (this thread's
    requests routed to it), its largest block freed (free inside the pool: default-pool
    requests may not use it), an eager request beside it (a new default segment); a second
    pool made with use_on_oom, filled and emptied; a request the device cannot hold, served
    from the use_on_oom pool as a last resort; then one nothing can serve: an OOM while the
    first pool holds more free bytes than the request was short. Prints a `phase` JSON line at
    each step with the allocator's own figures."""
    _free, total = alloc.mem_get_info()
    unit = 2 * MIB

    def share(fraction):
        return max(unit, int(total * fraction) // unit * unit)

    def phase(name, **extra):
        s = alloc.stats()
        print(json.dumps({"phase": name, "reserved": s["reserved"], "allocated": s["allocated"],
                          "private_pools": alloc.private_pools(), **extra}), flush=True)

    weights = alloc.malloc(share(0.5))
    pool = alloc.mem_pool()
    with alloc.use_mem_pool(pool):
        held = [alloc.malloc(share(f)) for f in (0.01, 0.05, 0.02, 0.15, 0.01)]
    phase("pool filled", pool=list(pool))
    alloc.free(held[3])
    eager = alloc.malloc(share(0.1))
    phase("default request beside the pool's free block")
    oom_pool = alloc.mem_pool(use_on_oom=True)
    with alloc.use_mem_pool(oom_pool):
        spare = alloc.malloc(share(0.1))
    alloc.free(spare)
    phase("use_on_oom pool made", pool=list(oom_pool))
    step_pause(args, 0.05)
    rescued = alloc.malloc(share(0.08))
    phase("served from the use_on_oom pool", ptr=rescued.ptr)
    step_pause(args, 0.05)
    alloc.final_request = share(0.12)
    last = alloc.malloc(alloc.final_request)
    alloc.free(last)
    del weights, held, eager


SCENARIOS = {
    "incident": incident,
    "periodic-spike": periodic_spike,
    "leak": leak,
    "oom": oom,
    "cpu-contention": cpu_contention,
    "multi-gpu": multi_gpu,
    "multi-node": multi_gpu,
    "co-tenant": co_tenant,
    "graphs": graphs,
    "engine": engine,
    "mempool": mempool,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--speed", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="incident: this many steps, not a duration")
    parser.add_argument("--final-request", type=int, default=0, help="incident: the last request's bytes")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="engine: the KV cache's budget")
    parser.add_argument("--cudart", default=os.environ.get("SIMCUDA_CUDART", "libcudart.so.12"))
    args = parser.parse_args()
    if args.scenario in ("multi-gpu", "multi-node") and "RANK" not in os.environ:
        return launch_ranks(args)
    if args.scenario == "co-tenant" and "CO_TENANT_ROLE" not in os.environ:
        return launch_co_tenants(args)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    alloc = CachingAllocator(
        args.cudart,
        device=int(os.environ.get("LOCAL_RANK", "0")),
        expandable="expandable_segments:true" in conf.split(","),
    )
    alloc.final_request = None
    status = 0
    try:
        SCENARIOS[args.scenario](alloc, args, random.Random(args.seed))
    except OutOfMemoryError as e:
        print(f"torch.cuda.OutOfMemoryError: {e}", file=sys.stderr, flush=True)
        status = 1
    print(json.dumps({
        "result": alloc.stats(), "memory_stats": alloc.memory_stats(), "pid": os.getpid(),
        "final_request": alloc.final_request,
    }), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
