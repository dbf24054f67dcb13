//! Explaining a session: the window, one walk from the nearest keyframe through analysis's
//! collector, and what the answer covers (what --max-db evicted and the whole-run series in its
//! place, what tracer did not see). Every presenter of a report (text, JSON, the demo's live
//! chains, the HTML report, mcp) goes through it.

use std::{collections::HashMap, path::Path, time::Duration};

use anyhow::{Context as _, Result};
use rusqlite::Connection;

use crate::{
    analysis::{self, Collector, Coverage, Evicted, Explanation, Host, Inputs, SpanFigures},
    exit::user_error,
    model::{layout::AllocConf, state::ProcessState, Event, MessageRow, Rank, SiteLabels, Window},
    store::{events, series, walk::Hole, Access, Store},
    units::format_utc,
};

/// explain replays the requests under the settings its fixes name up to this many events in
/// the window.
const CITE_EVENTS: u64 = 2_000_000;

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
    pub report: Explanation,
    /// The session was still being recorded: the window ends now.
    pub running: bool,
    /// The window ends where --to said (not at the session's end).
    pub to_given: bool,
    /// Time spent reading the calls (with the analysis they fed), and finishing the analysis.
    pub load_time: Duration,
    pub analysis_time: Duration,
    /// PyTorch's out-of-memory messages (said beside the arming of its probes).
    pub messages: Vec<crate::model::MessageRow>,
}

/// What explain knows of a session beside its calls.
pub struct Known {
    pub comms: HashMap<u32, String>,
    pub sites: SiteLabels,
    pub confs: HashMap<u32, AllocConf>,
    pub ranks: HashMap<u32, Rank>,
    pub placements: HashMap<u32, crate::model::Placement>,
    pub owners: HashMap<crate::model::StackId, String>,
    pub gpu_samples: Vec<crate::model::GpuSample>,
    pub messages: Vec<MessageRow>,
    pub expandable: std::collections::HashSet<u32>,
    pub untimed: bool,
    pub budgets: HashMap<u32, crate::analysis::startup::Budget>,
}

impl Known {
    pub fn read(conn: &Connection, session: i64, skip_frames: &[String]) -> Result<Known> {
        let mut confs = HashMap::new();
        let mut ranks = HashMap::new();
        let mut expandable = std::collections::HashSet::new();
        for (pid, env) in events::envs(conn, session)? {
            let get = |k: &str| env.get(k).map(String::as_str);
            confs.extend(AllocConf::from_env(get).map(|c| (pid, c)));
            ranks.extend(Rank::from_env(get).map(|r| (pid, r)));
            if AllocConf::expandable_from_env(get) {
                expandable.insert(pid);
            }
        }
        Ok(Known {
            comms: events::comms(conn, session)?,
            sites: events::site_labels(conn, session, skip_frames)?,
            confs,
            ranks,
            placements: events::placements(conn, session)?,
            owners: events::stack_owners(conn, session)?,
            gpu_samples: events::gpu_samples(conn, session)?,
            messages: events::messages(conn, session)?,
            expandable,
            untimed: events::source(conn, session)? == crate::store::SNAPSHOT_UNTIMED,
            budgets: events::cmdlines(conn, session)?
                .into_iter()
                .filter_map(|(pid, c)| {
                    crate::analysis::startup::Budget::from_cmdline(&c).map(|b| (pid, b))
                })
                .collect(),
        })
    }

    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            comms: &self.comms,
            sites: &self.sites,
            confs: &self.confs,
            messages: &self.messages,
            ranks: &self.ranks,
            placements: &self.placements,
            owners: &self.owners,
            gpu_samples: &self.gpu_samples,
            expandable: &self.expandable,
            untimed: self.untimed,
            budgets: &self.budgets,
        }
    }
}

/// The window a query asks for, and whether the user chose its start.
pub struct Windowed {
    pub session: i64,
    pub running: bool,
    pub window: Window,
    pub from_given: bool,
    pub to_given: bool,
}

/// Why a session holds no calls: none recorded, or --max-db evicted them all (said with what
/// is left: the whole-run series).
fn nothing_kept(conn: &Connection, session: i64) -> String {
    let evicted: (i64, i64) = conn
        .query_row(
            "SELECT evicted_events, (SELECT count(*) FROM series WHERE session_id = ?1) FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap_or((0, 0));
    match evicted {
        (0, _) => format!("session {session} recorded no calls: nothing to explain"),
        (events, rows) => format!(
            "session {session} keeps no calls: --max-db evicted all {events} of its events; what is left is its whole-run series ({rows} rows: `tracer query \"SELECT * FROM series WHERE session_id = {session}\"`); a larger --max-db keeps the detail"
        ),
    }
}

/// A window that ends before the first call kept: its calls were evicted by --max-db, and the
/// whole-run series answers for it (from the session's start, or --from, to --to).
fn evicted_span(conn: &Connection, session: i64, q: &ExplainQuery) -> Result<Option<(i64, i64)>> {
    let (Some(to), None) = (q.to, q.pid) else {
        return Ok(None);
    };
    let (started, evicted): (i64, i64) = conn
        .query_row(
            "SELECT started_ns, evicted_events FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .with_context(|| format!("read session {session}"))?;
    Ok((evicted > 0).then_some((q.from.unwrap_or(started).min(to), to)))
}

/// The window of `q` in its session.
pub fn window(conn: &Connection, q: &ExplainQuery) -> Result<Windowed> {
    let info = events::session(conn, q.session)?;
    let running = info.status == "running";
    let Some((first, last)) = span(conn, info.id, q.pid, q.to)?.or(evicted_span(conn, info.id, q)?)
    else {
        return Err(user_error(match (q.pid, q.to) {
            (Some(pid), _) => format!(
                "session {} recorded no calls of pid {pid}: nothing to explain",
                info.id
            ),
            (None, Some(_)) => format!(
                "session {} recorded no calls before --to: nothing to explain",
                info.id
            ),
            (None, None) => nothing_kept(conn, info.id),
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
    Ok(Windowed {
        session: info.id,
        running,
        window,
        from_given: q.since.is_some() || q.from.is_some(),
        to_given: q.since.is_none() && q.to.is_some(),
    })
}

/// The first and last stored call of the session (of `pid`: read from the blocks at either end
/// that hold its calls), up to `to`.
fn span(
    conn: &Connection,
    session: i64,
    pid: Option<u32>,
    to: Option<i64>,
) -> Result<Option<(i64, i64)>> {
    let to = to.unwrap_or(i64::MAX);
    if let Some(pid) = pid {
        return crate::store::walk::pid_span(conn, session, pid, to);
    }
    let Some((first, last)) = events::stored_span(conn, session)? else {
        return Ok(None);
    };
    Ok((first <= to).then_some((first, last.min(to))))
}

/// Explains the window: one walk from the nearest keyframe at or before it.
pub fn explain(db: &Path, q: &ExplainQuery) -> Result<Explained> {
    explain_visiting(db, q, &mut ())
}

/// What else sees explain's walk (the HTML report draws from the same walk): where it starts,
/// then each call.
pub trait Visit {
    fn start(&mut self, _begin: &super::Begin) {}
    fn call(&mut self, e: &Event);
    /// The walk passed a hole --max-db left: the processes' states after it.
    fn resume(&mut self, _hole: &Hole, _states: &[ProcessState]) {}
}

impl Visit for () {
    fn call(&mut self, _: &Event) {}
}

/// Calls handed to a visitor on its own thread at a time.
const BATCH: usize = 16 * 1024;

/// What the walk hands a visitor on another thread, in the walk's order.
enum Handed {
    Start(Box<super::Begin>),
    Calls(Vec<Event>),
    Resume(Hole, Vec<ProcessState>),
}

/// The walk's side of a visitor on another thread: calls in batches, the rest as it comes.
struct Handing {
    tx: std::sync::mpsc::SyncSender<Handed>,
    batch: Vec<Event>,
}

impl Handing {
    fn hand(&mut self, what: Handed) {
        // The receiver goes only when the visitor panicked: the join below reports it.
        let _ = self.tx.send(what);
    }

    fn flush(&mut self) {
        if !self.batch.is_empty() {
            let batch = std::mem::replace(&mut self.batch, Vec::with_capacity(BATCH));
            self.hand(Handed::Calls(batch));
        }
    }
}

impl Visit for Handing {
    fn start(&mut self, begin: &super::Begin) {
        self.flush();
        self.hand(Handed::Start(Box::new(begin.clone())));
    }

    fn call(&mut self, e: &Event) {
        self.batch.push(*e);
        if self.batch.len() == BATCH {
            self.flush();
        }
    }

    fn resume(&mut self, hole: &Hole, states: &[ProcessState]) {
        self.flush();
        self.hand(Handed::Resume(*hole, states.to_vec()));
    }
}

/// [`explain_visiting`] with `visit` on a thread of its own: explain's analysis and the
/// visitor's work (the report's pass) each take a core instead of one after the other.
pub fn explain_beside<V: Visit + Send>(
    db: &Path,
    q: &ExplainQuery,
    visit: &mut V,
) -> Result<Explained> {
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel(4);
        let worker = scope.spawn(move || {
            for handed in rx {
                match handed {
                    Handed::Start(begin) => visit.start(&begin),
                    Handed::Calls(calls) => calls.iter().for_each(|e| visit.call(e)),
                    Handed::Resume(hole, states) => visit.resume(&hole, &states),
                }
            }
        });
        let mut handing = Handing {
            tx,
            batch: Vec::with_capacity(BATCH),
        };
        let explained = explain_visiting(db, q, &mut handing);
        handing.flush();
        drop(handing);
        worker
            .join()
            .map_err(|_| anyhow::anyhow!("the report's pass over the calls panicked"))?;
        explained
    })
}

/// [`explain`], also handing the walk to `visit`.
///
/// One connection, in one read transaction (every read sees the same database, also while a
/// trace writes or `--max-db` evicts), and one walk: the window's span comes from the blocks at
/// its ends, and the runs whatif replays for the fixes' citations from the walk itself where it
/// saw them whole.
pub fn explain_visiting(db: &Path, q: &ExplainQuery, visit: &mut impl Visit) -> Result<Explained> {
    let store = Store::open(db, Access::ReadOnly)?;
    let read = store
        .conn()
        .unchecked_transaction()
        .with_context(|| format!("begin reading {}", db.display()))?;
    let conn: &Connection = &read;
    let t0 = std::time::Instant::now();
    let Windowed {
        session,
        running,
        mut window,
        from_given,
        to_given,
    } = window(conn, q)?;
    let begin = super::begin(conn, session, window.from_ns, q.pid)?;
    visit.start(&begin);
    let mut clipped_from = None;
    let mut window_evicted = false;
    if let Some(k) = begin.keyframe().filter(|k| k.ts_ns >= window.from_ns) {
        // The calls before the keyframe were evicted: the window begins at it, unless all of
        // it was.
        if from_given {
            clipped_from = Some(window.from_ns);
        }
        window_evicted = k.ts_ns >= window.to_ns;
        if !window_evicted {
            window.from_ns = k.ts_ns;
        }
    }
    let known = Known::read(conn, session, &q.skip_frames)?;
    let mut host = Host::new(events::host(conn, session, window.to_ns, q.pid)?);
    let armed_from_start: Vec<u32> = begin
        .states
        .iter()
        .filter(|s| {
            matches!(
                s.layout.block_sight(),
                crate::model::layout::BlockSight::ArmedAt(_)
            )
        })
        .map(|s| s.pid)
        .collect();
    let oom_messages: Vec<crate::model::MessageRow> = known
        .messages
        .iter()
        .filter(|m| m.op == tracer_common::Op::TorchOom.name())
        .cloned()
        .collect();
    let inputs = known.inputs();
    let mut collector = Collector::new(window, &inputs, begin.states.clone());
    // The fixes' citations replay each process's whole run: this walk holds it when it starts
    // at the session's beginning and runs to its end (and the session is small enough for
    // citations at all: a larger one is not recorded on the way).
    let small = events::stored_calls(conn, session)? <= CITE_EVENTS;
    let mut recordings = if small && begin.keyframe().is_none() && q.to.is_none() {
        Some(super::whatif::Recordings::new(conn, session, &begin)?)
    } else {
        None
    };
    let mut in_window: u64 = 0;
    let mut implausible: Option<Event> = None;
    let mut holes = Vec::new();
    let mut arming = Vec::new();
    super::walk(
        conn,
        session,
        &begin,
        window.to_ns,
        q.pid,
        |step| match step {
            super::Step::Call(e) => {
                if window.contains(e.ts_ns) {
                    in_window += 1;
                    if in_window > CITE_EVENTS {
                        // Too many to cite: the citations are not made.
                        recordings = None;
                    }
                }
                if let Some(r) = recordings.as_mut() {
                    r.call(e);
                }
                if implausible.is_none()
                    && events::check_plausible(session, std::slice::from_ref(e)).is_err()
                {
                    implausible = Some(*e);
                }
                if let Some(row) = crate::model::arming::ArmingRow::of(e) {
                    arming.push(row);
                }
                collector.feed(e);
                visit.call(e);
            }
            super::Step::Resume { hole, states } => {
                visit.resume(hole, &states);
                collector.resume(hole, states);
                holes.push(*hole);
            }
        },
    )?;
    if let Some(e) = implausible {
        events::check_plausible(session, &[e])?;
    }
    host.follow_while_armed(&armed_from_start, &arming);
    let t1 = std::time::Instant::now();
    let mut report =
        analysis::analyze_collected(session, collector.finish(), &host, window, &inputs);
    report.arming = arming;
    report.coverage = Coverage {
        states: std::mem::take(&mut report.coverage.states),
        window_evicted,
        ..coverage(
            conn,
            session,
            q.pid,
            &begin,
            (clipped_from, window.to_ns),
            holes,
        )?
    };
    // The fixes that name an allocator setting say what it would have done to these requests
    // (a replay per setting: small runs only, `tracer whatif` for the rest).
    if report.events_in_window <= CITE_EVENTS {
        if let Err(e) = super::whatif::cite_in_fixes(conn, session, &mut report.chains, recordings)
        {
            log::warn!("simulating the fixes of session {session}: {e:#}");
        }
    }
    let explained = Explained {
        report,
        running,
        to_given,
        load_time: t1 - t0,
        analysis_time: t1.elapsed(),
        messages: oom_messages,
    };
    Ok(explained)
}

/// What the answer covers: evictions, the whole-run series where the detail is gone, gaps.
fn coverage(
    conn: &Connection,
    session: i64,
    pid: Option<u32>,
    begin: &super::Begin,
    (clipped_from, to_ns): (Option<i64>, i64),
    holes: Vec<Hole>,
) -> Result<Coverage> {
    let s = events::session_summary(conn, session)?;
    let evicted = (s.evicted_events > 0).then_some(Evicted {
        events: s.evicted_events,
        calls: s.evicted_calls,
        block_events: s.evicted_block_events,
        offcpu: s.evicted_offcpu,
        until_ns: s.evicted_until_ns,
    });
    let keyframe_ns = begin.keyframe().map(|k| k.ts_ns);
    let before_detail = match (&evicted, keyframe_ns) {
        // The part of the window before the keyframe: its detail was evicted.
        (Some(_), Some(k)) => span_figures(
            &series::series(conn, session, pid)?,
            clipped_from.unwrap_or(i64::MIN),
            k.min(to_ns),
        ),
        _ => Vec::new(),
    };
    let gaps = series::gaps(conn, session)?
        .into_iter()
        .filter(|g| pid.is_none_or(|p| p == g.pid))
        .collect();
    Ok(Coverage {
        keyframe_ns,
        window_clipped_from_ns: clipped_from,
        window_evicted: false,
        evicted,
        gaps,
        before_detail,
        holes,
        kept: series::kept(conn, session)?,
        states: Vec::new(),
        never_traced: never_traced(conn, session, pid)?,
    })
}

/// The processes that opened a CUDA library before it was probed and made no call tracer saw
/// (ended first, or right after), once each (the first library it opened).
fn never_traced(
    conn: &Connection,
    session: i64,
    pid: Option<u32>,
) -> Result<Vec<crate::model::discovery::DiscoveryRow>> {
    use crate::model::discovery::Outcome;
    // Found late but no call of it reached the session: as good as never traced.
    let traced: std::collections::HashSet<u32> =
        crate::store::events::processes_seen_from_start(conn, session)?
            .into_iter()
            .map(|(p, _)| p)
            .collect();
    let mut seen = std::collections::HashSet::new();
    Ok(crate::store::discovery::rows(conn, session)?
        .into_iter()
        .filter(|r| {
            matches!(r.outcome, Outcome::Missed | Outcome::Late) && !traced.contains(&r.pid)
        })
        .filter(|r| pid.is_none_or(|p| p == r.pid) && seen.insert(r.pid))
        .collect())
}

/// Per process and device, the whole-run series' figures of the intervals that overlap
/// [`from_ns`, `until_ns`).
fn span_figures(
    rows: &[crate::model::run_series::SeriesRow],
    from_ns: i64,
    until_ns: i64,
) -> Vec<SpanFigures> {
    let mut out: Vec<SpanFigures> = Vec::new();
    for r in rows
        .iter()
        .filter(|r| r.end_ns > from_ns && r.start_ns < until_ns)
    {
        let i = match out
            .iter()
            .position(|f| f.pid == r.pid && f.device == r.device)
        {
            Some(i) => i,
            None => {
                out.push(SpanFigures {
                    pid: r.pid,
                    device: r.device,
                    from_ns: r.start_ns,
                    ..SpanFigures::default()
                });
                out.len() - 1
            }
        };
        out[i].absorb(r);
    }
    out
}

#[cfg(test)]
mod tests {
    use crate::store::tests::{new_store, varied_calls, write};

    /// explain on a session whose calls --max-db evicted all says so, with what is left, rather
    /// than that it recorded none.
    #[test]
    fn explain_says_every_call_was_evicted_not_that_none_was_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, session) = new_store(&dir);
        store.insert_keyframe(session, 0, &[]).unwrap();
        write(&mut store, session, &varied_calls(5000, 1));
        store.insert_keyframe(session, 0, &[]).unwrap();
        store.enforce_max_size(session, 172_032).unwrap();
        let q = super::ExplainQuery {
            session: Some(session),
            since: None,
            from: None,
            to: None,
            pid: None,
            skip_frames: Vec::new(),
        };
        let Err(e) = super::window(store.conn(), &q) else {
            panic!("a window of nothing");
        };
        let text = e.to_string();
        assert!(text.contains("evicted all 5000 of its events"), "{text}");
    }
}
