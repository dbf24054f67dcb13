//! Root safety: what tracer does as root on a user's behalf (sudo) never reaches a file that user
//! could not reach themselves.

use std::{
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use crate::common::*;

/// A folder the user (nobody) owns, as their home would be, and a root-owned file elsewhere
/// that they must never get: (folder, target, its content).
struct Scene {
    _dir: tempfile::TempDir,
    user_dir: PathBuf,
    target: PathBuf,
}

const SECRET: &str = "root:secret:19000:0:99999:7:::\n";

impl Scene {
    fn new() -> Scene {
        let dir = dir_with_mode(0o755);
        let user_dir = dir.path().join("home");
        std::fs::create_dir(&user_dir).unwrap();
        nix::unistd::chown(
            &user_dir,
            Some(nix::unistd::Uid::from_raw(NOBODY)),
            Some(nix::unistd::Gid::from_raw(NOBODY)),
        )
        .unwrap();
        let vault = dir.path().join("vault");
        std::fs::create_dir(&vault).unwrap();
        let target = vault.join("shadow");
        std::fs::write(&target, SECRET).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
        Scene {
            _dir: dir,
            user_dir,
            target,
        }
    }

    /// The target is as it was: root's, 0644, its content.
    fn assert_untouched(&self) {
        let meta = std::fs::symlink_metadata(&self.target).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (0, 0, 0o644),
            "the target's owner or mode changed"
        );
        assert_eq!(std::fs::read_to_string(&self.target).unwrap(), SECRET);
    }
}

/// `tracer trace` as `sudo` run by nobody would: SUDO_UID/SUDO_GID set.
fn trace_for_nobody(db: &Path, seconds: &str) -> Output {
    Command::new(TRACER)
        .args(["trace", "--quiet", "--duration", seconds, "--lib"])
        .arg(sim().join("libcudart.so.12"))
        .arg("--db")
        .arg(db)
        .env("SUDO_UID", NOBODY.to_string())
        .env("SUDO_GID", NOBODY.to_string())
        .output()
        .unwrap()
}

#[test]
fn a_database_path_that_is_a_link_is_refused() {
    if !privileged() {
        return;
    }
    let _guard = serial();
    let scene = Scene::new();
    let link = scene.user_dir.join("t.db");
    std::os::unix::fs::symlink(&scene.target, &link).unwrap();
    let out = trace_for_nobody(&link, "1s");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is a symbolic link"), "{stderr}");
    scene.assert_untouched();
}

#[test]
fn links_planted_for_the_wal_and_shm_never_hand_over_their_target() {
    if !privileged() {
        return;
    }
    let _guard = serial();
    let scene = Scene::new();
    let db = scene.user_dir.join("t.db");
    // Planted before the trace starts.
    for suffix in ["-wal", "-shm"] {
        std::os::unix::fs::symlink(&scene.target, format!("{}{suffix}", db.display())).unwrap();
    }
    let out = trace_for_nobody(&db, "1s");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    scene.assert_untouched();
    for suffix in ["-wal", "-shm"] {
        std::fs::remove_file(format!("{}{suffix}", db.display())).unwrap();
    }

    // Planted over and over while traces run and store calls.
    let stop = Arc::new(AtomicBool::new(false));
    let racer = {
        let (stop, db, target) = (stop.clone(), db.clone(), scene.target.clone());
        std::thread::spawn(move || {
            let mut planted = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for suffix in ["-wal", "-shm", ""] {
                    let name = format!("{}{suffix}", db.display());
                    let _ = std::fs::remove_file(&name);
                    if std::os::unix::fs::symlink(&target, &name).is_ok() {
                        planted += 1;
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            planted
        })
    };
    for _ in 0..3 {
        let trace = std::thread::spawn({
            let db = db.clone();
            move || trace_for_nobody(&db, "2s")
        });
        std::thread::sleep(Duration::from_millis(700));
        let _ = driver(sim(), &["--iters", "2000"], &[]).output().unwrap();
        let out = trace.join().unwrap();
        // It may fail (its files keep being replaced), but never through the links.
        assert!(
            out.status.code() != Some(101) && out.status.code().is_some(),
            "{out:?}"
        );
        scene.assert_untouched();
    }
    stop.store(true, Ordering::Relaxed);
    let planted = racer.join().unwrap();
    assert!(planted > 100, "{planted} links planted");
    scene.assert_untouched();
}

#[test]
fn a_database_where_the_user_cannot_write_is_refused_and_nothing_is_created() {
    if !privileged() {
        return;
    }
    let _guard = serial();
    let scene = Scene::new();
    // A root-owned folder the user can read but not write.
    let db = scene.target.parent().unwrap().join("t.db");
    let out = trace_for_nobody(&db, "1s");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(!db.exists(), "{} was created as root", db.display());
    let missing = scene.target.parent().unwrap().join("new").join("t.db");
    let out = trace_for_nobody(&missing, "1s");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("the invoking user can write"), "{stderr}");
    assert!(!missing.parent().unwrap().exists());
    scene.assert_untouched();
}

/// The descriptors tracer holds open on other processes' memory.
fn mem_files_open(tracer_pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{tracer_pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|p| p.display().to_string())
        .filter(|p| p.ends_with("/mem"))
        .collect()
}

#[test]
fn only_traced_processes_have_their_memory_read() {
    if !privileged() {
        return;
    }
    let _guard = serial();
    let dir = tempfile::tempdir().unwrap();
    let lib = sim().join("libcudart.so.12");
    // A Python process that uses no CUDA library, and one that has loaded the runtime.
    let mut bystander = Command::new("python3")
        .args(["-c", "import time; time.sleep(60)"])
        .spawn()
        .unwrap();
    let mut user = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import ctypes, time; ctypes.CDLL({:?}); time.sleep(60)",
            lib.display().to_string()
        ))
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let trace = Trace::start(
        &dir.path().join("t.db"),
        &["--stack", "--lib", lib.to_str().unwrap()],
    );
    // Interpreters are looked for every second.
    std::thread::sleep(Duration::from_millis(2500));
    let open = mem_files_open(trace.child.id());
    let _ = bystander.kill();
    let _ = user.kill();
    let _ = bystander.wait();
    let _ = user.wait();
    trace.stop(SIGINT);
    assert!(
        !open.contains(&format!("/proc/{}/mem", bystander.id())),
        "the bystander's memory was opened: {open:?}"
    );
    assert!(
        open.contains(&format!("/proc/{}/mem", user.id())),
        "the process using the runtime was not registered: {open:?}"
    );
}

/// `tracer report -o` and `tracer export -o` as sudo run by nobody: a link planted at the
/// output path is refused, a folder nobody cannot write is refused, and what is written is
/// nobody's and private.
#[test]
fn report_and_export_outputs_are_written_as_the_user_never_through_a_link() {
    let Some(fx) = Fixture::new() else { return };
    let trace = Trace::start(
        &fx.db,
        &[
            "--lib",
            fx.sim.join("libcudart.so.12").to_str().unwrap(),
            "--quiet",
        ],
    );
    let out = driver(&fx.sim, &["--iters", "100"], &[]).output().unwrap();
    assert!(out.status.success());
    trace.stop(2);
    let scene = Scene::new();
    let as_nobody = |args: &[&str], output: &Path| {
        Command::new(TRACER)
            .args(args)
            .arg("-o")
            .arg(output)
            .arg("--db")
            .arg(&fx.db)
            .env("SUDO_UID", NOBODY.to_string())
            .env("SUDO_GID", NOBODY.to_string())
            .output()
            .unwrap()
    };
    for args in [&["report"][..], &["export", "--format", "perfetto"][..]] {
        let link = scene.user_dir.join("out");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&scene.target, &link).unwrap();
        let out = as_nobody(args, &link);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("symbolic link"), "{stderr}");
        scene.assert_untouched();
        // A folder only root can write.
        let vault = scene.target.with_file_name("out");
        let out = as_nobody(args, &vault);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        assert!(!vault.exists());
        // Where nobody can write: theirs, and private.
        let fine = scene.user_dir.join("fine");
        let out = as_nobody(args, &fine);
        assert!(out.status.success(), "{args:?}: {out:?}");
        let meta = std::fs::metadata(&fine).unwrap();
        assert_eq!(
            (meta.uid(), meta.mode() & 0o777),
            (NOBODY, 0o600),
            "{args:?}"
        );
        assert!(meta.len() > 0);
        std::fs::remove_file(&fine).unwrap();
    }
}

#[test]
fn a_snapshot_is_read_as_the_user_who_asked() {
    if !privileged() {
        return;
    }
    let scene = Scene::new();
    // A snapshot only root may read, beside the target.
    let snapshot = scene.target.with_file_name("snapshot.pickle");
    std::fs::copy(
        workspace().join("tracer-cli/testdata/tiny_snapshot.pickle"),
        &snapshot,
    )
    .unwrap();
    std::fs::set_permissions(&snapshot, std::fs::Permissions::from_mode(0o600)).unwrap();
    let db = scene.user_dir.join("t.db");
    let import = |sudo: bool| {
        let mut cmd = Command::new(TRACER);
        cmd.args(["import", "--snapshot"])
            .arg(&snapshot)
            .arg("--db")
            .arg(&db);
        if sudo {
            cmd.env("SUDO_UID", NOBODY.to_string())
                .env("SUDO_GID", NOBODY.to_string());
        }
        cmd.output().unwrap()
    };
    let out = import(true);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("Permission denied"), "{stderr}");
    assert!(!db.exists(), "nothing stored");
    // Root on its own behalf may read it.
    let out = import(false);
    assert!(out.status.success(), "{out:?}");
    scene.assert_untouched();
}

/// `--dump-on-oom DIR`: a job of nobody's runs out of memory; within seconds its evidence is in
/// DIR/65534/<job>/<time>-rank3-pid<P>/, every folder nobody's and 0700, the job's name made
/// safe from its own hostile run id, the snapshot read by PyTorch's own `_memory_viz.py` and
/// equal to `tracer export`'s at the OOM, the layout and explain there; `--dump-max` holds;
/// a DIR reached through a link, or one others may write without the sticky bit, is refused
/// before anything is traced.
#[test]
fn an_oom_leaves_its_evidence_in_its_users_own_folder() {
    use serde_json::Value;
    use std::os::unix::process::CommandExt as _;
    let Some(fx) = Fixture::new() else { return };
    let top = tempfile::tempdir().unwrap();
    let dumps = top.path().join("dumps");
    std::fs::create_dir(&dumps).unwrap();
    std::fs::set_permissions(&dumps, std::fs::Permissions::from_mode(0o1777)).unwrap();
    // nobody reaches the simulated runtime.
    for d in [fx.sim.parent().unwrap(), fx.sim.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let said = top.path().join("said");
    std::fs::create_dir(&said).unwrap();
    std::fs::set_permissions(&said, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let libs = ["libcudart.so.12", "libcuda.so.1", "libsimtorch.so"];
    let dir_arg = dumps.to_str().unwrap();
    let on_oom = format!(
        "echo \"$TRACER_DUMP_DIR $TRACER_RANK $TRACER_JOB $(id -u)\" >> {}/runs",
        said.display()
    );
    let trace = fx.trace(
        &libs,
        &[
            "--dump-on-oom",
            dir_arg,
            "--dump-max",
            "2",
            "--on-oom",
            &on_oom,
            "--on-oom-user",
            "nobody",
        ],
    );
    let run_id = "../../etc/\x1b[31mjob";
    let rank = |scenario: &str, rank: &str| {
        let mut cmd = Command::new("/usr/bin/python3");
        cmd.arg(workspace().join("demos/workloads/train.py"))
            .args([scenario, "--speed", "5", "--duration", "20", "--cudart"])
            .arg(fx.sim.join("libcudart.so.12"))
            .env_clear()
            .env("SIMCUDA_MEM", "1GiB")
            .env("RANK", rank)
            .env("TORCHELASTIC_RUN_ID", run_id)
            .uid(65534)
            .gid(65534)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        cmd
    };
    // Rank 2 of the same job runs beside: its snapshot at each OOM is the baseline.
    let mut peer = rank("leak", "2").spawn().unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let job = || rank("oom", "3").output().unwrap();
    let out = job();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ran_out = std::time::Instant::now();
    // The run id's slashes, escape and bracket made plain: one folder, inside the user's.
    let job_dir = dumps.join("65534").join("run-_._.._etc___31mjob");
    let found = loop {
        let done = std::fs::read_dir(&job_dir).ok().and_then(|mut d| {
            d.find_map(|e| {
                let p = e.ok()?.path();
                p.join("explain.json").exists().then_some(p)
            })
        });
        if let Some(p) = done {
            break p;
        }
        assert!(
            ran_out.elapsed() < Duration::from_secs(5),
            "no dump within 5 s under {}",
            dumps.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let name = found.file_name().unwrap().to_str().unwrap().to_owned();
    assert!(name.contains("-rank3-pid"), "{name}");
    for d in [dumps.join("65534"), job_dir.clone(), found.clone()] {
        let meta = std::fs::symlink_metadata(&d).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (65534, 65534, 0o700),
            "{}",
            d.display()
        );
    }
    // A second OOM of the same user: --dump-max 1 keeps the newest only.
    let out = job();
    assert_eq!(out.status.code(), Some(1));
    std::thread::sleep(Duration::from_secs(4));
    let stopped = trace.stop(SIGINT);
    let _ = peer.kill();
    let _ = peer.wait();
    // Each OOM: its folder and its peer's (rank 2); --dump-max 2 kept the second pair.
    let summary = &stopped.summary["dumps"];
    let written: Vec<PathBuf> = summary["written"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| PathBuf::from(p.as_str().unwrap()))
        .collect();
    assert_eq!(written.len(), 4, "{summary}");
    assert_eq!(summary["removed"], 2, "{summary}");
    assert_eq!(summary["failed"], serde_json::json!([]), "{summary}");
    let mut kept: Vec<PathBuf> = std::fs::read_dir(&job_dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    kept.sort();
    let mut newest_pair = written[2..].to_vec();
    newest_pair.sort();
    assert_eq!(kept, newest_pair);
    let about = |p: &Path| -> Value {
        serde_json::from_slice(&std::fs::read(p.join("dump.json")).unwrap()).unwrap()
    };
    let newest = written
        .iter()
        .rev()
        .find(|p| about(p)["role"] == "oom")
        .unwrap()
        .clone();
    let peer_dir = written
        .iter()
        .rev()
        .find(|p| about(p)["role"] == "peer")
        .unwrap();
    let peer_about = about(peer_dir);
    assert_eq!(
        (
            &peer_about["rank"],
            &peer_about["pid"],
            &peer_about["oom_ts_ns"]
        ),
        (&"2".into(), &peer.id().into(), &about(&newest)["oom_ts_ns"]),
        "{peer_about:#}"
    );
    assert!(
        !memory_viz("2.11.0", "stats", &peer_dir.join("snapshot.pickle")).is_empty(),
        "the peer's snapshot"
    );
    // --on-oom ran as nobody once per OOM, with the OOM's folder (not its peer's).
    let runs = std::fs::read_to_string(said.join("runs")).unwrap();
    let lines: Vec<&str> = runs.lines().collect();
    assert_eq!(lines.len(), 2, "{runs}");
    assert_eq!(
        lines[1],
        format!("{} 3 run-_._.._etc___31mjob 65534", newest.display()),
        "{runs}"
    );
    let pid: u32 = newest
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .rsplit("pid")
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // The snapshot: PyTorch's tool reads it, and it is tracer's export at the OOM.
    let snapshot = newest.join("snapshot.pickle");
    for version in ["2.11.0", "2.15.0"] {
        for action in ["stats", "trace"] {
            assert!(
                !memory_viz(version, action, &snapshot).is_empty(),
                "{version} {action}"
            );
        }
    }
    let exported = top.path().join("exported.pickle");
    export_snapshot(
        &fx.db,
        &exported,
        &["--pid", &pid.to_string(), "--at", "oom"],
    );
    let (ours, theirs) = (snapshot_figures(&snapshot), snapshot_figures(&exported));
    for key in ["allocated", "reserved", "free_blocks", "largest_free"] {
        assert_eq!(ours[key], theirs[key], "{key}: {ours:#} {theirs:#}");
    }
    let layout: Value =
        serde_json::from_slice(&std::fs::read(newest.join("layout.json")).unwrap()).unwrap();
    assert_eq!(layout[0]["pid"], pid, "{layout:#}");
    // Imported back, the snapshot is the layout the folder holds.
    let back = top.path().join("back.db");
    let imported = Command::new(TRACER)
        .args(["import", "--snapshot"])
        .arg(&snapshot)
        .arg("--db")
        .arg(&back)
        .output()
        .unwrap();
    assert!(
        imported.status.success(),
        "{}",
        String::from_utf8_lossy(&imported.stderr)
    );
    let relaid = tracer_json(&back, &["layout", "--json"]);
    for key in ["allocated", "reserved", "free_blocks", "largest_free"] {
        assert_eq!(
            relaid[0]["devices"][0]["total"][key], layout[0]["devices"][0]["total"][key],
            "{key}"
        );
    }
    let explained: Value =
        serde_json::from_slice(&std::fs::read(newest.join("explain.json")).unwrap()).unwrap();
    assert!(
        explained["chains"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["rule"] == "oom"),
        "{explained:#}"
    );

    // Refused before anything is traced: a link, and a folder anyone may swap things in.
    let link = top.path().join("link");
    std::os::unix::fs::symlink(&dumps, &link).unwrap();
    let open = top.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    // A link above DIR redirects it as well as one at it.
    let above = top.path().join("above");
    std::os::unix::fs::symlink(top.path(), &above).unwrap();
    let through = above.join("dumps");
    for bad in [&link, &open, &through] {
        let out = Command::new(TRACER)
            .args(["trace", "--duration", "1s", "--db"])
            .arg(top.path().join("refused.db"))
            .arg("--dump-on-oom")
            .arg(bad)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("--dump-on-oom"), "{stderr}");
    }
    // --on-oom never runs as root: with no user to run as, refused before anything begins.
    let out = Command::new(TRACER)
        .args(["trace", "--duration", "1s", "--db"])
        .arg(top.path().join("refused.db"))
        .arg("--dump-on-oom")
        .arg(&dumps)
        .args(["--on-oom", "true"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--on-oom never runs its command as root"),
        "{stderr}"
    );
}
