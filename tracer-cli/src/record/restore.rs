//! A tracer restarted while jobs run takes up each still-running process's state where an
//! earlier session left it: its newest keyframe, then the calls that session stored after it.
//! What happened between that session's last call of the process and now is a gap: stated
//! (the `gaps` table), and the layout heals from what it sees next (model/layout.rs).

use anyhow::{Context as _, Result};

use crate::traced::procinfo;
use crate::{
    model::{
        layout::{AllocConf, Layout},
        run_series::GapRow,
        state::ProcessState,
    },
    store::{
        boot_id, events, keyframes,
        walk::{walk, Step},
        Store,
    },
};

/// The allocator settings the process ran with, as that session kept them.
fn conf_of(conn: &rusqlite::Connection, session: i64, pid: u32) -> Result<AllocConf> {
    Ok(events::alloc_confs(conn, session)?
        .get(&pid)
        .map_or_else(AllocConf::default, |c| AllocConf::parse(c)))
}

/// A process taken up from an earlier session.
pub struct TakenUp {
    pub state: ProcessState,
    pub from_session: i64,
    /// The keyframe it came from (None: that session's first call), and the calls stored after.
    keyframe: Option<i64>,
    walked: u64,
}

impl TakenUp {
    /// The gap from that session's last call of the process to `to_ns` (when this session's
    /// probes were attached): marked on its layout, and said.
    pub fn close_gap(&mut self, to_ns: i64) -> GapRow {
        let from = self.state.last_ns;
        self.state.layout.mark_gap(Some(from), to_ns);
        GapRow {
            pid: self.state.pid,
            from_ns: Some(from),
            to_ns,
            kind: "restart".into(),
            detail: format!(
                "state taken up from session {}: {} and the {} calls it stored after it; the calls between its last one and this session were not seen",
                self.from_session,
                self.keyframe
                    .map_or_else(|| "its first call".to_owned(), |k| format!("its keyframe {k}")),
                self.walked
            ),
        }
    }
}

/// The states of the processes running now (in `scope`, or all) that an earlier session of
/// this boot kept, advanced by that session's calls of them after its last keyframe. Done
/// before any probe is attached: probes filling a ring nobody reads yet would lose calls.
pub fn take_up(store: &Store, scope: Option<&[u32]>) -> Result<Vec<TakenUp>> {
    let boot = boot_id();
    let conn = store.conn();
    // Every process of an earlier session of this boot, with the latest session that knew it.
    let candidates: Vec<(u32, i64, i64)> = conn
        .prepare(
            "SELECT pid, start_time_ns, max(session_id) FROM (
                 SELECT p.pid, p.start_time_ns, p.session_id FROM processes p
                 UNION ALL
                 SELECT s.pid, s.start_time_ns, k.session_id FROM keyframe_states s
                 JOIN keyframes k ON k.id = s.keyframe_id
             ) JOIN sessions ss ON ss.id = session_id
             WHERE ss.boot_id = ?1 AND start_time_ns IS NOT NULL
             GROUP BY pid, start_time_ns",
        )?
        .query_map(rusqlite::params![boot], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?
        .collect::<rusqlite::Result<_>>()
        .context("list the processes earlier sessions kept")?;
    let mut out = Vec::new();
    for (pid, start, from_session) in candidates {
        if scope.is_some_and(|s| !s.contains(&pid)) || procinfo::start_time_ns(pid) != Some(start) {
            continue;
        }
        let (mut state, after_block, keyframe) =
            match keyframes::latest_state_of(conn, pid, start, from_session)? {
                Some((k, state)) => (state, k.through_block, Some(k.id)),
                // No keyframe yet (a session killed within its first seconds): its calls from
                // the first, unless some were evicted.
                None if !keyframes::evicted(conn, from_session)? => (
                    ProcessState {
                        pid,
                        start_time_ns: Some(start),
                        layout: Layout::new(conf_of(conn, from_session, pid)?),
                        ..Default::default()
                    },
                    0,
                    None,
                ),
                None => continue,
            };
        // From the latest keyframe (or a session nothing was evicted of): no hole follows.
        let walked = walk(
            conn,
            from_session,
            after_block,
            i64::MAX,
            Some(pid),
            |step| {
                if let Step::Call(e) = step {
                    state.apply_memory(e);
                    state.apply_join(e);
                }
                Ok(())
            },
        )?;
        if state.events == 0 && keyframe.is_none() {
            continue;
        }
        out.push(TakenUp {
            state,
            from_session,
            keyframe,
            walked: walked.calls,
        });
    }
    Ok(out)
}
