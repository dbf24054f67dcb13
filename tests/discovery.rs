//! Discovery as it happens (issue 52): tracer started first, no `--lib`, the runtime in a folder
//! tracer does not scan (a copy of its own, made after tracer started: no scan can have found
//! it). A process that opens it is stopped in the kernel until its library is probed, so that a
//! program that runs for a millisecond has every call; where tracer cannot stop it (its parent
//! a shell) it is found late, and the session, `tracer query` and explain say so.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use crate::common::*;
use serde_json::Value;

const SIGINT: i32 = 2;

/// A discovering trace, once the kernel has finished removing earlier tests' probes (their
/// tracers' background removal holds the lock every uprobe's creation takes: an attach would
/// wait seconds behind it, and a stopped process with it).
fn discovering(db: &Path, extra: &[&str]) -> Trace {
    wait_until(
        Duration::from_secs(180),
        "earlier tracers' probes to be removed",
        || {
            std::fs::read_dir("/proc").unwrap().flatten().all(|e| {
                std::fs::read_to_string(e.path().join("comm"))
                    .map_or(true, |c| c.trim_end() != "tracer-detach")
            })
        },
    );
    let mut args = vec!["--quiet"];
    args.extend_from_slice(extra);
    Trace::start(db, &args)
}

/// A fresh folder holding the runtime and the driver it links (new inodes, new paths).
fn runtime_in(fx: &Fixture, name: &str) -> PathBuf {
    let dir = fx.sim.parent().unwrap().join(name).join("lib");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["libcudart.so.12", "libcuda.so.1"] {
        std::fs::copy(fx.sim.join(f), dir.join(f)).unwrap();
    }
    dir.join("libcudart.so.12")
}

fn burst(fx: &Fixture, runtime: &Path, args: &[&str]) -> Value {
    let out = Command::new(fx.sim.join("burst"))
        .arg(runtime)
        .args(args)
        .output()
        .unwrap();
    report(out)
}

/// `burst` as a shell's job: `sh -c 'setsid burst ...; true'` keeps the shell its parent and
/// gives it a process group of its own, as a shell with job control does (tracer does not stop
/// it); without `setsid`, a script's child (`sh -c 'burst ...; true'`), which tracer stops.
fn burst_under_shell(fx: &Fixture, runtime: &Path, args: &str, job: bool) -> Value {
    let script = format!(
        "{}{} {} {args}; true",
        if job { "setsid " } else { "" },
        fx.sim.join("burst").display(),
        runtime.display()
    );
    report(Command::new("sh").args(["-c", &script]).output().unwrap())
}

fn calls(db: &Path, pid: i64, op: &str) -> i64 {
    scalar(
        db,
        &format!("SELECT count(*) FROM events WHERE pid = {pid} AND op = '{op}' AND ret = 0"),
    )
}

fn discovery(db: &Path, pid: i64) -> Vec<Value> {
    query(
        db,
        &format!("SELECT library, outcome, held_us, probed_ns, why FROM discovery WHERE pid = {pid} ORDER BY rowid"),
    )
}

#[test]
fn a_program_that_runs_for_a_millisecond_has_every_call_traced() {
    let Some(fx) = Fixture::new() else {
        return;
    };
    // What the program is, untraced: its first call within 1 ms of its start, its end within
    // 20 ms (300 cudaMalloc/cudaFree pairs).
    let alone = burst(&fx, &runtime_in(&fx, "untraced"), &["300"]);
    assert!(alone["first_call_us"].as_f64().unwrap() < 1000.0, "{alone}");
    assert!(alone["exit_us"].as_f64().unwrap() < 20_000.0, "{alone}");

    let trace = discovering(&fx.db, &[]);
    let runtime = runtime_in(&fx, "after-start");
    let rep = burst(&fx, &runtime, &["300"]);
    let pid = rep["pid"].as_i64().unwrap();
    // A second run of the same path is not stopped: the kernel knows it probed.
    let again = burst(&fx, &runtime, &["300"]);
    // A script's child (no job control: it stays in the script's process group) is stopped.
    let scripted = burst_under_shell(&fx, &runtime_in(&fx, "script"), "300", false);
    let stopped = trace.stop(SIGINT);

    assert_eq!(calls(&fx.db, pid, "cudaMalloc"), 300, "{}", stopped.stderr);
    assert_eq!(calls(&fx.db, pid, "cudaFree"), 300);
    let rows = discovery(&fx.db, pid);
    let cudart = rows
        .iter()
        .find(|r| r["library"] == runtime.display().to_string())
        .unwrap_or_else(|| panic!("{rows:?}"));
    assert_eq!(cudart["outcome"], "held", "{rows:?}");
    assert!(cudart["held_us"].as_i64().unwrap() > 0, "{rows:?}");
    // The driver the runtime links was opened (and held) too.
    assert!(
        rows.iter()
            .any(|r| r["library"].as_str().unwrap().ends_with("/libcuda.so.1")),
        "{rows:?}"
    );
    let pid2 = again["pid"].as_i64().unwrap();
    assert_eq!(calls(&fx.db, pid2, "cudaMalloc"), 300);
    assert!(
        discovery(&fx.db, pid2)
            .iter()
            .all(|r| r["outcome"] == "probed" && r["held_us"].is_null()),
        "{:?}",
        discovery(&fx.db, pid2)
    );
    assert_eq!(
        scalar(
            &fx.db,
            &format!("SELECT count(*) FROM gaps WHERE pid IN ({pid}, {pid2})")
        ),
        0
    );
    // The summary counts what the table holds (the test's own copies, reads of the runtime
    // tracer had not probed, were held too).
    assert_eq!(
        stopped.summary["discovery"]["held"].as_i64(),
        Some(scalar(
            &fx.db,
            "SELECT count(*) FROM discovery WHERE outcome = 'held'"
        ))
    );
    assert_eq!(stopped.summary["discovery"]["unseen"].as_i64(), Some(0));
    let pid3 = scripted["pid"].as_i64().unwrap();
    assert_eq!(calls(&fx.db, pid3, "cudaMalloc"), 300);
    assert_eq!(discovery(&fx.db, pid3)[0]["outcome"], "held");
}

#[test]
fn a_program_in_a_virtual_environment_made_after_the_trace_began_is_traced_from_its_first_call() {
    let Some(fx) = Fixture::new() else {
        return;
    };
    let trace = discovering(&fx.db, &[]);
    // As `python -m venv .venv` in a project folder, the runtime where its wheel puts it.
    let venv = fx.sim.parent().unwrap().join("project/.venv");
    let out = Command::new("python3")
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .output()
        .unwrap();
    assert_ok(&out);
    let site = std::fs::read_dir(venv.join("lib"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
        .join("site-packages/nvidia/cuda_runtime/lib");
    std::fs::create_dir_all(&site).unwrap();
    for f in ["libcudart.so.12", "libcuda.so.1"] {
        std::fs::copy(fx.sim.join(f), site.join(f)).unwrap();
    }
    let script = format!(
        r#"
import ctypes, json, os
rt = ctypes.CDLL("{}")
ptr = ctypes.c_void_p()
ok = 0
for i in range(100):
    if rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0:
        ok += 1
        rt.cudaFree(ptr)
print(json.dumps({{"pid": os.getpid(), "granted": ok}}))
"#,
        site.join("libcudart.so.12").display()
    );
    let out = Command::new(venv.join("bin/python"))
        .args(["-c", &script])
        .output()
        .unwrap();
    let rep = report(out);
    let stopped = trace.stop(SIGINT);
    let pid = rep["pid"].as_i64().unwrap();
    assert_eq!(rep["granted"], 100);
    assert_eq!(calls(&fx.db, pid, "cudaMalloc"), 100, "{}", stopped.stderr);
    assert_eq!(calls(&fx.db, pid, "cudaFree"), 100);
    let rows = discovery(&fx.db, pid);
    assert!(
        rows.iter()
            .any(|r| r["outcome"] == "held"
                && r["library"].as_str().unwrap().contains("/.venv/lib/")),
        "{rows:?}"
    );
    assert_eq!(
        scalar(
            &fx.db,
            &format!("SELECT count(*) FROM gaps WHERE pid = {pid}")
        ),
        0
    );
}

#[test]
fn a_process_found_late_or_never_traced_is_marked_in_the_session_query_and_explain() {
    let Some(fx) = Fixture::new() else {
        return;
    };
    let trace = discovering(&fx.db, &[]);
    // A shell's child is not stopped (the shell would report the stop as the user's): 50
    // pairs at once, before the probes can be on, then 50 more once tracer says it probes
    // the library (at least 250 ms later).
    let runtime = runtime_in(&fx, "late");
    let go = fx.sim.parent().unwrap().join("go");
    let script = format!(
        "setsid {} {} 50 250 {}; true",
        fx.sim.join("burst").display(),
        runtime.display(),
        go.display()
    );
    let child = Command::new("sh")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    trace.wait_for_stderr(&format!("probing {}", runtime.display()));
    std::fs::write(&go, b"").unwrap();
    let late = report(child.wait_with_output().unwrap());
    // Three pairs and gone, from a path never probed: nothing of it can be seen.
    let gone = burst_under_shell(&fx, &runtime_in(&fx, "gone"), "3", true);
    let stopped = trace.stop(SIGINT);
    let (pid, pid_gone) = (late["pid"].as_i64().unwrap(), gone["pid"].as_i64().unwrap());

    // Late: what came after the probes is there, what came before is not. The probes may go
    // on before the burst's first call (their uprobe_multi links take well under a millisecond,
    // and the loader's work after the open as long): then all 100 are seen, and the probes were
    // on by their recorded time (stamped once the attach returned) or within its few ms.
    let seen = calls(&fx.db, pid, "cudaMalloc");
    let rows = discovery(&fx.db, pid);
    let first_call = scalar(
        &fx.db,
        &format!("SELECT min(ts_ns) FROM events WHERE pid = {pid} AND op = 'cudaMalloc'"),
    );
    let probed = rows.iter().filter_map(|r| r["probed_ns"].as_i64()).max();
    assert!(
        (50..100).contains(&seen)
            || (seen == 100 && probed.is_some_and(|p| p < first_call + 10_000_000)),
        "{seen} of 100 seen, the first at {first_call}: {rows:?}\n{}",
        stopped.stderr
    );
    assert_eq!(rows[0]["outcome"], "late", "{rows:?}");
    assert!(
        rows[0]["why"]
            .as_str()
            .unwrap()
            .contains("a job of a shell"),
        "{rows:?}"
    );
    // In `tracer query`: its gap, from the open to its first call seen.
    let gap = query(
        &fx.db,
        &format!(
            "SELECT from_ns, to_ns, detail FROM gaps WHERE pid = {pid} AND kind = 'found_late'"
        ),
    );
    assert_eq!(gap.len(), 1, "{gap:?}");
    let first_seen = scalar(
        &fx.db,
        &format!("SELECT min(ts_ns) FROM events WHERE pid = {pid}"),
    );
    // The registry and the store make wall time from the same clock offset.
    assert!(
        (gap[0]["to_ns"].as_i64().unwrap() - first_seen).abs() < 1_000_000,
        "{gap:?} vs first call at {first_seen}"
    );
    // From its open (before the probes were on) to its first call seen.
    let span_ms =
        (gap[0]["to_ns"].as_i64().unwrap() - gap[0]["from_ns"].as_i64().unwrap()) / 1_000_000;
    assert!((0..30_000).contains(&span_ms), "{span_ms} ms");

    // Never traced: counted and named (ended before the probes were on, or just after they
    // went on, before any call: late, and no call seen).
    let rows_gone = discovery(&fx.db, pid_gone);
    let outcome = rows_gone[0]["outcome"].as_str().unwrap();
    assert!(outcome == "missed" || outcome == "late", "{rows_gone:?}");
    assert_eq!(calls(&fx.db, pid_gone, "cudaMalloc"), 0);
    assert_eq!(
        stopped.summary["discovery"]["unseen"].as_i64(),
        Some(2),
        "{}",
        stopped.stderr
    );
    assert!(
        stopped.stderr.contains(&format!("pid {pid} (burst) late")),
        "{}",
        stopped.stderr
    );

    // explain: the late process's gap and the one never traced.
    let text = explain_text(&fx.db);
    assert!(
        text.contains(&format!("Not seen: pid {pid} from")) && text.contains("(found_late)"),
        "{text}"
    );
    assert!(
        text.contains(&format!("Never traced: pid {pid_gone} (burst)")),
        "{text}"
    );
}

/// A process that only reads a file named like a probed library (a copy, an installer) and
/// never maps it is recorded as having read it, not as found late: after the probes went on,
/// tracer watches it a moment for a loader's mapping before it says so.
#[test]
fn a_process_that_only_reads_a_library_is_recorded_as_read() {
    let Some(fx) = Fixture::new() else {
        return;
    };
    let trace = discovering(&fx.db, &[]);
    let runtime = runtime_in(&fx, "copied");
    // A shell's job (not stopped): reads the whole file, says its pid, lives on a second.
    let script = format!(
        "setsid python3 -c 'import os, time; open(\"{}\", \"rb\").read(); print(os.getpid(), flush=True); time.sleep(1)'; true",
        runtime.display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    let pid: i64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let stopped = trace.stop(SIGINT);
    let rows = discovery(&fx.db, pid);
    assert_eq!(rows.len(), 1, "{rows:?}\n{}", stopped.stderr);
    assert_eq!(rows[0]["outcome"], "read", "{rows:?}\n{}", stopped.stderr);
    assert!(
        rows[0]["library"]
            .as_str()
            .is_some_and(|l| l.ends_with("copied/lib/libcudart.so.12")),
        "{rows:?}"
    );
    assert_eq!(calls(&fx.db, pid, "cudaMalloc"), 0);
}

#[test]
fn two_tracers_discovering_at_once_each_see_every_call_or_say_what_they_missed() {
    let Some(fx) = Fixture::new() else {
        return;
    };
    // A DaemonSet's tracer and a user's on one node: both stop the process; the first to have
    // probed continues it, perhaps before the other has.
    let second = fx.db.with_file_name("second.db");
    let a = discovering(&fx.db, &[]);
    let b = discovering(&second, &[]);
    let rep = burst(&fx, &runtime_in(&fx, "both"), &["300"]);
    let pid = rep["pid"].as_i64().unwrap();
    let (sa, sb) = (a.stop(SIGINT), b.stop(SIGINT));
    for (db, stderr) in [(&fx.db, &sa.stderr), (&second, &sb.stderr)] {
        let seen = calls(db, pid, "cudaMalloc");
        let rows = discovery(db, pid);
        let gaps = scalar(
            db,
            &format!("SELECT count(*) FROM gaps WHERE pid = {pid} AND kind = 'found_late'"),
        );
        let unseen = rows
            .iter()
            .any(|r| r["outcome"] == "late" || r["outcome"] == "missed");
        if seen == 300 {
            // The runtime probed while the process waited (the driver it loads next may have
            // been continued by the other tracer first: its row then says late or missed), or
            // the other tracer continued it and this one's probes still went on before its
            // first call (a uprobe_multi link takes well under a millisecond): late, with the
            // probes on by their recorded time or within its few ms.
            let first_call = scalar(
                db,
                &format!("SELECT min(ts_ns) FROM events WHERE pid = {pid} AND op = 'cudaMalloc'"),
            );
            let in_time = rows[0]["probed_ns"]
                .as_i64()
                .is_some_and(|p| p < first_call + 10_000_000);
            assert!(
                rows[0]["outcome"] == "held" || (rows[0]["outcome"] == "late" && in_time),
                "{rows:?}\n{stderr}"
            );
            assert!(gaps <= i64::from(unseen), "{rows:?}");
        } else {
            // Said, never silent: found late (from its open to its first call seen), or never
            // traced when it had ended before this tracer came to it.
            assert!(unseen, "{seen} seen: {rows:?}\n{stderr}");
            assert_eq!(gaps, i64::from(seen > 0), "{rows:?}");
        }
    }
}

#[test]
fn a_short_program_in_a_container_is_traced_from_its_first_call() {
    let Some(fx) = Fixture::new() else {
        return;
    };
    // As in a container: the runtime exists only inside the process's own mount namespace (a
    // tmpfs over an empty host folder); the process is probed through the descriptor it opened.
    let root = fx.sim.parent().unwrap().join("container");
    std::fs::create_dir(&root).unwrap();
    let (r, s) = (root.display(), fx.sim.display());
    let script = format!(
        "mount -t tmpfs none {r} && cp {s}/libcudart.so.12 {s}/libcuda.so.1 {s}/burst {r}/ && \
         exec {r}/burst {r}/libcudart.so.12 300"
    );
    let trace = discovering(&fx.db, &[]);
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .output()
        .unwrap();
    let stopped = trace.stop(SIGINT);
    let rep = report(out);
    let pid = rep["pid"].as_i64().unwrap();
    assert!(
        !root.join("libcudart.so.12").exists(),
        "the host must not see the container's files"
    );
    assert_eq!(calls(&fx.db, pid, "cudaMalloc"), 300, "{}", stopped.stderr);
    assert_eq!(calls(&fx.db, pid, "cudaFree"), 300);
    let rows = discovery(&fx.db, pid);
    assert!(
        rows.iter().any(|r| r["outcome"] == "held"
            && r["library"] == format!("{r}/libcudart.so.12", r = root.display())),
        "{rows:?}"
    );
}
