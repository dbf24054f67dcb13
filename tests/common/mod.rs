//! What the end-to-end test files share: the tracer binary, fixtures, a running trace,
//! queries and the simulated runtime.

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard},
    time::{Duration, Instant},
};

use serde_json::Value;

pub const TRACER: &str = env!("CARGO_BIN_EXE_tracer");
pub const NOBODY: u32 = 65534;

/// Uprobes on one file fire for every process using it. A test whose traces probe only its own
/// copies of the libraries, and whose processes load only those, runs beside others like it
/// ([`scoped`]); one that discovers, probes a file others load (the real runtime, PyTorch's
/// libraries, the demos' runtime) or times what it measures runs alone ([`serial`]).
static LOCK: RwLock<()> = RwLock::new(());

/// Runs this test alone among the tests that take the lock.
pub fn serial() -> RwLockWriteGuard<'static, ()> {
    LOCK.write().unwrap_or_else(|e| e.into_inner())
}

/// Runs this test beside other scoped tests, never beside a [`serial`] one.
pub fn scoped() -> RwLockReadGuard<'static, ()> {
    LOCK.read().unwrap_or_else(|e| e.into_inner())
}

/// The demos share one simulated runtime (target/simcuda-demo): a demo traced live probes it,
/// so no other demo's workload may run beside it; demos from the runtime's own log run beside
/// each other. Either runs beside the scoped tests.
static DEMO: RwLock<()> = RwLock::new(());

/// What a demo holds of the locks.
pub struct DemoTurn {
    _demo: Turn,
    _turn: RwLockReadGuard<'static, ()>,
}

/// The demos' runtime built, then this demo's turn (`traced`: it probes that runtime).
pub fn demo_turn(traced: bool) -> DemoTurn {
    demo_runtime_built();
    let demo = if traced {
        Turn::Alone(DEMO.write().unwrap_or_else(|e| e.into_inner()))
    } else {
        Turn::Beside(DEMO.read().unwrap_or_else(|e| e.into_inner()))
    };
    DemoTurn {
        _demo: demo,
        _turn: scoped(),
    }
}

/// The demos' simulated runtime, built once before any demo runs (two demos starting at once
/// would both build it into the same folder). Called holding no lock.
fn demo_runtime_built() {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let _alone = serial();
        let out = Command::new("bash")
            .arg(workspace().join("demos/simcuda/build.sh"))
            .arg(workspace().join("target/simcuda-demo"))
            .output()
            .unwrap();
        assert_ok(&out);
    });
}

/// What a fixture holds of the lock.
pub enum Turn {
    Alone(#[allow(dead_code, reason = "held for its drop")] RwLockWriteGuard<'static, ()>),
    Beside(#[allow(dead_code, reason = "held for its drop")] RwLockReadGuard<'static, ()>),
}

pub fn privileged() -> bool {
    if nix_is_root() {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "CI=true: end-to-end tests need root"
    );
    skipped("needs root");
    false
}

/// Says on standard error, past the harness's capture, that this test did not run and why.
pub fn skipped(why: &str) {
    use std::io::Write as _;
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    let _ = writeln!(std::io::stderr(), "skipped ({why}): {test}");
}

/// The command's output, which must say it succeeded (its standard error shown when not).
#[track_caller]
pub fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Waits until `done` holds, looking every 20 ms; fails naming `what` after `limit`.
pub fn wait_until(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn nix_is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Builds the simulated runtime once per test run (or takes the one scripts/test.sh built as the
/// invoking user under sudo: TRACER_TEST_SIM).
pub fn sim() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(prebuilt) = std::env::var_os("TRACER_TEST_SIM") {
            return PathBuf::from(prebuilt);
        }
        let out = workspace().join("target").join("simcuda-e2e");
        let status = Command::new("bash")
            .arg(workspace().join("demos/simcuda/build.sh"))
            .arg(&out)
            .stdout(Stdio::null())
            .status()
            .expect("run demos/simcuda/build.sh");
        assert!(status.success(), "building the simulated runtime failed");
        out
    })
}

/// A temporary folder with these permissions (0o777: others may write there, as the
/// unprivileged users the tests run as must).
pub fn dir_with_mode(mode: u32) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(mode),
    )
    .unwrap();
    dir
}

/// A private copy of the simulated libraries (new inodes: not probed by anyone else).
pub fn sim_copy(dir: &Path) -> PathBuf {
    let out = dir.join("sim");
    std::fs::create_dir_all(&out).unwrap();
    for f in [
        "libcudart.so.12",
        "libcuda.so.1",
        "libsimtorch.so",
        "libnvidia-ml.so.1",
        "libsimcublas.so",
        "libsimnccl.so",
        "simdriver",
        "staticapp",
        "burst",
    ] {
        std::fs::copy(sim().join(f), out.join(f)).unwrap();
    }
    out
}

/// A privileged test with its own directory, database path and library copies: alone
/// ([`Fixture::new`]) or beside other scoped tests ([`Fixture::scoped`]).
pub struct Fixture {
    pub _guard: Turn,
    pub _dir: tempfile::TempDir,
    pub sim: PathBuf,
    pub db: PathBuf,
}

impl Fixture {
    pub fn new() -> Option<Fixture> {
        Fixture::taking(|| Turn::Alone(serial()))
    }

    /// A fixture for a test whose traces probe only this fixture's copies and whose processes
    /// load only those, and which times nothing it asserts.
    pub fn scoped() -> Option<Fixture> {
        Fixture::taking(|| Turn::Beside(scoped()))
    }

    fn taking(turn: impl FnOnce() -> Turn) -> Option<Fixture> {
        if !privileged() {
            return None;
        }
        let _guard = turn();
        let dir = tempfile::tempdir().unwrap();
        let sim = sim_copy(dir.path());
        let db = dir.path().join("t.db");
        Some(Fixture {
            _guard,
            _dir: dir,
            sim,
            db,
        })
    }
}

impl Fixture {
    /// The path of `name` in this fixture's copy of the simulated runtime.
    pub fn lib(&self, name: &str) -> String {
        self.sim.join(name).to_str().unwrap().to_owned()
    }

    /// `tracer trace` on these libraries of the fixture's copy (`--lib` each), then `extra`.
    pub fn trace(&self, libs: &[&str], extra: &[&str]) -> Trace {
        self.trace_with_env(libs, extra, &[])
    }

    /// [`Fixture::trace`] with these variables in tracer's environment.
    pub fn trace_with_env(&self, libs: &[&str], extra: &[&str], env: &[(&str, &str)]) -> Trace {
        let libs: Vec<String> = libs.iter().map(|name| self.lib(name)).collect();
        let mut args: Vec<&str> = libs.iter().flat_map(|l| ["--lib", l.as_str()]).collect();
        args.extend_from_slice(extra);
        Trace::start_with_env(&self.db, &args, env)
    }
}

pub fn real_cudart() -> PathBuf {
    let dir = std::env::var_os("TRACER_REAL_CUDART_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/tracer/cuda-runtime-cu12")
        });
    let lib = dir.join("libcudart.so.12");
    assert!(
        lib.exists(),
        "{} missing: run scripts/setup.sh",
        lib.display()
    );
    lib
}

/// PyTorch's real libc10.so of a wheel (scripts/setup.sh --tests fetches 2.11.0 and 2.15.0).
pub fn torch_lib(version: &str, name: &str) -> PathBuf {
    let dir = std::env::var_os("TRACER_TORCH_LIBS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/tracer/torch-libs")
        });
    let lib = dir.join(version).join(name);
    assert!(
        lib.exists(),
        "{} missing: run scripts/setup.sh --tests",
        lib.display()
    );
    lib
}

pub struct Trace {
    pub child: Child,
    /// The session, from the `started` line `tracer trace --json` prints once attached.
    pub session: i64,
    /// That line, whole (the metrics address with --metrics).
    pub started: Value,
    pub stdout: Lines,
    pub stderr: Lines,
}

/// A trace a failed test left running is stopped as Ctrl-C stops it (a tracer killed outright
/// would leave stopped the processes it had stopped for discovery), so that it does not trace
/// the next tests' processes.
impl Drop for Trace {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on our own child, not yet reaped.
            unsafe { libc_kill(self.child.id() as i32, 2) };
            let deadline = Instant::now() + Duration::from_secs(30);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A pipe's lines, as they come.
pub type Lines = std::sync::Arc<Mutex<Vec<String>>>;

/// What a stopped trace printed: its JSON summary line, and its diagnostics.
pub struct Stopped {
    pub summary: Value,
    pub stderr: String,
}

impl Stopped {
    /// The libraries it probed, as (path, origin).
    pub fn libraries(&self) -> Vec<(String, String)> {
        self.summary["libraries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                (
                    l["path"].as_str().unwrap().to_owned(),
                    l["origin"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    pub fn counter(&self, name: &str) -> i64 {
        self.summary["counters"][name]
            .as_i64()
            .unwrap_or_else(|| panic!("no counter {name} in {:#}", self.summary))
    }
}

/// Collects a pipe's lines on a thread, sending each to `tx` too.
pub fn collect_lines(
    pipe: impl std::io::Read + Send + 'static,
    tx: std::sync::mpsc::Sender<String>,
) -> Lines {
    let lines = std::sync::Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            sink.lock().unwrap().push(line);
        }
    });
    lines
}

impl Trace {
    /// Starts `tracer trace --json` and waits until its probes are attached.
    pub fn start(db: &Path, args: &[&str]) -> Trace {
        Trace::start_with_env(db, args, &[])
    }

    /// [`Trace::start`] with these variables in tracer's environment.
    pub fn start_with_env(db: &Path, args: &[&str], env: &[(&str, &str)]) -> Trace {
        let mut cmd = Command::new(TRACER);
        cmd.args(["trace", "--json", "--db"])
            .arg(db)
            .args(args)
            .envs(env.iter().copied());
        Trace::start_command(cmd)
    }

    /// [`Trace::start`] as on another node: in a UTS namespace of its own whose host name is
    /// `node` (what tracer records as the node).
    pub fn start_on_node(db: &Path, args: &[&str], node: &str) -> Trace {
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--uts",
            "--",
            "sh",
            "-c",
            "hostname \"$0\" && exec \"$@\"",
            node,
            TRACER,
        ])
        .args(["trace", "--json", "--db"])
        .arg(db)
        .args(args);
        Trace::start_command(cmd)
    }

    fn start_command(mut cmd: Command) -> Trace {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tracer");
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = collect_lines(child.stdout.take().unwrap(), tx);
        let stderr = collect_lines(child.stderr.take().unwrap(), std::sync::mpsc::channel().0);
        let started: Value = loop {
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(line) => {
                    let v: Value = serde_json::from_str(&line).expect("a JSON line");
                    if v["event"] == "started" {
                        break v;
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    panic!(
                        "tracer did not start: {}",
                        stderr.lock().unwrap().join("\n")
                    );
                }
            }
        };
        let session = started["session"].as_i64().unwrap();
        Trace {
            child,
            session,
            started,
            stdout,
            stderr,
        }
    }

    /// Waits until tracer has said a line containing `text` on standard error.
    pub fn wait_for_stderr(&self, text: &str) {
        wait_until(
            Duration::from_secs(30),
            &format!("tracer to say {text:?}"),
            || self.stderr.lock().unwrap().iter().any(|l| l.contains(text)),
        );
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc_kill(self.child.id() as i32, sig) };
    }

    /// Stops it with `sig` (0: wait for it to stop by itself); its summary and diagnostics.
    pub fn stop(mut self, sig: i32) -> Stopped {
        if sig != 0 {
            self.signal(sig);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                Instant::now() < deadline,
                "tracer did not stop: {}",
                self.stderr.lock().unwrap().join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        std::thread::sleep(Duration::from_millis(100));
        let stderr = self.stderr.lock().unwrap().join("\n");
        let lines = self.stdout.lock().unwrap().clone();
        assert!(
            status.success(),
            "tracer failed ({status}):\n{stderr}\n{lines:?}"
        );
        let summary: Value = lines
            .iter()
            .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
            .find(|v| v["event"] == "summary")
            .unwrap_or_else(|| panic!("no summary line in {lines:?}"));
        assert_eq!(summary["session"], self.session);
        Stopped { summary, stderr }
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    pub fn libc_kill(pid: i32, sig: i32) -> i32;
}
pub const SIGINT: i32 = 2;
pub const SIGTERM: i32 = 15;

pub fn query(db: &Path, sql: &str) -> Vec<Value> {
    let out = Command::new(TRACER)
        .args(["query", "--format", "json", "--db"])
        .arg(db)
        .arg(sql)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "query {sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    match serde_json::from_slice(&out.stdout).unwrap() {
        Value::Array(rows) => rows,
        other => panic!("not an array: {other}"),
    }
}

/// `tracer explain --db DB`'s text; it must succeed.
pub fn explain_text(db: &Path) -> String {
    let out = Command::new(TRACER)
        .args(["explain", "--db"])
        .arg(db)
        .output()
        .unwrap();
    assert_ok(&out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `tracer ARGS --db DB`'s text; it must succeed.
pub fn tracer_text(db: &Path, args: &[&str]) -> String {
    let out = Command::new(TRACER)
        .args(args)
        .arg("--db")
        .arg(db)
        .output()
        .unwrap();
    assert_ok(&out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `tracer ARGS --db DB` as JSON (ARGS asks for it: `--json`); it must succeed.
pub fn tracer_json(db: &Path, args: &[&str]) -> Value {
    let out = Command::new(TRACER)
        .args(args)
        .arg("--db")
        .arg(db)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tracer {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// An explain report's chain of `rule` (it must have one).
pub fn chain<'a>(report: &'a Value, rule: &str) -> &'a Value {
    report["chains"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["rule"] == rule)
        .unwrap_or_else(|| panic!("no {rule} chain in {report:#}"))
}

/// The devices of an explain report's rows (one per process and device), in its order.
pub fn report_devices(report: &Value) -> Vec<i64> {
    report["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["device"].as_i64().unwrap())
        .collect()
}

/// The rules of an explain report's chains, in its order.
pub fn rule_names(report: &Value) -> Vec<&str> {
    report["chains"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["rule"].as_str().unwrap())
        .collect()
}

pub fn scalar(db: &Path, sql: &str) -> i64 {
    query(db, sql)[0]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()
        .as_i64()
        .unwrap_or_else(|| panic!("{sql}: not an integer"))
}

pub fn driver(sim: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(sim.join("simdriver"));
    cmd.args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

pub fn report(out: Output) -> Value {
    assert!(
        out.status.success(),
        "simdriver failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("simdriver report")
}

pub fn total_calls(report: &Value) -> i64 {
    report["ops"]
        .as_object()
        .unwrap()
        .values()
        .map(|o| o["calls"].as_i64().unwrap())
        .sum()
}

/// The incident's training loop (demos/workloads/train.py) on the simulated 3 GiB device, as
/// `tracer demo incident --duration 10s` runs it.
pub fn incident_workload(sim: &Path) -> Command {
    let mut cmd = Command::new("python3");
    cmd.arg(workspace().join("demos/workloads/train.py"))
        .args(["incident", "--duration", "10", "--cudart"])
        .arg(sim.join("libcudart.so.12"))
        .env("SIMCUDA_MEM", "3GiB")
        .env(
            "SIMCUDA_LATENCY",
            "cudaMalloc=60us,cudaFree=15us,cudaStreamSynchronize=2ms,default=2us",
        )
        .env("SIMCUDA_LATENCY_PER_FRAGMENT_NS", "20000");
    cmd
}

/// Traces the incident workload (the runtime and the allocator's probes, plus `extra`
/// options), runs `while_running` before the trace stops; the workload's own account.
pub fn record_incident(fx: &Fixture, extra: &[&str], while_running: impl FnOnce()) -> Value {
    let lib = |name: &str| fx.sim.join(name).to_str().unwrap().to_owned();
    let (cudart, torch) = (lib("libcudart.so.12"), lib("libsimtorch.so"));
    let mut args = vec!["--lib", &cudart, "--lib", &torch, "--quiet"];
    args.extend_from_slice(extra);
    let trace = Trace::start(&fx.db, &args);
    let out = incident_workload(&fx.sim).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("OutOfMemoryError"));
    while_running();
    trace.stop(2);
    workload_result(&out.stdout)
}

/// The workload allocator's own account at its end (its `result` line).
pub fn workload_result(stdout: &[u8]) -> Value {
    String::from_utf8_lossy(stdout)
        .lines()
        .find_map(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .filter(|v| v["result"].is_object())
        })
        .expect("the workload's result line")
}

/// Runs python3 with the tests' Python tools on its path (`args`: a script and its arguments,
/// or `-c CODE ...`); its stdout, which must be JSON.
pub fn python_json<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Value {
    let out = Command::new("python3")
        .env("PYTHONPATH", pylib())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python3 {:?}: {}",
        args.first().map(|a| a.as_ref().to_owned()),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "python printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Where `scripts/setup.sh --tests` installs the Python tools the tests use (kubernetes-validate,
/// PyYAML, perfetto, mcp, selenium).
pub fn pylib() -> PathBuf {
    std::env::var_os("TRACER_PYLIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/tracer/pylib")
        })
}

/// `tracer export --format pytorch-snapshot ARGS --db DB -o FILE`; it must succeed. Its stderr
/// (what it left out).
pub fn export_snapshot(db: &Path, file: &Path, args: &[&str]) -> String {
    let out = Command::new(TRACER)
        .args(["export", "--format", "pytorch-snapshot"])
        .args(args)
        .arg("--db")
        .arg(db)
        .arg("-o")
        .arg(file)
        .output()
        .unwrap();
    assert_ok(&out);
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A memory snapshot's allocator figures (tests/python/snapshot_compare.py --figures); the
/// file must be consistent with itself.
pub fn snapshot_figures(file: &Path) -> Value {
    let out = Command::new("python3")
        .arg(workspace().join("tests/python/snapshot_compare.py"))
        .arg("--figures")
        .arg(file)
        .output()
        .unwrap();
    assert_ok(&out);
    let figures: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(figures["faults"], serde_json::json!([]), "{figures:#}");
    figures
}

/// A memory snapshot's block entries (alloc, free_requested, free_completed) in trace order:
/// (action, address).
pub fn snapshot_block_actions(file: &Path) -> Vec<(String, u64)> {
    let out = Command::new("python3")
        .arg(workspace().join("tests/python/snapshot_compare.py"))
        .arg("--block-actions")
        .arg(file)
        .output()
        .unwrap();
    assert_ok(&out);
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Compares an exported snapshot with its original, part by part (snapshot_compare.py): every
/// part must be equal. The parts, with their counts.
pub fn assert_snapshots_equal(original: &Path, exported: &Path) -> Value {
    assert_snapshots_equal_in(original, exported, &[])
}

/// [`assert_snapshots_equal`] for the named parts only (all: none named).
pub fn assert_snapshots_equal_in(original: &Path, exported: &Path, only: &[&str]) -> Value {
    let out = Command::new("python3")
        .arg(workspace().join("tests/python/snapshot_compare.py"))
        .arg(original)
        .arg(exported)
        .output()
        .unwrap();
    assert_ok(&out);
    let parts: Value = serde_json::from_slice(&out.stdout).unwrap();
    for (part, v) in parts.as_object().unwrap() {
        if !v.is_object() || !(only.is_empty() || only.contains(&part.as_str())) {
            continue;
        }
        assert_eq!(
            v["compared"],
            v["equal"],
            "{}: {part}: {v:#}",
            original.display()
        );
    }
    parts
}

/// What PyTorch's own `_memory_viz.py ACTION FILE` (the real wheel's, run as a script) prints;
/// it must succeed.
pub fn memory_viz(version: &str, action: &str, file: &Path) -> String {
    let out = Command::new("python3")
        .arg(torch_lib(version, "_memory_viz.py"))
        .arg(action)
        .arg(file)
        .output()
        .unwrap();
    assert_ok(&out);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An HTTP/1.0 GET: the status code and body; None when the connection closed unanswered.
pub fn get(addr: std::net::SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(20))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: t\r\n\r\n").ok()?;
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_owned()))
}

/// A port nothing listens on (it was free a moment ago).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The YAML documents of a file, as JSON.
pub fn yaml(path: &Path) -> Vec<Value> {
    let code = "import json, sys, yaml; print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d]))";
    serde_json::from_value(python_json(&[
        "-c".as_ref(),
        std::ffi::OsStr::new(code),
        path.as_os_str(),
    ]))
    .unwrap()
}

/// The JSON the page embeds, read from the file itself.
pub fn embedded_data(html: &str) -> Value {
    let start = html
        .find(r#"<script type="application/json" id="data">"#)
        .expect("the data element");
    let body = &html[start..];
    let body = &body[body.find('>').unwrap() + 1..];
    let end = body.find("</script>").unwrap();
    serde_json::from_str(&body[..end]).unwrap()
}
