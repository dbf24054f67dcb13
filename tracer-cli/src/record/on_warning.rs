//! `tracer trace --on-warning CMD`: when a traced process's allocator reaches the state in which
//! its next request of the sizes it makes fails (the early warning), CMD runs so the job can
//! checkpoint before it dies. CMD runs through /bin/sh as the invoking user, never as root, with
//! a clean environment carrying the figures; at most once per process per interval, one at a
//! time, killed at its timeout; each run's outcome goes into the session's notes.

use std::{
    collections::HashMap,
    os::unix::process::CommandExt as _,
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _, Result};
use serde::Serialize;

use crate::{model::pressure::Alarm, units::format_bytes};

/// What --on-warning asked for.
#[derive(Clone, Debug)]
pub struct OnWarning {
    pub command: String,
    /// The identity the command runs as: (uid, gid, home); never uid 0.
    pub user: (u32, u32, String),
    /// At most one run per process in this long.
    pub interval: Duration,
    /// A run still going after this long is killed.
    pub timeout: Duration,
}

impl OnWarning {
    /// The user the command runs as: `name` (a user name or uid), else the one who ran sudo,
    /// else the current one; root is refused.
    pub fn resolve_user(
        name: Option<&str>,
        invoker: Option<(u32, u32)>,
    ) -> Result<(u32, u32, String)> {
        use nix::unistd::{Uid, User};
        let user = match name {
            Some(n) => match n.parse::<u32>() {
                Ok(uid) => User::from_uid(Uid::from_raw(uid)),
                Err(_) => User::from_name(n),
            }
            .with_context(|| format!("look up the --on-warning-user {n:?}"))?
            .ok_or_else(|| anyhow!("--on-warning-user {n:?}: no such user"))?,
            None => {
                let uid = invoker.map_or_else(|| Uid::effective().as_raw(), |(uid, _)| uid);
                User::from_uid(Uid::from_raw(uid))
                    .context("look up the invoking user for --on-warning")?
                    .ok_or_else(|| anyhow!("the invoking user (uid {uid}) has no passwd entry"))?
            }
        };
        if user.uid.is_root() {
            return Err(anyhow!(
                "--on-warning never runs its command as root: run tracer with sudo from your own account, or name the user with --on-warning-user"
            ));
        }
        Ok((
            user.uid.as_raw(),
            user.gid.as_raw(),
            user.dir.display().to_string(),
        ))
    }
}

/// One run of the command.
#[derive(Clone, Debug, Serialize)]
pub struct HookRun {
    pub pid: u32,
    pub device: i32,
    /// Wall-clock time the warning fired (ns since the epoch).
    pub ts_ns: i64,
    /// The exit status, or none when it was killed (by its timeout or a signal).
    pub exit_code: Option<i32>,
    pub timed_out: bool,
    pub seconds: f64,
    /// Why it could not run, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl HookRun {
    pub fn note(&self, command: &str) -> String {
        let outcome = match (&self.error, self.exit_code, self.timed_out) {
            (Some(e), _, _) => format!("could not run: {e}"),
            (None, _, true) => format!("killed after its {:.0}s timeout", self.seconds),
            (None, Some(code), false) => format!("exited {code} after {:.1}s", self.seconds),
            (None, None, false) => format!("ended by a signal after {:.1}s", self.seconds),
        };
        format!(
            "on-warning: `{command}` for pid {} (device {}) {outcome}",
            self.pid, self.device
        )
    }
}

/// The runs of the command, as the recording reports them when it ends.
pub struct HookOutcome {
    pub command: String,
    timeout: Duration,
    running: Arc<AtomicBool>,
    runs: Arc<Mutex<Vec<HookRun>>>,
}

impl HookOutcome {
    /// The runs, once the one still going (if any) has ended or been killed.
    pub fn wait(&self) -> Vec<HookRun> {
        let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
        while self.running.load(Ordering::SeqCst) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.runs.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

/// Fires the command on warnings, within its limits.
pub struct WarningHook {
    cfg: OnWarning,
    session: i64,
    last: HashMap<u32, Instant>,
    running: Arc<AtomicBool>,
    runs: Arc<Mutex<Vec<HookRun>>>,
    /// Warnings that found a run still going, or the process's interval not yet over.
    pub skipped: u64,
}

impl WarningHook {
    pub fn new(cfg: OnWarning, session: i64) -> WarningHook {
        WarningHook {
            cfg,
            session,
            last: HashMap::new(),
            running: Arc::new(AtomicBool::new(false)),
            runs: Arc::new(Mutex::new(Vec::new())),
            skipped: 0,
        }
    }

    /// The runs so far (shared with the threads that wait for them).
    pub fn runs(&self) -> Arc<Mutex<Vec<HookRun>>> {
        self.runs.clone()
    }

    /// What the recording keeps to report the runs when it ends.
    pub fn outcome(&self) -> HookOutcome {
        HookOutcome {
            command: self.cfg.command.clone(),
            timeout: self.cfg.timeout,
            running: self.running.clone(),
            runs: self.runs.clone(),
        }
    }

    /// A warning for `pid`: runs the command unless one is running or the process's interval
    /// has not passed.
    pub fn fire(&mut self, pid: u32, rank: Option<&str>, alarm: &Alarm, wall_ns: i64) {
        let now = Instant::now();
        let recent = self
            .last
            .get(&pid)
            .is_some_and(|t| now.duration_since(*t) < self.cfg.interval);
        if recent || self.running.swap(true, Ordering::SeqCst) {
            self.skipped += 1;
            return;
        }
        self.last.insert(pid, now);
        eprintln!(
            "tracer: early warning for pid {pid}: the next {} request on device {} will fail (largest free block {}, device free {}); running `{}`",
            format_bytes(alarm.request),
            alarm.device,
            format_bytes(alarm.stats.largest_free),
            format_bytes(alarm.device_free),
            self.cfg.command
        );
        let command = self.command_for(pid, rank, alarm);
        let (running, runs, timeout) = (self.running.clone(), self.runs.clone(), self.cfg.timeout);
        let (device, ts_ns) = (alarm.device, wall_ns);
        let spawned = std::thread::Builder::new()
            .name("tracer-on-warning".into())
            .spawn(move || {
                let run = run_bounded(command, timeout, pid, device, ts_ns);
                if let Ok(mut runs) = runs.lock() {
                    runs.push(run);
                }
                running.store(false, Ordering::SeqCst);
            });
        if spawned.is_err() {
            self.running.store(false, Ordering::SeqCst);
            self.skipped += 1;
        }
    }

    /// /bin/sh -c CMD as the user, in their home, with only the figures and a plain PATH.
    fn command_for(&self, pid: u32, rank: Option<&str>, a: &Alarm) -> Command {
        let (uid, gid, home) = &self.cfg.user;
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(&self.cfg.command)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", home)
            .env("TRACER_SESSION", self.session.to_string())
            .env("TRACER_PID", pid.to_string())
            .env("TRACER_DEVICE", a.device.to_string())
            .env("TRACER_POOL", format!("{:?}", a.pool).to_lowercase())
            .env("TRACER_REQUEST_BYTES", a.request.to_string())
            .env(
                "TRACER_LARGEST_FREE_BYTES",
                a.stats.largest_free.to_string(),
            )
            .env("TRACER_CACHED_BYTES", a.stats.cached().to_string())
            .env("TRACER_ALLOCATED_BYTES", a.stats.allocated.to_string())
            .env("TRACER_RESERVED_BYTES", a.stats.reserved.to_string())
            .env("TRACER_DEVICE_FREE_BYTES", a.device_free.to_string())
            .env("TRACER_SEGMENT_BYTES", a.segment.to_string())
            .current_dir(if std::path::Path::new(home).is_dir() {
                home.as_str()
            } else {
                "/"
            })
            .stdin(Stdio::null())
            // Its output goes to tracer's stderr: stdout is tracer's data (--json).
            .stdout(stderr_handle())
            .stderr(Stdio::inherit())
            .process_group(0)
            .uid(*uid)
            .gid(*gid);
        if let Some(rank) = rank {
            cmd.env("TRACER_RANK", rank);
        }
        cmd
    }
}

pub(super) fn stderr_handle() -> Stdio {
    use std::os::fd::AsFd as _;
    std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .map_or_else(|_| Stdio::null(), Stdio::from)
}

/// Runs `cmd`, killing its process group at `timeout`.
pub(super) fn run_bounded(
    mut cmd: Command,
    timeout: Duration,
    pid: u32,
    device: i32,
    ts_ns: i64,
) -> HookRun {
    let started = Instant::now();
    let mut run = HookRun {
        pid,
        device,
        ts_ns,
        exit_code: None,
        timed_out: false,
        seconds: 0.0,
        error: None,
    };
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            run.error = Some(format!("start /bin/sh: {e}"));
            return run;
        }
    };
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                run.exit_code = status.code();
                break;
            }
            Ok(None) if started.elapsed() >= timeout => {
                // The command's whole process group: a shell's children go with it.
                let group = nix::unistd::Pid::from_raw(-(child.id() as i32));
                let _ = nix::sys::signal::kill(group, nix::sys::signal::Signal::SIGKILL);
                let _ = child.wait();
                run.timed_out = true;
                break;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                run.error = Some(format!("wait for it: {e}"));
                break;
            }
        }
    }
    run.seconds = started.elapsed().as_secs_f64();
    run
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layout::{Pool, PoolStats};

    fn alarm() -> Alarm {
        Alarm {
            ts_ns: 0,
            device: 1,
            pool: Pool::Large,
            request: 46 << 20,
            stats: PoolStats {
                allocated: 100 << 20,
                reserved: 400 << 20,
                free_blocks: 37,
                largest_free: 12 << 20,
            },
            device_free: 40 << 20,
            segment: 46 << 20,
        }
    }

    #[test]
    fn root_is_refused() {
        let e = OnWarning::resolve_user(Some("root"), None).unwrap_err();
        assert!(
            format!("{e}").contains("never runs its command as root"),
            "{e}"
        );
        assert!(OnWarning::resolve_user(Some("no-such-user-here"), None).is_err());
    }

    #[test]
    fn runs_once_per_interval_with_the_figures_and_times_out() {
        let dir = std::env::temp_dir().join(format!("tracer-on-warning-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("env.txt");
        // Whoever runs the tests: as root, a user that is not (nobody) runs it.
        let user = OnWarning::resolve_user(
            nix::unistd::Uid::effective().is_root().then_some("nobody"),
            None,
        )
        .unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        let mut hook = WarningHook::new(
            OnWarning {
                command: format!(
                    "id -u > {0}/uid; env | sort > {0}/env.txt; exit 3",
                    dir.display()
                ),
                user: user.clone(),
                interval: Duration::from_secs(60),
                timeout: Duration::from_secs(10),
            },
            9,
        );
        hook.fire(4242, Some("rank 2/4"), &alarm(), 1);
        hook.fire(4242, Some("rank 2/4"), &alarm(), 2);
        let runs = hook.runs();
        let deadline = Instant::now() + Duration::from_secs(10);
        while runs.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let run = runs.lock().unwrap()[0].clone();
        assert_eq!(run.exit_code, Some(3), "{run:?}");
        assert_eq!(hook.skipped, 1);
        let env = std::fs::read_to_string(&out).unwrap();
        assert!(env.contains("TRACER_PID=4242"), "{env}");
        assert!(env.contains("TRACER_RANK=rank 2/4"), "{env}");
        assert!(
            env.contains(&format!("TRACER_REQUEST_BYTES={}", 46u64 << 20)),
            "{env}"
        );
        assert!(
            env.contains(&format!("TRACER_LARGEST_FREE_BYTES={}", 12u64 << 20)),
            "{env}"
        );
        assert!(!env.contains("SUDO_"), "the environment is clean: {env}");
        let uid = std::fs::read_to_string(dir.join("uid")).unwrap();
        assert_eq!(uid.trim(), user.0.to_string());
        assert!(run.note("x").contains("exited 3"), "{}", run.note("x"));

        let mut slow = WarningHook::new(
            OnWarning {
                command: "sleep 30".into(),
                user,
                interval: Duration::from_secs(60),
                timeout: Duration::from_millis(300),
            },
            9,
        );
        slow.fire(1, None, &alarm(), 1);
        let runs = slow.runs();
        let deadline = Instant::now() + Duration::from_secs(10);
        while runs.lock().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let run = runs.lock().unwrap()[0].clone();
        assert!(run.timed_out && run.seconds < 5.0, "{run:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
