"""Records the stack tests' workloads under two builds of tracer (`tracer trace --stack`) and
compares every call's call site: a change to how call sites travel must not change one.

usage (as root): compare_sites.py BEFORE_TRACER AFTER_TRACER SIM_DIR WORK_DIR

The workloads are the end-to-end tests' own programs: tests/native/call_sites.c (native frames,
a process killed right after its last call), tests/python/call_sites.py under every CPython
pyenv has (3.10 to 3.13; frames read from a process that lives under 200 ms, threads), and
xtask's training-shaped loop (PyTorch's USDT sites, a job's threads). Each build traces the same
binaries in the same order; the calls of each workload are compared in the order they were made,
each with its op, size and frames (kind, function, file, line, module, offset). Prints one line
per workload and exits non-zero on the first difference, naming it."""
import glob, json, os, signal, sqlite3, subprocess, sys, time

before, after, sim, work = sys.argv[1:5]
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.makedirs(work, exist_ok=True)


def build_native():
    exe = os.path.join(work, "call_sites")
    subprocess.run(["cc", "-O0", "-g", "-fno-omit-frame-pointer", "-DMAIN_BUILD_LINE=0",
                    "-DMAIN_FREE_LINE=0", "-o", exe, os.path.join(root, "tests/native/call_sites.c"),
                    f"-L{sim}", "-l:libcudart.so.12", f"-Wl,-rpath,{sim}"], check=True)
    return exe


def pythons():
    pyenv = subprocess.run(["bash", "-lc", "pyenv root"], capture_output=True, text=True).stdout.strip()
    found = {}
    for exe in sorted(glob.glob(os.path.join(pyenv or "/root/.pyenv", "versions/3.1[0-3]*/bin/python3"))):
        minor = ".".join(exe.split("/versions/")[1].split(".")[:2])
        found.setdefault(minor, exe)
    return found


def workloads(native):
    out = [("native call_sites", [native], {})]
    script = os.path.join(root, "tests/python/call_sites.py")
    for minor, python in pythons().items():
        out.append((f"python {minor} call_sites.py",
                    [python, script, os.path.join(sim, "libcudart.so.12"),
                     os.path.join(work, f"py{minor}.json"), "0", "0"], {}))
    step = os.path.join(root, "target/bench/train_step")
    plan = os.path.join(root, "target/bench/step_plan.txt")
    if os.path.exists(step) and os.path.exists(plan):
        out.append(("training-shaped loop (USDT)", [step, plan, "200000", "2", "20", "2"], {}))
    return out


def record(tracer, tag, runs):
    db = os.path.join(work, f"{tag}.db")
    for f in glob.glob(db + "*"):
        os.remove(f)
    libs = ["--lib", os.path.join(sim, "libcudart.so.12"), "--lib", os.path.join(sim, "libsimtorch.so")]
    err = open(os.path.join(work, f"{tag}.err"), "w")
    t = subprocess.Popen([tracer, "trace", "--stack", "--db", db] + libs, stdout=subprocess.DEVNULL, stderr=err)
    time.sleep(4)
    pids = []
    for name, argv, env in runs:
        p = subprocess.run(argv, capture_output=True, env={**os.environ, **env})
        pids.append((name, p.returncode))
        time.sleep(0.3)
    time.sleep(0.5)
    t.send_signal(signal.SIGINT)
    t.wait(timeout=60)
    return db


def query(tracer, db, sql):
    out = subprocess.run([tracer, "query", "--db", db, "--format", "json", sql],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out) if out.strip() else []


def sites(tracer, db):
    """Per process (in the order of their first call): the calls in order, each with its site."""
    frames = {}
    for f in query(tracer, db, "SELECT stack_id, kind, function, file, line, module, address "
                   "FROM stack_frames ORDER BY stack_id, idx"):
        frames.setdefault(f["stack_id"], []).append(
            (f["kind"], f["function"], f["file"], f["line"], f["module"], f["address"]))
    rows = query(tracer, db, "SELECT ts_ns, pid, op, size, stack_id FROM events UNION ALL "
                 "SELECT ts_ns, pid, op, size, stack_id FROM tensor_events ORDER BY ts_ns")
    procs, order = {}, []
    for r in rows:
        pid = r["pid"]
        if pid not in procs:
            order.append(pid)
            procs[pid] = []
        sid = r["stack_id"]
        procs[pid].append((r["op"], r["size"], tuple(frames.get(sid, [])) if sid is not None else None))
    return [procs[p] for p in order]


native = build_native()
runs = workloads(native)
a = sites(after, record(before, "before", runs))
b = sites(after, record(after, "after", runs))
failed = False
for i, (name, _, _) in enumerate(runs):
    x = a[i] if i < len(a) else []
    y = b[i] if i < len(b) else []
    # Threads interleave differently run to run: compare each call site's count, then the
    # sequence of sites per op.
    def summary(calls):
        out = {}
        for op, size, frames in calls:
            out.setdefault((op, size, frames), 0)
            out[(op, size, frames)] += 1
        return out
    sx, sy = summary(x), summary(y)
    no_site = sum(1 for c in y if c[2] is None or c[2] == ())
    same = sx == sy and len(x) == len(y) and len(x) > 0
    print(f"{name}: {len(x)} calls before, {len(y)} after; {len(sx)} distinct (op, size, site) "
          f"before, {len(sy)} after; calls without a site after: {no_site}; "
          f"{'same' if same else 'DIFFERENT'}")
    if not same:
        failed = True
        for k in set(sx) | set(sy):
            if sx.get(k) != sy.get(k):
                print(f"  {k[0]} size {k[1]}: before {sx.get(k, 0)}, after {sy.get(k, 0)}; frames {k[2]}")
                break
sys.exit(1 if failed else 0)
