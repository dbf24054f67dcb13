"""The GPU check's co-tenant: another job's process that takes all but --leave bytes of the device
once told to go, and holds them until told it is done (a server's weights and KV cache).

    holder.py --ready R --go G --held H --done D --leave BYTES [--cudart PATH]

With --cudart, on the simulated runtime (SIMCUDA_SHARED_DEVICES: one device for every process);
else on the GPU through PyTorch. Writes H (JSON: pid, bytes taken, its allocator's reserved bytes)
once it holds them.
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "demos", "workloads"))
import handshake  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--ready", "--go", "--held", "--done"):
        p.add_argument(name, required=True)
    p.add_argument("--leave", type=int, required=True, help="bytes to leave free on the device")
    p.add_argument("--cudart", help="the simulated runtime's libcudart (no GPU)")
    args = p.parse_args()
    if args.cudart:
        from caching_allocator import CachingAllocator
        alloc = CachingAllocator(args.cudart)
        mem_get_info, reserved = alloc.mem_get_info, lambda: alloc.stats()["reserved"]
        take = alloc.malloc
    else:
        import torch
        torch.cuda.init()
        mem_get_info, reserved = torch.cuda.mem_get_info, torch.cuda.memory_reserved
        take = lambda n: torch.empty(n, dtype=torch.uint8, device="cuda")  # noqa: E731
    mem_get_info()
    handshake.wait_for_go(args)
    free, total = mem_get_info()
    request = max(free - args.leave, 0)
    held = take(request)
    handshake.write_json(args.held, {"pid": os.getpid(), "requested": request, "reserved": reserved(),
                                     "free_before": free, "total": total})
    while not os.path.exists(args.done):
        time.sleep(0.05)
    del held


if __name__ == "__main__":
    main()
