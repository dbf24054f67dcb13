//! Reading a session and explaining it: the bridge from the store to analysis that every
//! presenter of a report (text, JSON, the demo's live chains) goes through.

use std::{path::Path, time::Duration};

use anyhow::Result;

use crate::{
    analysis::{self, Host, Report},
    exit::user_error,
    model::{span, Window},
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
        (Some(since), _, _) => Window {
            from_ns: end - since.as_nanos() as i64,
            to_ns: end,
        },
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
    let report = analysis::analyze(info.id, &all, &host, window, &comms, &sites);
    Ok(Explained {
        report,
        running,
        load_time: t1 - t0,
        analysis_time: t1.elapsed(),
    })
}
