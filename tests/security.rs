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
