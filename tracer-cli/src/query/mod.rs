//! The read side: every answer about a stored session (explain, layout, the HTML report, the
//! Perfetto export, the MCP tools) comes from one time-ordered walk over its calls that starts
//! at the nearest keyframe at or before the window (model/state.rs) and reads forward once.
//! Memory holds the processes' live state and what the answer keeps, never the session's calls:
//! after --max-db evicted the early calls, or for a window at hour 70, the walk starts from a
//! keyframe as exact as the first call. Presenters (present/) render what this returns; nothing
//! here renders.

pub mod diff;
pub mod explain;
pub mod layout;
pub mod report;
pub mod snapshot_check;
pub mod whatif;

use std::path::Path;

use anyhow::Result;
use rusqlite::Connection;

use crate::{
    model::{state::ProcessState, Event},
    store::{
        keyframes::{self, Keyframe, Start},
        walk::{self, Hole, Walked},
    },
};

/// Where a walk starts, and the processes' states there.
#[derive(Clone)]
pub struct Begin {
    pub start: Start,
    pub states: Vec<ProcessState>,
}

impl Begin {
    /// The keyframe the walk starts at, if any.
    pub fn keyframe(&self) -> Option<Keyframe> {
        match self.start {
            Start::Beginning => None,
            Start::Keyframe { keyframe, .. } => Some(keyframe),
        }
    }

    /// The calls before the keyframe were evicted although the window began before it: the
    /// window can only begin at the keyframe.
    pub fn clipped(&self) -> bool {
        matches!(self.start, Start::Keyframe { clipped: true, .. })
    }
}

/// The start for a window of `session` beginning at `from_ns` (one process's, or all).
pub fn begin(conn: &Connection, session: i64, from_ns: i64, pid: Option<u32>) -> Result<Begin> {
    let start = keyframes::start_for(conn, session, from_ns)?;
    let states = match &start {
        Start::Beginning => Vec::new(),
        Start::Keyframe { keyframe, .. } => keyframes::states(conn, keyframe, pid)?,
    };
    Ok(Begin { start, states })
}

/// What a walk hands on.
pub enum Step<'a> {
    /// The next call.
    Call(&'a Event),
    /// --max-db deleted the calls of `hole` (the detail kept around incidents lies on either
    /// side): the processes' states at its end replace those the walk built.
    Resume {
        hole: &'a Hole,
        states: Vec<ProcessState>,
    },
}

/// Hands `visit` the calls of `session` (of `pid`, or all) after `begin`'s keyframe that began
/// at or before `to_ns`, in time order, and the states to resume from at each hole.
pub fn walk(
    db: &Path,
    session: i64,
    begin: &Begin,
    to_ns: i64,
    pid: Option<u32>,
    mut visit: impl FnMut(Step<'_>),
) -> Result<Walked> {
    let conn = crate::store::events::open_reader(db)?;
    walk::walk(db, session, begin.start.after_block(), to_ns, pid, |step| {
        match step {
            walk::Step::Call(e) => visit(Step::Call(e)),
            walk::Step::Hole(hole) => {
                let states = match keyframes::at_block(&conn, session, hole.through_block)? {
                    Some(k) => keyframes::states(&conn, &k, pid)?,
                    None => Vec::new(),
                };
                visit(Step::Resume { hole, states });
            }
        }
        Ok(())
    })
}

/// Hands `visit` the calls only: for answers that keep no state across a hole (counts).
pub fn walk_calls(
    db: &Path,
    session: i64,
    begin: &Begin,
    to_ns: i64,
    pid: Option<u32>,
    mut visit: impl FnMut(&Event),
) -> Result<Walked> {
    walk::walk(db, session, begin.start.after_block(), to_ns, pid, |step| {
        if let walk::Step::Call(e) = step {
            visit(e);
        }
        Ok(())
    })
}
