//! The read side: every answer about a stored session (explain, layout, the HTML report, the
//! Perfetto export, the MCP tools) comes from one time-ordered walk over its calls that starts
//! at the nearest keyframe at or before the window (model/state.rs) and reads forward once.
//! Memory holds the processes' live state and what the answer keeps, never the session's calls:
//! after --max-db evicted the early calls, or for a window at hour 70, the walk starts from a
//! keyframe as exact as the first call. Presenters (present/) render what this returns; nothing
//! here renders.

pub mod diff;
pub mod explain;
pub mod job;
pub mod layout;
pub mod perfetto;
pub mod pytorch_snapshot;
pub mod report;
pub mod snapshot_check;
pub mod snapshot_ooms;
pub mod snapshot_tenants;
pub mod whatif;

use anyhow::Result;
use rusqlite::Connection;

use tracer_common::OpClass;

use crate::{
    model::{
        devices::{LookAhead, ThreadDevices},
        state::ProcessState,
        Event,
    },
    store::{
        events,
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
    // A keyframe a tracer stored before it learned devices (schema 10) holds segments on no
    // device; where every call before it is still stored, the walk from the first call
    // resolves each call's device instead, as it does after the keyframe.
    let unresolved = states.iter().any(|s| s.layout.has_unknown_device());
    if unresolved && !keyframes::evicted(conn, session)? {
        return Ok(Begin {
            start: Start::Beginning,
            states: Vec::new(),
        });
    }
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
/// at or before `to_ns`, in time order, and the states to resume from at each hole. Each
/// call's device is the one CUDA ran it on ([`Devices`]), also where the recording did not know
/// it.
pub fn walk(
    conn: &Connection,
    session: i64,
    begin: &Begin,
    to_ns: i64,
    pid: Option<u32>,
    mut visit: impl FnMut(Step<'_>),
) -> Result<Walked> {
    let mut devices = Devices::new(conn, session, &begin.states, pid)?;
    walk::walk(
        conn,
        session,
        begin.start.after_block(),
        to_ns,
        pid,
        |step| {
            match step {
                walk::Step::Call(e) => visit(Step::Call(&devices.resolve(e))),
                walk::Step::Hole(hole) => {
                    let states = match keyframes::at_block(conn, session, hole.through_block)? {
                        Some(k) => keyframes::states(conn, &k, pid)?,
                        None => Vec::new(),
                    };
                    devices.restore(&states);
                    visit(Step::Resume { hole, states });
                }
            }
            Ok(())
        },
    )
}

/// Hands `visit` the calls only: for answers that keep no state across a hole (counts).
pub fn walk_calls(
    conn: &Connection,
    session: i64,
    begin: &Begin,
    to_ns: i64,
    pid: Option<u32>,
    mut visit: impl FnMut(&Event),
) -> Result<Walked> {
    let mut devices = Devices::new(conn, session, &begin.states, pid)?;
    walk::walk(
        conn,
        session,
        begin.start.after_block(),
        to_ns,
        pid,
        |step| {
            if let walk::Step::Call(e) = step {
                visit(&devices.resolve(e));
            }
            Ok(())
        },
    )
}

/// The device of each call a walk hands on, as CUDA defines it (model/devices.rs): what the
/// recording stored, else its thread's: the keyframe's, the last cudaSetDevice or context
/// made current, device 0 in a process tracer saw start, or what its first `pytorch:malloc`
/// says (looked ahead for). A recording made before tracer knew the rule reads the same.
pub struct Devices {
    threads: ThreadDevices,
}

/// Stops a look ahead that has learned all it wanted.
#[derive(Debug)]
struct Enough;

impl std::fmt::Display for Enough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("look ahead done")
    }
}

impl std::error::Error for Enough {}

impl Devices {
    pub fn new(
        conn: &Connection,
        session: i64,
        states: &[ProcessState],
        pid: Option<u32>,
    ) -> Result<Devices> {
        let mut threads = ThreadDevices::default();
        let processes = events::processes_seen_from_start(conn, session)?;
        for &(p, whole) in &processes {
            if whole {
                threads.seen_whole(p);
            }
        }
        threads.learn_initial(events::learned_devices(conn, session)?);
        // A session recorded before tracer stored the devices it learned: look ahead for them,
        // in the processes not seen whole only (a thread that set no device in one seen whole
        // is on device 0); the scan for threads without a device reads every row.
        let unseen = processes
            .iter()
            .any(|&(p, whole)| !whole && pid.is_none_or(|only| only == p));
        let wanted: std::collections::HashSet<(u32, u32)> =
            if !unseen || events::devices_learned(conn, session)? {
                Default::default()
            } else {
                events::threads_without_device(conn, session, pid)?
                    .into_iter()
                    .filter(|&(p, _)| !threads.is_whole(p))
                    .collect()
            };
        if !wanted.is_empty() {
            let mut ahead = LookAhead::new(wanted);
            let looked = walk::walk(conn, session, 0, i64::MAX, pid, |step| match step {
                walk::Step::Call(e) if !ahead.take(e.pid, e.tid, e.op, e.ret, e.device) => {
                    Err(Enough.into())
                }
                _ => Ok(()),
            });
            if let Err(e) = looked {
                if e.downcast_ref::<Enough>().is_none() {
                    return Err(e);
                }
            }
            threads.learn_initial(ahead.found());
        }
        let mut d = Devices { threads };
        d.restore(states);
        Ok(d)
    }

    /// The threads' devices a keyframe held.
    pub fn restore(&mut self, states: &[ProcessState]) {
        for s in states {
            for &(tid, device) in &s.thread_devices {
                self.threads.restore(s.pid, tid, device);
            }
        }
    }

    /// The call with its device.
    pub fn resolve(&mut self, e: &Event) -> Event {
        let mut e = *e;
        let tells = matches!(
            e.class(),
            OpClass::SetDevice | OpClass::SetContext | OpClass::Context
        );
        if e.device < 0 || tells {
            e.device = self
                .threads
                .apply(e.pid, e.tid, e.op, e.ret, e.ptr, e.device())
                .unwrap_or(crate::model::NO_DEVICE);
        }
        e
    }
}
