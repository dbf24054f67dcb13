"""The GPU check's judge: compares what tracer stored with what the allocator says about itself,
and writes the summary.

    report.py compare --tracer BIN --db DB --stats STATS.json --mode default|expandable -o OUT.json
    report.py summary --machine MACHINE.json --compare A.json [B.json] [--cost COST.json]
                      --out-text summary.txt --out-json summary.json
    report.py cost --runs RUNS.json -o COST.json

Each comparison is "equal", "explained" (the figures differ for a reason the row names, checked
where it can be: e.g. expandable segments count one device allocation per mapped range, tracer one
per chunk, so the bytes must agree instead) or "DIFFERS" (with the call sites of the calls that
make the difference). Nothing is tolerated silently. The exit status of `summary` is 1 when any
comparison DIFFERS.
"""

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys

MARKER = "# cuda-call"
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>")


def query(tracer, db, sql):
    out = subprocess.run([tracer, "query", "--db", db, "--format", "json", sql],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def row(what, tracer_value, pytorch_value, status=None, note=""):
    if status is None:
        status = "equal" if tracer_value == pytorch_value else "DIFFERS"
    return {"what": what, "tracer": tracer_value, "pytorch": pytorch_value, "status": status, "note": note}


class Session:
    """What tracer stored about the workload's process, up to the allocator's final statistics."""

    def __init__(self, tracer, db, stats):
        self.tracer, self.db, self.stats = tracer, db, stats
        self.pid, self.until = stats["pid"], stats["final_wall_ns"]
        # A call is the allocator's when its caller (the innermost native frame, recorded with
        # --stack) lies in one of the allocator's own libraries; calls without a recorded caller
        # count as the allocator's.
        prefixes = tuple(stats.get("allocator_modules", ()))
        self.ops, self.outside = {}, {}
        for r in self.q(f"SELECT op, ret, ptr IS NOT NULL AND ptr != 0 AS has_ptr, count(*) AS n, "
                        f"coalesce(sum(size), 0) AS bytes, (SELECT f.module FROM stack_frames f "
                        f"WHERE f.stack_id = e.stack_id AND f.kind = 'native' ORDER BY f.idx LIMIT 1) AS caller "
                        f"FROM events e WHERE pid = {self.pid} AND ts_ns <= {self.until} "
                        f"GROUP BY op, ret, has_ptr, caller"):
            caller = os.path.basename(r["caller"] or "")
            inside = not caller or not prefixes or caller.startswith(prefixes)
            key = (r["op"], r["ret"], r["has_ptr"])
            if not inside:
                self.outside.setdefault(r["op"], {}).setdefault(caller, [0, 0])
                self.outside[r["op"]][caller][0] += r["n"]
                self.outside[r["op"]][caller][1] += r["bytes"] if r["ret"] == 0 else 0
                continue
            n, b = self.ops.get(key, (0, 0))
            self.ops[key] = (n + r["n"], b + r["bytes"])
        self.after = self.q(f"SELECT count(*) AS n FROM events WHERE pid = {self.pid} AND ts_ns > {self.until}")[0]["n"]
        self.session = self.q("SELECT * FROM sessions ORDER BY id DESC LIMIT 1")[0]

    def q(self, sql):
        return query(self.tracer, self.db, sql)

    def calls(self, op, ok=True, with_ptr=None):
        return sum(n for (o, ret, has_ptr), (n, _) in self.ops.items()
                   if o == op and (ret == 0) == ok and (with_ptr is None or bool(has_ptr) == with_ptr))

    def bytes(self, op):
        return sum(b for (o, ret, _), (_, b) in self.ops.items() if o == op and ret == 0)

    def sites(self, op, limit=5):
        """The busiest call sites of `op` in the process, as tracer labels them."""
        out = subprocess.run([self.tracer, "stacks", "--db", self.db, "--op", op, "--pid", str(self.pid),
                              "--top", str(limit), "--json"], capture_output=True, text=True)
        if out.returncode != 0:
            return [f"(no call sites: {out.stderr.strip()})"]
        try:
            stacks = json.loads(out.stdout)
        except json.JSONDecodeError:
            return ["(tracer stacks printed no JSON)"]
        labels = []
        for s in stacks if isinstance(stacks, list) else stacks.get("stacks", []):
            frames = [f for f in s.get("frames", []) if f.get("function")]
            top = " <- ".join(f"{f.get('function') or '?'} ({os.path.basename(f.get('file') or f.get('module') or '?')}:{f.get('line') or ''})"
                              for f in frames[:4])
            labels.append(f"{s.get('calls', '?')} calls: {top}")
        return labels


def delta(stats, key):
    return stats["final"][key] - stats["baseline"][key]


def count_rows(s):
    """cudaMalloc'ed segments against num_device_alloc/free and reserved_bytes."""
    st = s.stats
    rows = [
        row("successful cudaMalloc calls", s.calls("cudaMalloc"), delta(st, "num_device_alloc"), note="num_device_alloc"),
        row("successful cudaFree calls (non-null)", s.calls("cudaFree", with_ptr=True), delta(st, "num_device_free"),
            note="num_device_free"),
        row("bytes reserved (cudaMalloc)", s.bytes("cudaMalloc"), delta(st, "reserved_bytes.all.allocated"),
            note="reserved_bytes.all.allocated"),
        row("bytes released (cudaFree)", s.bytes("cudaFree"), delta(st, "reserved_bytes.all.freed"),
            note="reserved_bytes.all.freed"),
        outstanding_row(s, s.bytes("cudaMalloc") - s.bytes("cudaFree"), "cudaMalloc - cudaFree"),
    ]
    return with_sites(s, rows, {"cudaMalloc": "cudaMalloc", "cudaFree": "cudaFree"})


def expandable_rows(s):
    """Expandable segments: memory is reserved by mapping chunks (cuMemCreate + cuMemMap each) and
    released by unmapping them (cuMemUnmap + cuMemRelease). PyTorch counts one device allocation
    per mapped range and one free per unmapped range, tracer sees one call per chunk: the counts
    agree only through the bytes, which must be equal."""
    st = s.stats
    mapped, unmapped = s.bytes("cuMemMap"), s.bytes("cuMemUnmap")
    rows = []
    for what, t, key, tb, bkey in (("successful cuMemMap calls", s.calls("cuMemMap"), "num_device_alloc",
                                    mapped, "reserved_bytes.all.allocated"),
                                   ("successful cuMemUnmap calls", s.calls("cuMemUnmap"), "num_device_free",
                                    unmapped, "reserved_bytes.all.freed")):
        p = delta(st, key)
        explained = tb == delta(st, bkey) and t >= p and (p > 0 or t == 0)
        rows.append(row(what, t, p, "equal" if t == p else ("explained" if explained else "DIFFERS"),
                        f"{key}: PyTorch counts ranges, tracer chunks; the bytes below are equal"
                        if explained else key))
    rows.append(row("bytes mapped (cuMemMap)", mapped, delta(st, "reserved_bytes.all.allocated"),
                    note="reserved_bytes.all.allocated"))
    rows.append(row("bytes unmapped (cuMemUnmap)", unmapped, delta(st, "reserved_bytes.all.freed"),
                    note="reserved_bytes.all.freed"))
    physical = s.bytes("cuMemCreate") - s.bytes("cuMemRelease")
    rows.append(outstanding_row(s, physical, "cuMemCreate - cuMemRelease"))
    # A mapping that runs out of memory half way releases the chunks it created: tracer sees them
    # come and go, PyTorch never counts them.
    created, never = s.calls("cuMemCreate") - s.calls("cuMemMap"), s.bytes("cuMemCreate") - mapped
    rows.append(row("chunks created but never mapped (a mapping that ran out of memory)", created, 0,
                    "equal" if created == 0 else ("explained" if never == s.bytes("cuMemRelease") - unmapped else "DIFFERS"),
                    f"{never} bytes, all released again unmapped; PyTorch does not count them" if created else ""))
    stray = s.calls("cudaMalloc")
    rows.append(row("successful cudaMalloc calls (none expected from the allocator)", stray, 0,
                    "equal" if stray == 0 else "explained", "calls made outside the allocator, by their call sites"))
    if stray:
        rows[-1]["sites"] = s.sites("cudaMalloc")
    return with_sites(s, rows, {"cuMemMap": "cuMemMap", "cuMemUnmap": "cuMemUnmap", "cuMemCreate": "cuMemCreate"})


def outside_rows(s):
    """Calls the allocator did not make (e.g. a library's own cudaMalloc): PyTorch does not count
    them, tracer names them by the library that made them."""
    rows = []
    for op, callers in sorted(s.outside.items()):
        n = sum(c[0] for c in callers.values())
        r = row(f"{op} calls made outside the allocator", n, 0, "explained",
                f"{sum(c[1] for c in callers.values())} bytes; not counted by PyTorch, left out of the rows above")
        r["sites"] = [f"{c[0]} calls from {caller}" for caller, c in sorted(callers.items(), key=lambda kv: -kv[1][0])]
        rows.append(r)
    return rows


def outstanding_row(s, traced, how):
    before = s.stats["baseline"]["reserved_bytes.all.current"]
    return row(f"bytes outstanding at the final statistics ({how})", before + traced,
               s.stats["final"]["reserved_bytes.all.current"],
               note="reserved_bytes.all.current" + (f", incl. {before} reserved before tracing" if before else ""))


def with_sites(s, rows, ops):
    """Rows that differ carry the call sites of the op they count."""
    for r in rows:
        if r["status"] == "DIFFERS" and "sites" not in r:
            op = next((o for name, o in ops.items() if name in r["what"]), None)
            if op:
                r["sites"] = s.sites(op)
    return rows


def explained(s):
    """tracer explain's answer for the workload's process up to the final statistics."""
    out = subprocess.run([s.tracer, "explain", "--db", s.db, "--pid", str(s.pid), "--to", str(s.until), "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def failure_rows(s, report):
    """Failed attempts, retries and OOMs as tracer counts them (a runtime call and the driver call
    inside it once, out-of-memory returns only), on every device."""
    devices = report.get("devices", [])
    failures = sum(d.get("failures", 0) for d in devices)
    retries = sum(d.get("retries", 0) for d in devices)
    ooms = sum(d.get("ooms", 0) for d in devices)
    st = s.stats
    d_retries, d_ooms = delta(st, "num_alloc_retries"), delta(st, "num_ooms")
    unknown = [d for d in devices if d.get("device", -1) < 0]
    return [
        row("failed allocations (out of memory, each attempt once)", failures, d_retries + d_ooms,
            note="num_alloc_retries + num_ooms: each retry follows one failure, each OOM is a failed retry"),
        row("retries (an attempt right after a failed one: same thread, op and size)", retries, d_retries,
            note="num_alloc_retries"),
        row("OOMs raised (failed attempts no retry followed)", ooms, d_ooms, note="num_ooms"),
        row("devices of the process's calls", ", ".join(str(d["device"]) for d in devices) or "none",
            str(st.get("device_index", 0)), "DIFFERS" if unknown or not devices else None,
            "PyTorch on device 0 never calls cudaSetDevice: 0 is CUDA's default"),
    ]


def message_rows(s, report):
    """PyTorch's out-of-memory message as tracer recorded it (its probe at c10::Error's
    constructor in libc10.so), and the OOM chain's reading of it."""
    said = (s.stats.get("oom") or {}).get("message", "")
    if not said:
        return []
    got = s.q(f"SELECT text FROM messages WHERE pid = {s.pid} AND ts_ns <= {s.until} ORDER BY ts_ns")
    text = got[-1]["text"] if got else ""
    rows = [row("PyTorch's out-of-memory message recorded", text[:120] or "none", said[:120],
                "equal" if text and said.startswith(text) else "DIFFERS", f"{len(got)} message(s) recorded")]
    oom = next((c for c in report.get("chains", []) if c.get("rule") == "oom"), None)
    effect = oom["effect"] if oom else ""
    tried = said.split("Tried to allocate ", 1)[1].split(". ")[0] if "Tried to allocate " in said else ""
    rows.append(row("OOM chain names PyTorch's request", tried if tried and tried in effect else "no",
                    tried, note=effect[:160]))
    return rows


def script_lines(path):
    """Lines marked as making CUDA calls, and the innermost function around each line."""
    with open(path) as f:
        text = f.read()
    marked = {i for i, line in enumerate(text.splitlines(), 1) if MARKER in line}
    owner = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for line in range(node.lineno, node.end_lineno + 1):
                # Inner functions are walked after outer ones only sometimes: keep the innermost.
                if line not in owner or owner[line][0] < node.lineno:
                    owner[line] = (node.lineno, node.name)
    return marked, {line: name for line, (_, name) in owner.items()}


def call_site_row(s):
    """Main-thread calls: the script frame tracer recorded must be a marked line of the function
    tracer names."""
    st = s.stats
    script = os.path.realpath(st["script"])
    marked, owner = script_lines(script)
    # CUDA calls only: a block's free (pytorch:free) happens wherever the last reference dropped.
    by_stack = s.q(f"SELECT stack_id, tid = {st['main_tid']} AS main, count(*) AS n FROM events "
                   f"WHERE pid = {s.pid} AND ts_ns <= {s.until} AND op NOT LIKE 'pytorch:%' "
                   f"GROUP BY stack_id, main")
    status = {r["id"]: r["python"] for r in s.q(f"SELECT id, python FROM stacks WHERE pid = {s.pid}")}
    frames = {}
    for f in s.q(f"SELECT stack_id, idx, function, file, line FROM stack_frames WHERE kind = 'python' "
                 f"AND stack_id IN (SELECT id FROM stacks WHERE pid = {s.pid}) ORDER BY stack_id, idx"):
        frames.setdefault(f["stack_id"], []).append(f)
    main_calls = ok_calls = 0
    other = {}
    wrong, lines = [], set()
    for r in by_stack:
        if not r["main"]:
            key = status.get(r["stack_id"], "no stack")
            other[key] = other.get(key, 0) + r["n"]
            continue
        main_calls += r["n"]
        if r["stack_id"] is None or status.get(r["stack_id"]) != "ok":
            wrong.append(f"{r['n']} calls without Python frames ({status.get(r['stack_id'], 'no stack')})")
            continue
        mine = [f for f in frames.get(r["stack_id"], []) if f["file"] and os.path.realpath(f["file"]) == script]
        if not mine:
            wrong.append(f"{r['n']} calls with no frame in {os.path.basename(script)}")
            continue
        f = mine[0]
        name = (f["function"] or "").split(".")[-1]
        expected = owner.get(f["line"])
        if f["line"] in marked and (name == expected or name in COMPREHENSIONS):
            ok_calls += r["n"]
            lines.add(f["line"])
        else:
            wrong.append(f"{r['n']} calls at line {f['line']} in {name} (the script has {expected or 'no function'} "
                         f"there{'' if f['line'] in marked else ', an unmarked line'})")
    note = f"{main_calls} main-thread calls from {len(lines)} lines; other threads: " + (
        ", ".join(f"{n} calls {k}" for k, n in sorted(other.items())) or "none")
    result = row("main-thread Python call sites at the script's marked lines", ok_calls, main_calls,
                 "equal" if not wrong and main_calls > 0 else "DIFFERS", note)
    result["lines"] = sorted(lines)
    if wrong:
        result["sites"] = wrong[:10]
    return result


def layout_rows(s):
    """The allocator's layout as tracer rebuilt it from PyTorch's probes, against the allocator's
    own at the final statistics (memory_snapshot() for PyTorch)."""
    truth = s.stats.get("layout")
    if not truth:
        return []
    out = subprocess.run([s.tracer, "layout", "--db", s.db, "--pid", str(s.pid), "--at", str(s.until), "--json"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return [row("allocator layout", out.stderr.strip(), "available", "DIFFERS")]
    layouts = json.loads(out.stdout)
    if not layouts or layouts[0]["view"] != "allocator":
        return [row("allocator layout (PyTorch's probes seen)", "not seen", "probes present", "DIFFERS",
                    "tracer saw no pytorch:malloc/free: are libc10_cuda's USDT probes there?")]
    total = {"allocated": 0, "reserved": 0, "free_blocks": 0, "largest_free": 0}
    for d in layouts[0]["devices"]:
        for k in ("allocated", "reserved", "free_blocks"):
            total[k] += d["total"][k]
        total["largest_free"] = max(total["largest_free"], d["total"]["largest_free"])
    names = {"allocated": "allocated bytes (blocks)", "reserved": "reserved bytes (segments)",
             "free_blocks": "free blocks in the cache", "largest_free": "largest free block"}
    return [row(f"{names[k]}, rebuilt from PyTorch's probes", total[k], truth[k], note=truth.get("source", ""))
            for k in ("allocated", "reserved", "free_blocks", "largest_free")]


def file_id(path):
    try:
        st = os.stat(path)
        return (st.st_dev, st.st_ino)
    except OSError:
        return None


def library_rows(s):
    probed = json.loads(s.session.get("libraries") or "[]")
    probed_ids = {file_id(lib["path"]) for lib in probed} - {None}
    probed_paths = {os.path.realpath(lib["path"]) for lib in probed}
    rows = []
    for path in s.stats["libraries"]:
        name = os.path.basename(path)
        # The same file by identity while it exists, by path once it is gone.
        is_probed = path in probed_paths or (file_id(path) or 0) in probed_ids
        what = {"libcudart": "the runtime's calls", "libcuda.": "the driver's calls",
                "libc10_cuda": "the caching allocator's USDT probes", "libc10.": "c10::Error's constructor, where OutOfMemoryError is built",
                "libsimtorch": "the simulated allocator's USDT probes and c10::Error's constructor"}
        why = next((v for k, v in what.items() if name.startswith(k)), "")
        rows.append(row(f"library {name}", "probed" if is_probed else "not probed", "mapped",
                        "equal" if is_probed else "DIFFERS", f"{path} ({why})"))
    return rows


def loss_row(s):
    c = s.session
    lost = {k: c.get(k) or 0 for k in ("dropped_ring_full", "decode_errors", "unmatched_returns",
                                       "alloc_map_full", "inflight_full")}
    stored_all = (c.get("events_stored") or 0) == (c.get("submitted") or 0)
    value = sum(lost.values()) + (0 if stored_all else 1)
    note = ", ".join(f"{k} {v}" for k, v in lost.items()) + f"; submitted {c.get('submitted')}, stored {c.get('events_stored')}"
    return row("events lost or unmatched", value, 0, note=note)


def compare(args):
    stats = json.load(open(args.stats))
    s = Session(args.tracer, args.db, stats)
    rows = expandable_rows(s) if args.mode == "expandable" else count_rows(s)
    rows += outside_rows(s)
    report = explained(s)
    rows += failure_rows(s, report)
    rows += message_rows(s, report)
    rows += layout_rows(s)
    rows.append(call_site_row(s))
    rows += library_rows(s)
    rows.append(loss_row(s))
    ops = [{"op": op, "ret": ret, "has_ptr": hp, "calls": n, "bytes": b} for (op, ret, hp), (n, b) in sorted(s.ops.items())]
    result = {"mode": args.mode, "alloc_conf": stats.get("alloc_conf", ""), "pid": s.pid, "rows": rows,
              "ops": ops, "calls_after_final_stats": s.after, "oom": stats.get("oom"),
              "device": stats.get("device"), "versions": stats.get("versions"), "timing": stats.get("timing")}
    json.dump(result, open(args.out, "w"), indent=1)


ROUNDING = 8 << 20  # PyTorch's message writes two decimals


def expected_cause(seen, layout, held):
    """The verdict PyTorch's own figures give by analysis/oom.rs's rules."""
    if not seen or not layout:
        return None
    short = seen["alloc"] - seen["device_free"]
    split = layout["reserved"] - layout["allocated"]
    others = held.get("requested", 0)
    if short <= 0:
        return "unknown"
    frag, other = split >= short, others >= short
    if frag and other:
        return "fragmentation_and_other_processes"
    if frag:
        return "fragmentation"
    if other:
        return "other_processes"
    if split and others and split + others >= short:
        return "fragmentation_and_other_processes"
    return "this_process"


def co_tenant(args):
    """The co-tenant run: a training loop ran to a natural OOM on a device another process held
    all but a few GiB of. What tracer said of who held the device at the OOM (explain's holders,
    layout --at oom), row by row against PyTorch's own account at that instant (its out-of-memory
    observer's snapshot and message) and the other process's."""
    stats, held = json.load(open(args.stats)), json.load(open(args.holder))
    seen = stats.get("natural_oom") or {}
    out = subprocess.run([args.tracer, "explain", "--db", args.db, "--json"], check=True,
                         capture_output=True, text=True)
    report = json.loads(out.stdout)
    mine = [h for h in report.get("holders", []) if h["pid"] == stats["pid"]]
    h = mine[0] if mine else {}
    other = next((t for t in h.get("others", []) if t["pid"] == held["pid"]), {})
    ar = h.get("arithmetic") or {}
    layout = seen.get("layout", {})
    message = seen.get("message", "")
    rows = [
        row("OOM raised by PyTorch (no provoked request)", bool(mine), "message" in seen),
        row("the other process named at the OOM", other.get("pid"), held["pid"]),
        row("its bytes (its allocator's reserved)", other.get("bytes"), held["reserved"],
            note="from its traced cudaMalloc" if other and not other.get("from_message")
            else "from PyTorch's message (NVML)" if other else ""),
        row("allocated by PyTorch at the OOM", h.get("allocated"), layout.get("allocated")),
        row("reserved but unallocated at the OOM", h.get("cached"),
            layout.get("reserved", 0) - layout.get("allocated", 0) if layout else None),
        row("the device's free bytes at the OOM", h.get("device_free"), seen.get("device_free"),
            note="tracer: cudaMemGetInfo kept current with the process's own calls; PyTorch: its observer's"),
        row("who held the memory (verdict)", h.get("verdict"), expected_cause(seen, layout, held),
            note="PyTorch's figures by the same rules: request - device free = shortfall; split bytes and the other process's against it"),
        row("OOM arithmetic: what the device could give", ar.get("could_give"), seen.get("device_free"),
            status=None if ar.get("could_give") is None or seen.get("device_free") is None
            else "equal" if abs(ar["could_give"] - seen["device_free"]) <= ROUNDING else "DIFFERS",
            note="tracer: %s; PyTorch: its observer's cudaMemGetInfo (within the message's two decimals)"
            % (ar.get("source") or {}).get("kind")),
        row("OOM arithmetic: never above what the device refused", (ar.get("could_give") or 0) < (ar.get("refused") or 1),
            True, note="refused %s B" % ar.get("refused")),
        row("OOM arithmetic: shortfall", ar.get("shortfall"),
            seen.get("alloc", 0) - seen.get("device_free", 0) if seen else None,
            status=None if ar.get("shortfall") is None or not seen
            else "equal" if abs(ar["shortfall"] - (seen["alloc"] - seen["device_free"])) <= ROUNDING else "DIFFERS"),
        row("OOM arithmetic: split bytes in live segments", ar.get("split"),
            layout.get("reserved", 0) - layout.get("allocated", 0) if layout else None,
            status=None if ar.get("split") is None or not layout
            else "equal" if abs(ar["split"] - (layout["reserved"] - layout["allocated"])) <= ROUNDING else "DIFFERS"),
        row("memory tracer could not attribute", h.get("unattributed"), None, status="explained",
            note="in use on the device, held by no traced process and named by neither the message nor NVML"),
        row("PyTorch's message names the other process", f"Process {held['pid']} has" in message, True,
            status="equal" if f"Process {held['pid']} has" in message else "explained",
            note="NVML readable" if f"Process {held['pid']} has" in message
            else "NVML not readable here: PyTorch's message names no process"),
    ]
    laid = subprocess.run([args.tracer, "layout", "--db", args.db, "--at", "oom", "--pid", str(stats["pid"]),
                           "--json"], capture_output=True, text=True)
    if laid.returncode == 0:
        dev = (json.loads(laid.stdout) or [{}])[0].get("devices", [{}])[0]
        rows.append(row("layout --at oom: allocated", dev.get("total", {}).get("allocated"), layout.get("allocated")))
        rows.append(row("layout --at oom: reserved", dev.get("total", {}).get("reserved"), layout.get("reserved")))
    else:
        rows.append(row("layout --at oom", laid.stderr.strip(), "a layout", status="DIFFERS"))
    json.dump({"mode": "co-tenant", "pid": stats["pid"], "holder": held, "rows": rows, "steps": seen.get("steps"),
               "message": message, "holders": h}, open(args.out, "w"), indent=1)


def stored_events(trace):
    """Events tracer stored in a run, from the summary its `trace --json` printed last."""
    try:
        lines = [line for line in open(trace) if line.strip()]
        return json.loads(lines[-1]).get("counters", {}).get("events_stored")
    except (OSError, ValueError, IndexError):
        return None


def cost(args):
    """Rounds paired by their number: each round's ratio to its untraced run, the spread, the
    events a step and the cost of an event (the loop's extra time over the events stored)."""
    runs = json.load(open(args.runs))
    by, rounds = {}, {}
    for r in runs:
        stats = json.load(open(r["stats"]))
        events = stored_events(r["trace"]) if r.get("trace") and r["setup"] != "untraced" else None
        run = {"loop_s": stats["timing"]["loop_s"], "steps": stats["timing"]["steps"],
               "step_ms_median": stats["timing"]["step_ms_median"], "events": events}
        by.setdefault(r["setup"], []).append(run)
        rounds.setdefault(r.get("round", len(by[r["setup"]])), {})[r["setup"]] = run
    med = {k: statistics.median(x["loop_s"] for x in v) for k, v in by.items()}
    ratios = {}
    for a, b in (("traced", "untraced"), ("auto", "untraced"), ("stack", "untraced"), ("stack", "traced")):
        if a in med and b in med and med[b] > 0:
            ratios[f"{a}/{b}"] = med[a] / med[b]
    per_round = {}
    for setup in ("traced", "auto", "stack"):
        rows = []
        for n in sorted(rounds):
            r = rounds[n]
            if setup in r and "untraced" in r and r["untraced"]["loop_s"] > 0:
                t, u = r[setup], r["untraced"]
                row = {"round": n, "ratio": t["loop_s"] / u["loop_s"]}
                if t["events"]:
                    row["events_per_step"] = t["events"] / t["steps"]
                    row["us_per_event"] = (t["loop_s"] - u["loop_s"]) * 1e6 / t["events"]
                rows.append(row)
        if rows:
            rs = [x["ratio"] for x in rows]
            per_event = [x["us_per_event"] for x in rows if "us_per_event" in x]
            per_round[setup] = {
                "rounds": rows, "ratio_median": statistics.median(rs), "ratio_min": min(rs), "ratio_max": max(rs),
                "events_per_step": statistics.median(x["events_per_step"] for x in rows if "events_per_step" in x)
                if per_event else None,
                "us_per_event_median": statistics.median(per_event) if per_event else None,
            }
    json.dump({"runs": by, "median_loop_s": med, "ratios": ratios, "paired": per_round},
              open(args.out, "w"), indent=1)


def fmt(v):
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def summary(args):
    machine = json.load(open(args.machine))
    compared = [json.load(open(p)) for p in args.compare]
    cost_result = json.load(open(args.cost)) if args.cost else None
    shared = json.load(open(args.co_tenant)) if args.co_tenant else None
    lines = ["tracer GPU check", ""]
    for k, v in machine.items():
        if isinstance(v, str):
            lines.append(f"{k:<10} {v}")
    differs = 0
    for c in compared:
        lines += ["", f"== {c['mode']} allocator (PYTORCH_CUDA_ALLOC_CONF={c['alloc_conf'] or 'unset'}), pid {c['pid']}"]
        if c.get("oom"):
            o = c["oom"]
            lines.append(f"   provoked OOM: asked {fmt(o['requested'])} B with {fmt(o['free_before'])} B free: "
                         + ("raised" if o["raised"] else "NOT raised"))
        width = max(len(r["what"]) for r in c["rows"])
        lines.append(f"   {'comparison':<{width}}  {'tracer':>16}  {'PyTorch':>16}  result")
        for r in c["rows"]:
            differs += r["status"] == "DIFFERS"
            lines.append(f"   {r['what']:<{width}}  {fmt(r['tracer']):>16}  {fmt(r['pytorch']):>16}  {r['status']}"
                         + (f"  ({r['note']})" if r["note"] else ""))
            for site in r.get("sites", []):
                lines.append(f"   {'':<{width}}    {site}")
        if c.get("calls_after_final_stats"):
            lines.append(f"   {c['calls_after_final_stats']} calls after the final statistics (not compared)")
    if shared:
        o = shared["holder"]
        lines += ["", f"== co-tenant: pid {o['pid']} took {fmt(o['requested'])} B, leaving about "
                      f"{fmt(o['free_before'] - o['requested'])} B; pid {shared['pid']} trained to a natural OOM "
                      f"in {shared['steps']} steps"]
        width = max(len(r["what"]) for r in shared["rows"])
        for r in shared["rows"]:
            differs += r["status"] == "DIFFERS"
            lines.append(f"   {r['what']:<{width}}  {fmt(r['tracer']):>16}  {fmt(r['pytorch']):>16}  {r['status']}"
                         + (f"  ({r['note']})" if r["note"] else ""))
    if cost_result:
        lines += ["", "== cost (interleaved runs, median training-loop time)"]
        for setup, t in cost_result["median_loop_s"].items():
            lines.append(f"   {setup:<9} {t * 1e3:9.1f} ms  ({len(cost_result['runs'][setup])} runs)")
        for k, v in cost_result["ratios"].items():
            lines.append(f"   {k:<17} {v:.3f}x")
        for setup, p in cost_result.get("paired", {}).items():
            each = " ".join(f"{x['ratio']:.3f}" for x in p["rounds"])
            lines.append(f"   {setup:<9} each round / its untraced run: {each} (median {p['ratio_median']:.3f}, "
                         f"spread {p['ratio_min']:.3f}-{p['ratio_max']:.3f})")
            if p.get("us_per_event_median") is not None:
                lines.append(f"   {setup:<9} {p['events_per_step']:,.0f} events a step, "
                             f"{p['us_per_event_median']:.2f} us an event (the loop's extra time / events stored)")
    lines += ["", f"{differs} comparison(s) differ" if differs else "every comparison equal or explained"]
    text = "\n".join(lines) + "\n"
    open(args.out_text, "w").write(text)
    json.dump({"machine": machine, "compared": compared, "co_tenant": shared, "cost": cost_result,
               "differs": differs},
              open(args.out_json, "w"), indent=1)
    sys.stdout.write(text)
    return 1 if differs else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--tracer", required=True)
    c.add_argument("--db", required=True)
    c.add_argument("--stats", required=True)
    c.add_argument("--mode", choices=("default", "expandable"), required=True)
    c.add_argument("-o", "--out", required=True)
    t = sub.add_parser("co-tenant")
    t.add_argument("--tracer", required=True)
    t.add_argument("--db", required=True)
    t.add_argument("--stats", required=True)
    t.add_argument("--holder", required=True)
    t.add_argument("-o", "--out", required=True)
    k = sub.add_parser("cost")
    k.add_argument("--runs", required=True)
    k.add_argument("-o", "--out", required=True)
    s = sub.add_parser("summary")
    s.add_argument("--machine", required=True)
    s.add_argument("--compare", nargs="+", required=True)
    s.add_argument("--cost")
    s.add_argument("--co-tenant")
    s.add_argument("--out-text", required=True)
    s.add_argument("--out-json", required=True)
    args = p.parse_args()
    return {"compare": compare, "co-tenant": co_tenant, "cost": cost, "summary": summary}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
