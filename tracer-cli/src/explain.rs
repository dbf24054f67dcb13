//! Reading a session and explaining it: the bridge from the store to analysis that every
//! presenter of a report (text, JSON, the demo's live chains) goes through.

use std::{collections::HashMap, path::Path, time::Duration};

use anyhow::Result;

use crate::{
    analysis::{self, Host, Report},
    exit::user_error,
    model::{layout::AllocConf, span, Event, Window},
    store::{events, Access, Store},
    units::format_utc,
};

/// Which part of which session to explain.
#[derive(Clone, Debug, Default)]
pub struct ExplainQuery {
    /// The session (default: the latest).
    pub session: Option<i64>,
    /// Only the last part, ending at the session's last event (or now, while it runs).
    pub since: Option<Duration>,
    /// Window start and end, ns since the epoch.
    pub from: Option<i64>,
    pub to: Option<i64>,
    pub pid: Option<u32>,
    /// Frames whose file contains one of these are not the user's code.
    pub skip_frames: Vec<String>,
}

/// A session's report, and how it was made.
pub struct Explained {
    pub report: Report,
    /// The session was still being recorded: the window ends now.
    pub running: bool,
    /// Time spent loading the calls and analysing them.
    pub load_time: Duration,
    pub analysis_time: Duration,
}

/// Loads the session's calls (all of them up to the window's end: earlier calls tell which
/// allocations are live) and analyses the window.
pub fn explain(db: &Path, q: &ExplainQuery) -> Result<Explained> {
    Ok(explain_with_calls(db, q)?.0)
}

/// [`explain`], handing back the calls it loaded (every call up to the window's end, in time
/// order) for a caller that walks them again (the HTML report).
pub fn explain_with_calls(db: &Path, q: &ExplainQuery) -> Result<(Explained, Vec<Event>)> {
    let store = Store::open(db, Access::ReadOnly)?;
    let info = events::session(store.conn(), q.session)?;
    let running = info.status == "running";
    let t0 = std::time::Instant::now();
    let all = events::load(db, info.id, q.to.unwrap_or(i64::MAX), q.pid)?;
    let Some((first, last)) = span(&all) else {
        return Err(user_error(match (q.pid, q.to) {
            (Some(pid), _) => format!(
                "session {} recorded no calls of pid {pid}: nothing to explain",
                info.id
            ),
            (None, Some(_)) => format!(
                "session {} recorded no calls before --to: nothing to explain",
                info.id
            ),
            (None, None) => format!("session {} recorded no calls: nothing to explain", info.id),
        }));
    };
    let end = if running {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(last, |d| d.as_nanos() as i64)
    } else {
        last
    };
    let window = match (q.since, q.from, q.to) {
        (Some(since), _, _) => {
            let back = i64::try_from(since.as_nanos()).unwrap_or(i64::MAX);
            if back > end {
                return Err(user_error(format!(
                    "--since {}s reaches before 1970: give a duration within the trace (the session began at {})",
                    since.as_secs(),
                    format_utc(first)
                )));
            }
            Window {
                from_ns: end - back,
                to_ns: end,
            }
        }
        (None, from, to) => Window {
            from_ns: from.unwrap_or(first),
            to_ns: to.unwrap_or(end),
        },
    };
    if window.from_ns >= window.to_ns {
        return Err(user_error(format!(
            "empty window: --from {} is not before --to {}",
            format_utc(window.from_ns),
            format_utc(window.to_ns)
        )));
    }
    let comms = events::comms(store.conn(), info.id)?;
    let sites = events::site_labels(store.conn(), info.id, &q.skip_frames)?;
    let t1 = std::time::Instant::now();
    let host = Host::new(events::host(store.conn(), info.id, window.to_ns, q.pid)?);
    let mut confs = HashMap::new();
    let mut ranks = HashMap::new();
    for (pid, env) in events::envs(store.conn(), info.id)? {
        let get = |k: &str| env.get(k).map(String::as_str);
        confs.extend(AllocConf::from_env(get).map(|c| (pid, c)));
        ranks.extend(crate::model::Rank::from_env(get).map(|r| (pid, r)));
    }
    let messages = events::messages(store.conn(), info.id)?;
    let inputs = analysis::Inputs {
        comms: &comms,
        sites: &sites,
        confs: &confs,
        messages: &messages,
        ranks: &ranks,
    };
    let report = analysis::analyze(info.id, &all, &host, window, &inputs);
    let explained = Explained {
        report,
        running,
        load_time: t1 - t0,
        analysis_time: t1.elapsed(),
    };
    Ok((explained, all))
}

/// The moment a layout is shown at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum At {
    /// The session's last event.
    End,
    /// A wall-clock time, ns since the epoch.
    Time(i64),
    /// The first out-of-memory: PyTorch's message, else the first failed allocation.
    Oom,
}

/// Which layout to show.
#[derive(Clone, Debug)]
pub struct LayoutQuery {
    pub session: Option<i64>,
    pub pid: Option<u32>,
    pub device: Option<i32>,
    pub at: At,
}

/// One process's layout at a moment.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ProcessLayout {
    pub pid: u32,
    pub comm: Option<String>,
    pub at_ns: i64,
    /// "allocator": PyTorch's probes were seen, the blocks are known; "segments": only the
    /// device allocations are (no probes: another framework, an older PyTorch, the
    /// cudaMallocAsync backend).
    pub view: &'static str,
    pub devices: Vec<DeviceLayout>,
    pub unexplained: crate::model::layout::Unexplained,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<crate::model::layout::SegmentMap>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceLayout {
    pub device: i32,
    pub total: crate::model::layout::PoolStats,
    pub pools: Vec<(crate::model::layout::Pool, crate::model::layout::PoolStats)>,
    /// Device memory allocated outside the allocator's segments.
    pub outside: u64,
}

/// The session's processes' layouts at `q.at` (processes with device allocations only).
pub fn layout(db: &Path, q: &LayoutQuery) -> Result<(i64, Vec<ProcessLayout>)> {
    use crate::model::layout::{AllocConf, Layout};
    let store = Store::open(db, Access::ReadOnly)?;
    let info = events::session(store.conn(), q.session)?;
    let at_ns = match q.at {
        At::End => i64::MAX,
        At::Time(t) => t,
        At::Oom => oom_time(db, store.conn(), info.id, q.pid)?.ok_or_else(|| {
            user_error(format!(
                "session {} recorded no out-of-memory: no failed allocation and no PyTorch OOM",
                info.id
            ))
        })?,
    };
    let all = events::load(db, info.id, at_ns, q.pid)?;
    let comms = events::comms(store.conn(), info.id)?;
    let confs = events::alloc_confs(store.conn(), info.id)?;
    let mut layouts: std::collections::BTreeMap<u32, (Layout, i64)> = Default::default();
    for e in &all {
        let (l, last) = layouts.entry(e.pid).or_insert_with(|| {
            let conf = confs
                .get(&e.pid)
                .map_or_else(AllocConf::default, |c| AllocConf::parse(c));
            (Layout::new(conf), e.ts_ns)
        });
        l.apply(e);
        *last = e.ts_ns;
    }
    let out = layouts
        .into_iter()
        .filter(|(_, (l, _))| {
            !l.stats().is_empty() || !l.segments().is_empty() || l.blocks_seen > 0
        })
        .map(|(pid, (l, last))| {
            process_layout(pid, comms.get(&pid).cloned(), &l, last.min(at_ns), q.device)
        })
        .collect();
    Ok((info.id, out))
}

pub(crate) fn process_layout(
    pid: u32,
    comm: Option<String>,
    l: &crate::model::layout::Layout,
    at_ns: i64,
    device: Option<i32>,
) -> ProcessLayout {
    let mut devices: Vec<i32> = l.stats().keys().map(|(d, _)| *d).collect();
    devices.dedup();
    devices.retain(|d| device.is_none_or(|want| want == *d));
    ProcessLayout {
        pid,
        comm,
        at_ns,
        view: if l.blocks_seen > 0 {
            "allocator"
        } else {
            "segments"
        },
        devices: devices
            .into_iter()
            .map(|d| DeviceLayout {
                device: d,
                total: l.device_total(d),
                pools: l
                    .stats()
                    .iter()
                    .filter(|((dev, _), _)| *dev == d)
                    .map(|((_, pool), s)| (*pool, *s))
                    .collect(),
                outside: l.outside(d),
            })
            .collect(),
        unexplained: l.unexplained,
        segments: l
            .segments()
            .into_iter()
            .filter(|s| device.is_none_or(|d| d == s.device))
            .collect(),
    }
}

/// When the first out-of-memory happened: PyTorch's message, else the first failed allocation.
pub(crate) fn oom_time(
    db: &Path,
    conn: &rusqlite::Connection,
    session: i64,
    pid: Option<u32>,
) -> Result<Option<i64>> {
    let message = events::messages(conn, session)?
        .into_iter()
        .find(|m| m.op == tracer_common::Op::TorchOom.name() && pid.is_none_or(|p| p == m.pid))
        .map(|m| m.ts_ns);
    if message.is_some() {
        return Ok(message);
    }
    Ok(events::load(db, session, i64::MAX, pid)?
        .iter()
        .find(|e| e.ret != 0 && e.class() == tracer_common::OpClass::Alloc)
        .map(|e| e.ts_ns))
}

/// The figures after one of PyTorch's block events.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayoutPoint {
    pub ts_ns: i64,
    pub pid: u32,
    pub op: &'static str,
    pub ptr: u64,
    pub total: crate::model::layout::PoolStats,
    pub pools: std::collections::BTreeMap<String, crate::model::layout::PoolStats>,
}

/// The layout's figures after every block event of the session (one process, or all).
pub fn layout_timeline(
    db: &Path,
    session: Option<i64>,
    pid: Option<u32>,
) -> Result<Vec<LayoutPoint>> {
    use crate::model::layout::{AllocConf, Layout, Pool};
    let store = Store::open(db, Access::ReadOnly)?;
    let info = events::session(store.conn(), session)?;
    let confs = events::alloc_confs(store.conn(), info.id)?;
    let mut layouts: std::collections::HashMap<u32, Layout> = Default::default();
    let mut points = Vec::new();
    for e in events::load(db, info.id, i64::MAX, pid)? {
        let l = layouts.entry(e.pid).or_insert_with(|| {
            Layout::new(
                confs
                    .get(&e.pid)
                    .map_or_else(AllocConf::default, |c| AllocConf::parse(c)),
            )
        });
        l.apply(&e);
        if matches!(
            e.class(),
            tracer_common::OpClass::BlockAlloc | tracer_common::OpClass::BlockFree
        ) {
            let mut pools = std::collections::BTreeMap::new();
            for ((_, pool), s) in l.stats() {
                let name = if *pool == Pool::Small {
                    "small"
                } else {
                    "large"
                };
                let p: &mut crate::model::layout::PoolStats =
                    pools.entry(name.to_owned()).or_default();
                p.allocated += s.allocated;
                p.reserved += s.reserved;
                p.free_blocks += s.free_blocks;
                p.largest_free = p.largest_free.max(s.largest_free);
            }
            points.push(LayoutPoint {
                ts_ns: e.ts_ns,
                pid: e.pid,
                op: e.op.name(),
                ptr: e.ptr,
                total: l.total(),
                pools,
            });
        }
    }
    Ok(points)
}

/// Streams a session (or one process of it) into a Perfetto trace: its calls as they are
/// stored, then the texts its programs produced (PyTorch's OOM messages).
pub fn export_perfetto(
    db: &Path,
    session: Option<i64>,
    pid: Option<u32>,
    out: impl std::io::Write,
) -> Result<(i64, crate::present::perfetto::Written)> {
    let store = Store::open(db, Access::ReadOnly)?;
    let info = events::session(store.conn(), session)?;
    let names = events::comms(store.conn(), info.id)?;
    let confs = events::alloc_confs(store.conn(), info.id)?
        .into_iter()
        .map(|(p, c)| (p, AllocConf::parse(&c)))
        .collect();
    let sites = events::site_labels(store.conn(), info.id, &[])?;
    let mut writer = crate::present::perfetto::PerfettoWriter::new(out, names, confs, sites);
    let mut failed = None;
    events::stream(db, info.id, |e| {
        if failed.is_none() && pid.is_none_or(|p| p == e.pid) {
            failed = writer.call(&e).err();
        }
    })?;
    if let Some(e) = failed {
        return Err(e);
    }
    for m in events::messages(store.conn(), info.id)? {
        if pid.is_none_or(|p| p == m.pid) {
            writer.message(&m)?;
        }
    }
    Ok((info.id, writer.finish()?))
}
