"""The GPU check's training loop on real PyTorch: a small transformer language model trained on
batches of variable sequence length, so the caching allocator keeps cutting segments into blocks
of new sizes, with torch.cuda.empty_cache() every few steps so that segments are released too.
With --oom it ends by asking for more than the device has free, so that cudaMalloc (or, with
expandable segments, cuMemCreate) really fails, the allocator flushes its cache and retries, and
PyTorch raises OutOfMemoryError.

Lines that make CUDA calls are marked "# cuda-call": tracer's Python call sites of the main thread
must be among them (backward runs on autograd threads, which have no Python frames).
"""

import argparse
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import handshake  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

VOCAB = 8192


class TinyLM(nn.Module):
    def __init__(self, d_model=512, layers=6, heads=8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)  # cuda-call
        for layer in self.layers:
            x = layer(x)  # cuda-call
        return self.head(x)  # cuda-call


def train_step(model, opt, rng):
    batch, seq = rng.choice((4, 8, 16)), rng.randint(32, 512)
    tokens = torch.randint(0, VOCAB, (batch, seq), device="cuda")  # cuda-call
    logits = model(tokens)  # cuda-call
    loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), tokens.view(-1))  # cuda-call
    loss.backward()  # cuda-call
    opt.step()  # cuda-call
    opt.zero_grad(set_to_none=True)  # cuda-call
    torch.cuda.synchronize()  # cuda-call


def provoke_oom():
    torch.cuda.empty_cache()  # cuda-call
    free, total = torch.cuda.mem_get_info()  # cuda-call
    request = free + (1 << 30)
    try:
        torch.empty(request, dtype=torch.uint8, device="cuda")  # cuda-call
    except torch.cuda.OutOfMemoryError as e:
        return {"requested": request, "free_before": free, "total": total, "raised": True, "message": str(e)}
    return {"requested": request, "free_before": free, "total": total, "raised": False, "message": ""}


def run_until_oom(model, opt, rng):
    """Keeps every step's logits on the device (a history kept for later, as jobs do) until the
    allocator raises OutOfMemoryError; PyTorch's out-of-memory observer takes its layout at that
    instant (it runs before the error is raised, the allocator's lock released)."""
    seen = {}

    def observer(device, alloc, device_total, device_free):
        seen.update({"device": device, "alloc": alloc, "device_total": device_total,
                     "device_free": device_free, "layout": snapshot_layout(), "wall_ns": time.time_ns()})

    torch._C._cuda_attach_out_of_memory_observer(observer)
    kept = []
    steps = 0
    try:
        while True:
            batch, seq = 16, 512
            tokens = torch.randint(0, VOCAB, (batch, seq), device="cuda")  # cuda-call
            kept.append(model(tokens).detach())  # cuda-call
            steps += 1
    except torch.cuda.OutOfMemoryError as e:
        seen["message"] = str(e)
    seen["steps"] = steps
    del kept
    return seen


def snapshot_layout():
    """The allocator's layout in its own words (torch.cuda.memory_snapshot()): allocated and
    reserved bytes, free blocks and the largest."""
    allocated = reserved = free_blocks = largest = 0
    for seg in torch.cuda.memory_snapshot():
        reserved += seg["total_size"]
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                allocated += block["size"]
            elif block["state"] == "inactive":
                free_blocks += 1
                largest = max(largest, block["size"])
    return {"allocated": allocated, "reserved": reserved, "free_blocks": free_blocks,
            "largest_free": largest, "source": "torch.cuda.memory_snapshot()"}


def main():
    parser = handshake.parse_common(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_workload: torch.cuda.is_available() is False")
    torch.cuda.init()
    _free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    handshake.wait_for_go(args)
    baseline = handshake.stat_subset(torch.cuda.memory_stats())
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = TinyLM().cuda()  # cuda-call
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_s = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        train_step(model, opt, rng)
        step_s.append(time.perf_counter() - t0)
        if step % args.empty_cache_every == args.empty_cache_every - 1:
            torch.cuda.empty_cache()  # cuda-call
    oom = provoke_oom() if args.oom else None
    natural_oom = run_until_oom(model, opt, rng) if args.until_oom else None
    final = handshake.stat_subset(torch.cuda.memory_stats())
    layout = snapshot_layout()
    final_wall_ns = time.time_ns()
    handshake.write_json(args.stats, {
        "backend": "torch",
        "script": os.path.abspath(__file__),
        "pid": os.getpid(),
        "main_tid": threading.get_native_id(),
        "device": {"name": props.name, "total_bytes": total},
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        },
        "libraries": handshake.mapped_cuda_libraries(),
        # The caller of an allocator's own CUDA calls (the caching allocator lives in libc10_cuda.so).
        "allocator_modules": ["libc10_cuda"],
        "baseline": baseline,
        "final": final,
        "final_wall_ns": final_wall_ns,
        "oom": oom,
        "natural_oom": natural_oom,
        "layout": layout,
        "timing": handshake.step_summary(step_s),
    })


if __name__ == "__main__":
    main()
