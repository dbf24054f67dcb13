//! `tracer trace --dump-on-oom DIR`: at each out-of-memory PyTorch raises in a traced process,
//! one folder of evidence, written on its own thread once the writer has stored the message
//! (so the recording never waits for it): `DIR/<uid>/<job>/<time>-rank<R>-pid<P>/` holding
//! PyTorch's memory snapshot at the OOM (`snapshot.pickle`, the process's recorded window, the
//! format PyTorch's `_memory_viz.py` reads), the layout then (`layout.json`) and, written last so
//! that a slow explain never delays the rest, explain's answer for the process
//! (`explain.json`).
//!
//! As root in folders users can reach: every folder below DIR is made with the traced process's
//! own file-system ids (never root's, never chowned later), each component opened through the
//! one above it without following a link and the dump's own folder created exclusively, mode
//! 0700; names made from the process's strings keep letters, digits, '.', '-' and '_' only,
//! bounded. DIR itself is refused when a link, or a folder another user could swap (writable
//! by others without the sticky bit, or owned by someone other than root or the invoker).
//! `--dump-max` keeps the newest folders of each user, removing the oldest first (said).

use std::{
    os::fd::{AsFd, OwnedFd},
    path::{Path, PathBuf},
    sync::mpsc::Receiver,
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context as _, Result};
use nix::{
    fcntl::OFlag,
    sys::stat::{fstat, Mode},
};
use serde::Serialize;

mod files;
mod names;
mod watch;

use files::{subdir, write_new};
use names::redact_others;
pub use watch::OomWatch;

use crate::{
    model::{env_map, job::clean, Rank},
    paths::act_as,
    query::{
        explain::{explain, ExplainQuery},
        layout::{layout, At, LayoutQuery},
        pytorch_snapshot::{self, SnapshotQuery, DEFAULT_MAX_ENTRIES},
    },
};

/// What `--dump-on-oom` asked for.
#[derive(Clone, Debug)]
pub struct DumpOnOom {
    pub dir: PathBuf,
    /// The most dump folders kept per user.
    pub max: usize,
    /// Writes PyTorch's snapshot pickle (the presentation room's, handed down by the command).
    pub render: RenderSnapshot,
    /// `--on-oom CMD`: run once each folder is complete, as `--on-warning`'s command runs (the
    /// user who ran sudo or the one named, never root), with the folder in TRACER_DUMP_DIR.
    pub on_oom: Option<OnOom>,
    /// Where each explained OOM is told beside (the fleet's log records), if anywhere.
    pub sink: Option<OomSink>,
    /// A Kubernetes pod's owner by the pod's uid, where the API was asked (the job of ranks
    /// nothing in their environment names).
    pub pod_job: Option<PodJob>,
}

/// A pod's owner (`model::job::pod_owner`'s name) by its uid, if known yet.
#[derive(Clone)]
pub struct PodJob(pub std::sync::Arc<PodOwnerOf>);

/// A pod's uid to its owner's name.
pub type PodOwnerOf = dyn Fn(&str) -> Option<String> + Send + Sync;

impl std::fmt::Debug for PodJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PodJob")
    }
}

/// How tracer knew the process ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Seen {
    /// PyTorch's out-of-memory message.
    Message,
    /// A failed device allocation nothing followed (no message was seen).
    FailedAttempt,
}

/// One OOM as the fleet hears of it: who, where, the verdict and its figures, the folder.
#[derive(Clone, Debug, Serialize)]
pub struct OomReport {
    pub pid: u32,
    pub ts_ns: i64,
    pub job: String,
    pub rank: Option<String>,
    pub node: Option<String>,
    /// The process's Kubernetes pod (its uid, from its cgroup), where it runs in one.
    pub pod_uid: Option<String>,
    pub device: Option<i32>,
    pub verdict: Option<String>,
    pub asked: Option<u64>,
    pub shortfall: Option<u64>,
    pub dump: PathBuf,
}

/// Hands each explained OOM on (the command wires it to the OTLP log exporter).
#[derive(Clone)]
pub struct OomSink(pub std::sync::Arc<dyn Fn(&OomReport) + Send + Sync>);

impl std::fmt::Debug for OomSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OomSink")
    }
}

/// `--on-oom`'s command and whom it runs as.
#[derive(Clone, Debug)]
pub struct OnOom {
    pub command: String,
    /// (uid, gid, home); never uid 0.
    pub user: (u32, u32, String),
    pub timeout: Duration,
}

/// Writes an export as PyTorch's memory snapshot pickle.
pub type RenderSnapshot = fn(&mut Vec<u8>, &pytorch_snapshot::Export) -> std::io::Result<()>;

/// An out-of-memory the writer has stored: the process, its message's time, whose it is.
#[derive(Clone, Debug)]
pub struct OomStored {
    pub pid: u32,
    pub ts_ns: i64,
    pub seen: Seen,
    pub owner: Option<(u32, u32)>,
    /// The process's kept environment (JSON): its job and rank.
    pub env: Option<String>,
    /// Its job's name (model/job.rs), its environment's or its pod owner's.
    pub job: String,
    /// When it started (wall ns): ranks of one run of a job start together.
    pub started_ns: Option<i64>,
    /// The other processes of its job (same job name, not "no-job") tracer saw on this node:
    /// their snapshots at the same instant are the baseline (and they are about to die).
    pub peers: Vec<Peer>,
    /// The processes tracer saw of the same user: the only ones a dump may name.
    pub same_user: Vec<u32>,
    /// Its Kubernetes pod's uid, from its cgroup.
    pub pod_uid: Option<String>,
}

/// What the dumps came to, for the session's summary.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DumpSummary {
    pub written: Vec<PathBuf>,
    pub failed: Vec<String>,
    /// Older folders removed to keep `--dump-max`.
    pub removed: u64,
    /// OOMs that found the queue full (the recording never waits for a dump).
    pub skipped: u64,
    /// `--on-oom`'s runs.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub on_oom: Vec<super::on_warning::HookRun>,
}

/// Bounded: OOMs come seldom; a burst beyond this is counted, not waited for.
const QUEUE: usize = 64;
/// How long a dump waits for the process's calls to be stored up to its OOM.
const STORED_WITHIN: Duration = Duration::from_secs(5);

/// The dump folder's root, checked and opened at the start (as root, before any traced process
/// could have a say).
pub struct DumpRoot {
    dir: OwnedFd,
    path: PathBuf,
    max: usize,
    render: RenderSnapshot,
    on_oom: Option<OnOom>,
    sink: Option<OomSink>,
    pod_job: Option<PodJob>,
}

impl DumpRoot {
    pub fn open(cfg: &DumpOnOom, invoker: Option<(u32, u32)>) -> Result<DumpRoot> {
        let refuse = |why: String| {
            crate::exit::user_error(format!(
                "--dump-on-oom {}: {why}: give a folder reached through no link, it and every folder above it owned by root or you and not writable by others unless sticky (as /tmp is)",
                cfg.dir.display()
            ))
        };
        let absolute = std::path::absolute(&cfg.dir)
            .map_err(|e| refuse(format!("cannot make it absolute ({e})")))?;
        // Every component from / opened through the one above without following a link, and
        // each one such that no other user could have swapped what lies below it.
        let mut dir = nix::fcntl::open(
            "/",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| refuse(format!("cannot open / ({e})")))?;
        for part in absolute.components().skip(1) {
            let std::path::Component::Normal(name) = part else {
                return Err(refuse(format!("{part:?} in it (give it without . or ..)")));
            };
            dir = nix::fcntl::openat(
                &dir,
                name,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| {
                refuse(format!(
                    "cannot open {} in it without following a link ({e})",
                    name.to_string_lossy()
                ))
            })?;
            let st = fstat(&dir).map_err(|e| refuse(format!("cannot read it ({e})")))?;
            let owner_ok = st.st_uid == 0 || invoker.is_some_and(|(uid, _)| uid == st.st_uid);
            if !owner_ok {
                return Err(refuse(format!(
                    "{} belongs to uid {}",
                    name.to_string_lossy(),
                    st.st_uid
                )));
            }
            let others_write = st.st_mode & 0o022 != 0;
            let sticky = st.st_mode & 0o1000 != 0;
            if others_write && !sticky {
                return Err(refuse(format!(
                    "others may write in {} and it is not sticky",
                    name.to_string_lossy()
                )));
            }
        }
        Ok(DumpRoot {
            dir,
            path: cfg.dir.clone(),
            max: cfg.max.max(1),
            render: cfg.render,
            on_oom: cfg.on_oom.clone(),
            sink: cfg.sink.clone(),
            pod_job: cfg.pod_job.clone(),
        })
    }

    /// Starts the dump thread: it reads the database at `db` (session `session`) for each OOM
    /// sent to it.
    pub fn spawn(
        self,
        db: PathBuf,
        session: i64,
        shared: std::sync::Arc<super::shared::Shared>,
    ) -> Result<(OomWatch, JoinHandle<DumpSummary>)> {
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let watch = OomWatch::new(tx, self.pod_job.clone());
        let handle = std::thread::Builder::new()
            .name("tracer-dump".into())
            .spawn(move || self.run(rx, &db, session, &shared))
            .context("start the --dump-on-oom thread")?;
        Ok((watch, handle))
    }

    fn run(
        self,
        rx: Receiver<OomStored>,
        db: &Path,
        session: i64,
        shared: &super::shared::Shared,
    ) -> DumpSummary {
        let mut summary = DumpSummary::default();
        for oom in rx {
            match self.dump(&oom, db, session, &mut summary, shared) {
                Ok(path) => {
                    if let Some(on) = &self.on_oom {
                        summary.on_oom.push(run_on_oom(on, &path, &oom, session));
                    }
                    summary.written.push(path);
                }
                Err(e) => summary.failed.push(format!("pid {}: {e:#}", oom.pid)),
            }
        }
        summary
    }

    fn dump(
        &self,
        oom: &OomStored,
        db: &Path,
        session: i64,
        summary: &mut DumpSummary,
        shared: &super::shared::Shared,
    ) -> Result<PathBuf> {
        // Read at its first call; else now, while PyTorch's exception unwinds.
        let (uid, gid) = oom
            .owner
            .or_else(|| crate::traced::procinfo::owner_of(oom.pid))
            .ok_or_else(|| anyhow!("its user is not known (it ended before tracer read it)"))?;
        wait_stored(db, session, oom)?;
        let (dump_dir, path) = self.folder(db, session, oom.pid, (uid, gid), oom, None)?;
        let (explained, verdict) = explain_json(db, session, oom, uid)?;
        if let (Some(v), Ok(mut figures)) = (&verdict, shared.lock_figures()) {
            figures.oom_verdict(oom.pid, v.device, &v.verdict);
        }
        {
            let _as_user = act_as(Some((uid, gid)));
            write_new(dump_dir.as_fd(), "explain.json", &explained)?;
        }
        if let Some(sink) = &self.sink {
            (sink.0)(&report_of(oom, verdict, &path));
        }
        // The other ranks of its job on this node, at the same instant.
        for Peer {
            pid: peer,
            whose: (owner, env),
            started_ns,
        } in &oom.peers
        {
            let Some(owner) = owner.or_else(|| crate::traced::procinfo::owner_of(*peer)) else {
                continue;
            };
            let of_peer = OomStored {
                pid: *peer,
                env: env.clone(),
                started_ns: *started_ns,
                // Another user's rank (a shared account aside) is told nothing of this one's.
                same_user: if owner.0 == uid {
                    oom.same_user.clone()
                } else {
                    Vec::new()
                },
                ..oom.clone()
            };
            match self.folder(db, session, *peer, owner, &of_peer, Some(oom)) {
                Ok((_, p)) => summary.written.push(p),
                Err(e) => summary
                    .failed
                    .push(format!("pid {peer} (a peer of pid {}): {e:#}", oom.pid)),
            }
            summary.removed += self.keep_newest(owner.0);
        }
        summary.removed += self.keep_newest(uid);
        Ok(path)
    }

    /// The folder of process `pid` at the OOM (`peer_of`: the OOM of another rank of its job):
    /// its snapshot, layout and what it is, written as `owner`.
    fn folder(
        &self,
        db: &Path,
        session: i64,
        pid: u32,
        (uid, gid): (u32, u32),
        at: &OomStored,
        peer_of: Option<&OomStored>,
    ) -> Result<(OwnedFd, PathBuf)> {
        let snapshot = snapshot_bytes(db, session, at, self.render)?;
        let layout = layout_json(db, session, at, uid)?;
        let env = env_map(at.env.as_deref());
        let job = at.job.clone();
        let rank = env.get("RANK").map(|r| clean(r, 8));
        let world_size =
            Rank::from_env(|k| env.get(k).map(String::as_str)).and_then(|r| r.world_size);
        let name = clean(
            &format!(
                "{}-rank{}-pid{pid}",
                crate::units::format_utc(at.ts_ns)
                    .replace([' ', ':'], "-")
                    .replace("-UTC", "Z"),
                rank.as_deref().unwrap_or("-"),
            ),
            96,
        );
        let about = serde_json::to_vec_pretty(&serde_json::json!({
            "pid": pid,
            "rank": rank,
            "job": job,
            "node": nix::unistd::gethostname().ok().map(|h| h.to_string_lossy().into_owned()),
            "session": session,
            "oom_ts_ns": at.ts_ns,
            "role": if peer_of.is_some() { "peer" } else { "oom" },
            "oom_pid": peer_of.map_or(pid, |o| o.pid),
            "seen": peer_of.unwrap_or(at).seen,
            "world_size": world_size,
            "started_ns": at.started_ns,
        }))?;
        let gpu = gpu_json(db, session, at, uid)?;
        // Everything below DIR as the process's user (the database is read as tracer's own).
        let _as_user = act_as(Some((uid, gid)));
        let user_dir = subdir(self.dir.as_fd(), &uid.to_string(), uid, false)?;
        let job_dir = subdir(user_dir.as_fd(), &job, uid, false)?;
        let dump_dir = subdir(job_dir.as_fd(), &name, uid, true)?;
        write_new(dump_dir.as_fd(), "dump.json", &about)?;
        write_new(dump_dir.as_fd(), "snapshot.pickle", &snapshot)?;
        write_new(dump_dir.as_fd(), "layout.json", &layout)?;
        write_new(dump_dir.as_fd(), "gpu.json", &gpu)?;
        let path = self.path.join(uid.to_string()).join(&job).join(&name);
        Ok((dump_dir, path))
    }

    /// Removes the user's oldest dump folders beyond `--dump-max` (as that user).
    fn keep_newest(&self, uid: u32) -> u64 {
        let root = self.path.join(uid.to_string());
        let mut dumps: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&root)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|j| j.file_type().is_ok_and(|t| t.is_dir()))
            .flat_map(|j| std::fs::read_dir(j.path()).into_iter().flatten().flatten())
            .filter(|d| d.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|d| Some((d.metadata().ok()?.modified().ok()?, d.path())))
            .collect();
        if dumps.len() <= self.max {
            return 0;
        }
        dumps.sort();
        let excess = dumps.len() - self.max;
        dumps
            .iter()
            .take(excess)
            .filter(|(_, p)| std::fs::remove_dir_all(p).is_ok())
            .count() as u64
    }
}

/// A process's user and group, and its kept environment (JSON).
type Whose = (Option<(u32, u32)>, Option<String>);

/// Another rank of the OOM's job on this node: its pid, whose it is, when it started.
#[derive(Clone, Debug)]
pub struct Peer {
    pub pid: u32,
    pub whose: Whose,
    pub started_ns: Option<i64>,
}

/// `--on-oom`'s command for the folder at `path`: /bin/sh -c CMD as its user, in their home,
/// with only the dump's facts and a plain PATH; killed at its timeout.
fn run_on_oom(
    on: &OnOom,
    path: &Path,
    oom: &OomStored,
    session: i64,
) -> super::on_warning::HookRun {
    use std::os::unix::process::CommandExt as _;
    let (uid, gid, home) = &on.user;
    let env = env_map(oom.env.as_deref());
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(&on.command)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", home)
        .env("TRACER_SESSION", session.to_string())
        .env("TRACER_PID", oom.pid.to_string())
        .env("TRACER_DUMP_DIR", path)
        .env("TRACER_JOB", &oom.job)
        .env("TRACER_RANK", env.get("RANK").map_or("", String::as_str))
        .current_dir(if Path::new(home).is_dir() {
            home.as_str()
        } else {
            "/"
        })
        .stdin(std::process::Stdio::null())
        // Its output goes to tracer's stderr: stdout is tracer's data (--json).
        .stdout(super::on_warning::stderr_handle())
        .stderr(std::process::Stdio::inherit())
        .process_group(0)
        .uid(*uid)
        .gid(*gid);
    super::on_warning::run_bounded(cmd, on.timeout, oom.pid, -1, oom.ts_ns)
}

/// Waits (a few seconds at most) until the message at the OOM is in the database: the calls
/// before it were stored with it or earlier.
fn wait_stored(db: &Path, session: i64, oom: &OomStored) -> Result<()> {
    if oom.seen == Seen::FailedAttempt {
        // Its calls were stored before the writer's watch read them.
        return Ok(());
    }
    let started = Instant::now();
    loop {
        let conn = rusqlite::Connection::open_with_flags(
            db,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .with_context(|| format!("open {} to dump an OOM", db.display()))?;
        let stored: i64 = conn
            .query_row(
                "SELECT count(*) FROM messages WHERE session_id = ?1 AND pid = ?2 AND ts_ns >= ?3",
                rusqlite::params![session, oom.pid, oom.ts_ns],
                |r| r.get(0),
            )
            .unwrap_or(0);
        if stored > 0 {
            return Ok(());
        }
        if started.elapsed() > STORED_WITHIN {
            return Err(anyhow!(
                "its OOM message was not stored within {STORED_WITHIN:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn snapshot_bytes(
    db: &Path,
    session: i64,
    oom: &OomStored,
    render: RenderSnapshot,
) -> Result<Vec<u8>> {
    let export = pytorch_snapshot::export(
        db,
        &SnapshotQuery {
            session: Some(session),
            pid: Some(oom.pid),
            at: At::Time(oom.ts_ns),
            since_ns: None,
            max_entries: DEFAULT_MAX_ENTRIES,
        },
    )
    .context("build the memory snapshot at the OOM")?;
    let mut out = Vec::new();
    render(&mut out, &export).context("write the memory snapshot")?;
    Ok(out)
}

fn layout_json(db: &Path, session: i64, oom: &OomStored, uid: u32) -> Result<Vec<u8>> {
    let (_, layouts) = layout(
        db,
        &LayoutQuery {
            session: Some(session),
            pid: Some(oom.pid),
            device: None,
            at: At::Time(oom.ts_ns),
        },
    )
    .context("lay out the allocator at the OOM")?;
    let mut value = serde_json::to_value(&layouts)?;
    let mine = |pid: u32| pid == oom.pid || (uid != 0 && oom.same_user.contains(&pid));
    redact_others(&mut value, &mine);
    Ok(serde_json::to_vec_pretty(&value)?)
}

/// An OOM's device, explain's verdict on it and its figures.
struct Verdict {
    device: i32,
    verdict: String,
    asked: Option<u64>,
    shortfall: Option<u64>,
}

fn report_of(oom: &OomStored, v: Option<Verdict>, path: &Path) -> OomReport {
    let env = env_map(oom.env.as_deref());
    OomReport {
        pid: oom.pid,
        ts_ns: oom.ts_ns,
        job: oom.job.clone(),
        rank: env.get("RANK").cloned(),
        node: nix::unistd::gethostname()
            .ok()
            .map(|h| h.to_string_lossy().into_owned()),
        pod_uid: oom.pod_uid.clone(),
        device: v.as_ref().map(|v| v.device),
        verdict: v.as_ref().map(|v| v.verdict.clone()),
        asked: v.as_ref().and_then(|v| v.asked),
        shortfall: v.as_ref().and_then(|v| v.shortfall),
        dump: path.to_owned(),
    }
}

/// Explain's report for the process (as written in its folder), and its OOM's device and
/// verdict.
fn explain_json(
    db: &Path,
    session: i64,
    oom: &OomStored,
    uid: u32,
) -> Result<(Vec<u8>, Option<Verdict>)> {
    let explained = explain(
        db,
        &ExplainQuery {
            session: Some(session),
            since: None,
            from: None,
            to: Some(oom.ts_ns + 1_000_000_000),
            pid: Some(oom.pid),
            skip_frames: Vec::new(),
        },
    )
    .context("explain the OOM")?;
    let mut report = serde_json::to_value(&explained.report)?;
    let verdict = report["holders"].as_array().and_then(|h| {
        let h = h.iter().find(|h| h["pid"] == oom.pid)?;
        Some(Verdict {
            device: h["device"].as_i64()? as i32,
            verdict: h["verdict"].as_str()?.to_owned(),
            asked: h["arithmetic"]["asked"].as_u64(),
            shortfall: h["arithmetic"]["shortfall"].as_u64(),
        })
    });
    let mine = |pid: u32| pid == oom.pid || (uid != 0 && oom.same_user.contains(&pid));
    redact_others(&mut report, &mine);
    Ok((serde_json::to_vec_pretty(&report)?, verdict))
}

/// What NVML said of each GPU at the OOM (its latest sample then): total and used bytes and
/// every process on it, named where it is the user's own (a rank of its job said so), else by
/// its bytes only. Where NVML was not read, said so.
fn gpu_json(db: &Path, session: i64, oom: &OomStored, uid: u32) -> Result<Vec<u8>> {
    let conn = rusqlite::Connection::open_with_flags(
        db,
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .with_context(|| format!("open {} to read NVML's samples", db.display()))?;
    let samples = crate::store::events::gpu_samples(&conn, session)?;
    let mut latest: Vec<&crate::model::GpuSample> = Vec::new();
    for s in samples.iter().filter(|s| s.ts_ns <= oom.ts_ns) {
        match latest.iter_mut().find(|l| l.gpu == s.gpu) {
            Some(l) => *l = s,
            None => latest.push(s),
        }
    }
    let mine = |pid: u32| pid == oom.pid || (uid != 0 && oom.same_user.contains(&pid));
    let gpus: Vec<serde_json::Value> = latest
        .iter()
        .map(|s| {
            let processes: Vec<serde_json::Value> = s
                .processes
                .iter()
                .map(|&(pid, bytes)| {
                    serde_json::json!({
                        "pid": mine(pid).then_some(pid),
                        "bytes": bytes,
                        "same_job": mine(pid) && (pid == oom.pid || oom.peers.iter().any(|p| p.pid == pid)),
                    })
                })
                .collect();
            serde_json::json!({
                "gpu": s.gpu,
                "sampled_ns": s.ts_ns,
                "total": s.total,
                "used": s.used,
                "this_process": s.processes.iter().any(|p| p.0 == oom.pid),
                "processes": processes,
            })
        })
        .collect();
    let said = if gpus.is_empty() {
        "NVML was not read before the OOM (no library, --nvml off, or no sample yet): the device's total and other processes' use are not known"
    } else {
        "NVML's latest sample at or before the OOM; other users' processes by their bytes only"
    };
    Ok(serde_json::to_vec_pretty(
        &serde_json::json!({ "said": said, "gpus": gpus }),
    )?)
}
