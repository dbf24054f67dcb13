"""Compares a PyTorch memory snapshot tracer exported with the one it imported, field by field,
as plain data (the files are loaded with a loader that refuses every class). Prints one JSON
object: per part, how many compared and how many equal, with the first difference.

usage: snapshot_compare.py ORIGINAL EXPORTED
       snapshot_compare.py --figures FILE     the allocator's figures of its segments, as JSON,
                                              with the faults of its self-consistency (`faults`)
       snapshot_compare.py --block-actions FILE
                                              its trace's block entries, [action, addr] each
"""
import json
import gzip
import pickle
import sys


class PlainOnly(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"a class in a snapshot: {module}.{name}")


def load(path):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
        return PlainOnly(f).load()


SEGMENT_FIELDS = ["device", "address", "total_size", "allocated_size", "stream", "segment_type",
                  "is_expandable", "segment_pool_id"]
ENTRY_FIELDS = ["action", "addr", "size", "stream", "time_us", "device_free"]


def frames_of(x):
    return [(f["filename"], f["line"], f["name"]) for f in x.get("frames", [])]


class Part:
    def __init__(self):
        self.compared = 0
        self.equal = 0
        self.first = None

    def check(self, where, mine, theirs):
        self.compared += 1
        if mine == theirs:
            self.equal += 1
        elif self.first is None:
            self.first = f"{where}: original {theirs!r}, exported {mine!r}"

    def out(self):
        return {"compared": self.compared, "equal": self.equal, "first_difference": self.first}


ACTIONS = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot"}


def faults(snap):
    """What makes a snapshot inconsistent with itself: blocks that do not tile their segment,
    a free requested whose block neither completed its free nor waits pending, an unknown
    action, an oom entry with an address."""
    out = []
    states = {}
    for s in snap["segments"]:
        at = s["address"]
        for b in s["blocks"]:
            if b["address"] != at:
                out.append(f"segment {s['address']:#x}: a block at {b['address']:#x}, expected {at:#x}")
            at = b["address"] + b["size"]
            states[b["address"]] = b["state"]
        if at != s["address"] + s["total_size"]:
            out.append(f"segment {s['address']:#x}: blocks end at {at:#x}, the segment at {s['address'] + s['total_size']:#x}")
        allocated = sum(b["size"] for b in s["blocks"] if b["state"] != "inactive")
        if allocated != s["allocated_size"]:
            out.append(f"segment {s['address']:#x}: allocated_size {s['allocated_size']}, its blocks {allocated}")
    for device, trace in enumerate(snap["device_traces"]):
        waiting = {}
        for i, e in enumerate(trace):
            if e["action"] not in ACTIONS:
                out.append(f"device {device} entry {i}: action {e['action']!r}")
            if e["action"] == "oom":
                if "addr" in e or "device_free" not in e:
                    out.append(f"device {device} entry {i}: an oom with an address or without device_free")
                continue
            if e["action"] == "free_requested":
                waiting[e["addr"]] = i
            elif e["action"] == "free_completed":
                waiting.pop(e["addr"], None)
            elif e["action"] == "alloc":
                waiting.pop(e["addr"], None)
        for addr, i in waiting.items():
            if states.get(addr) != "active_pending_free":
                out.append(f"device {device} entry {i}: free_requested of {addr:#x} never completed, its block {states.get(addr)}")
    return out


def figures(path):
    snap = load(path)
    blocks = [b for s in snap["segments"] for b in s["blocks"]]
    free = [b["size"] for b in blocks if b["state"] == "inactive"]
    # A free block's request is its last tenant's: one the trace freed, when it holds them all.
    freed = {e["size"] for t in snap["device_traces"] for e in t if e["action"] == "free_requested"}
    tenants = [b["requested_size"] for b in blocks
               if b["state"] == "inactive" and b["requested_size"] > 0]
    return {
        "inactive_tenants": len(tenants),
        "inactive_tenants_never_freed": sum(1 for r in tenants if r not in freed),
        "reserved": sum(s["total_size"] for s in snap["segments"]),
        "allocated": sum(b["size"] for b in blocks if b["state"] != "inactive"),
        "free_blocks": len(free),
        "largest_free": max(free, default=0),
        "entries": sum(len(t) for t in snap["device_traces"]),
        "overflowed": snap["allocator_settings"].get("trace_alloc_overflowed"),
        "segment_devices": sorted({s["device"] for s in snap["segments"]}),
        "segment_pools": [[s["address"], list(s.get("segment_pool_id", (0, 0)))] for s in snap["segments"]],
        "ooms": [[d, e.get("device_free")] for d, t in enumerate(snap["device_traces"]) for e in t
                 if e["action"] == "oom"],
        "faults": faults(snap)[:5],
    }


def main():
    if sys.argv[1] == "--figures":
        print(json.dumps(figures(sys.argv[2])))
        return
    if sys.argv[1] == "--block-actions":
        snap = load(sys.argv[2])
        print(json.dumps([[e["action"], e["addr"]] for t in snap["device_traces"] for e in t
                          if e["action"] in ("alloc", "free_requested", "free_completed")]))
        return
    parts_faults = faults(load(sys.argv[2]))
    original, exported = load(sys.argv[1]), load(sys.argv[2])
    parts = {k: Part() for k in ["segments", "blocks", "active_requested",
                                 "inactive_requested", "entries", "entry_frames_python"]}
    theirs = {(s["device"], s["address"]): s for s in original["segments"]}
    mine = {(s["device"], s["address"]): s for s in exported["segments"]}
    for key in sorted(set(theirs) | set(mine)):
        t, m = theirs.get(key), mine.get(key)
        where = f"segment {key[1]:#x} on device {key[0]}"
        if t is None or m is None:
            parts["segments"].check(where, m and "present", t and "present")
            continue
        parts["segments"].check(where, {f: m.get(f) for f in SEGMENT_FIELDS},
                                {f: t.get(f) for f in SEGMENT_FIELDS})
        parts["blocks"].check(where, [(b["address"], b["size"], b["state"]) for b in m["blocks"]],
                              [(b["address"], b["size"], b["state"]) for b in t["blocks"]])
        parts["active_requested"].check(
            where,
            [b["requested_size"] for b in m["blocks"] if b["state"] != "inactive"],
            [b["requested_size"] for b in t["blocks"] if b["state"] != "inactive"])
        # An inactive block keeps its Block object's last tenant's request.
        for a, b in zip(m["blocks"], t["blocks"]):
            if a["state"] == "inactive" and b["state"] == "inactive":
                parts["inactive_requested"].check(f"{where}: free block {b['address']:#x}",
                                                  a["requested_size"], b["requested_size"])
    traces_t = [t for t in original["device_traces"]]
    traces_m = [t for t in exported["device_traces"]]
    for device in range(max(len(traces_t), len(traces_m))):
        t = traces_t[device] if device < len(traces_t) else []
        m = traces_m[device] if device < len(traces_m) else []
        parts["entries"].check(f"device {device}: entries", len(m), len(t))
        for i, (a, b) in enumerate(zip(m, t)):
            parts["entries"].check(f"device {device} entry {i}", {f: a.get(f) for f in ENTRY_FIELDS},
                                   {f: b.get(f) for f in ENTRY_FIELDS})
            # tracer keeps the frames from the first outside PyTorch's recording and
            # allocator: the Python frames of both must be the same.
            py = lambda e: [f for f in frames_of(e) if f[0].endswith(".py")]
            parts["entry_frames_python"].check(f"device {device} entry {i} frames", py(a), py(b))
    out = {k: v.out() for k, v in parts.items()}
    out["private_pool_segments"] = sum(1 for s in original["segments"]
                                       if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    out["exported_faults"] = {"compared": 1, "equal": int(not parts_faults),
                              "first_difference": parts_faults[0] if parts_faults else None}
    print(json.dumps(out))


main()
