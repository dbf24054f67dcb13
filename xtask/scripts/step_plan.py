"""One training step's tensor allocations, from a real PyTorch memory snapshot, for the
training-shaped bench (xtask/scripts/train_step.c): the allocations and frees of a window of the
recorded trace, in the recorded order (so each tensor lives as long, in allocations, as it did),
with the sizes PyTorch was asked for. Blocks are placed first-fit in one segment (rounded up to
512 bytes, as the allocator rounds); what the window allocates and does not free is freed at the
step's end, so every step starts from the same state.

usage: step_plan.py SNAPSHOT HITS   (prints: `span BYTES`, then `a OFFSET SIZE` / `f OFFSET`)
The snapshot is loaded without building objects: a pickle naming a class is refused."""
import pickle
import sys


class PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"the snapshot names a class ({module}.{name}): refused")


def place(live, size):
    """The lowest offset where `size` bytes fit between the live blocks (sorted (offset, end))."""
    at = 0
    for start, end in live:
        if start - at >= size:
            break
        at = max(at, end)
    return at


def main():
    path, hits = sys.argv[1], int(sys.argv[2])
    with open(path, "rb") as f:
        trace = PlainUnpickler(f).load()["device_traces"][0]
    actions = [e for e in trace if e["action"] in ("alloc", "free_requested")]
    # From a third of the way in: past the trace's first entries, inside the step's body.
    window = actions[len(actions) // 3:]
    ops, live, offset_of, allocs, span = [], [], {}, 0, 0
    for e in window:
        if e["action"] == "alloc":
            if allocs == hits // 2:
                break
            size = max(512, (e["size"] + 511) // 512 * 512)
            at = place(live, size)
            live.append((at, at + size))
            live.sort()
            offset_of[e["addr"]] = at
            span = max(span, at + size)
            allocs += 1
            ops.append(f"a {at} {e['size']}")
        elif e["addr"] in offset_of:
            at = offset_of.pop(e["addr"])
            live = [b for b in live if b[0] != at]
            ops.append(f"f {at}")
    ops += [f"f {at}" for at in offset_of.values()]
    print(f"span {span}")
    print("\n".join(ops))


if __name__ == "__main__":
    main()
