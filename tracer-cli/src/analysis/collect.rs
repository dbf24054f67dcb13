//! What explain gathers in one time-ordered pass over a session's calls: the CUDA calls, kept
//! (the rules read them, and they are few beside the rest), and per process the allocator's
//! replay and a tally of its block events in the window, not kept: PyTorch's block events are
//! the volume (tens of thousands a second), so memory is the live state and the CUDA calls,
//! never the block events.

use std::collections::{BTreeMap, HashMap, HashSet};

use tracer_common::{Op, OpClass};

use super::{allocator, Inputs};
use crate::model::{
    layout::AllocConf, run_series::Hole, state::ProcessState, Event, SiteLabels, StackId, Window,
    NO_DEVICE,
};

/// One op's calls (in the window): their count, errors, bytes and durations (zeros counted,
/// not kept: PyTorch's probes take no time).
#[derive(Clone, Debug, Default)]
pub struct OpTally {
    pub calls: u64,
    pub errors: u64,
    pub bytes: u64,
    pub zero_durations: u64,
    pub durations: Vec<u64>,
}

impl OpTally {
    fn add(&mut self, e: &Event) {
        self.calls += 1;
        if e.ret != 0 {
            self.errors += 1;
        } else {
            self.bytes += e.size;
        }
        if e.duration_ns == 0 {
            self.zero_durations += 1;
        } else {
            self.durations.push(e.duration_ns);
        }
    }
}

/// A process's block events in the window, per op and per call site.
#[derive(Clone, Debug, Default)]
pub struct BlockTally {
    pub in_window: u64,
    pub ops: BTreeMap<Op, OpTally>,
    pub sites: BTreeMap<(Op, StackId), OpTally>,
}

/// What the pass gathered.
pub struct Collected {
    /// The CUDA calls (all but the block events) from the start to the window's end, in time
    /// order; a keyframe's live allocations come first, as the calls that made them.
    pub calls: Vec<Event>,
    pub processes: BTreeMap<u32, (allocator::Findings, BlockTally)>,
}

pub struct Collector<'a> {
    window: Window,
    confs: &'a HashMap<u32, AllocConf>,
    budgets: &'a HashMap<u32, super::startup::Budget>,
    sites: &'a SiteLabels,
    calls: Vec<Event>,
    processes: BTreeMap<u32, (allocator::LayoutMeasure<'a>, BlockTally)>,
    starts: HashMap<u32, ProcessState>,
}

/// Whether an event is one of the allocator's block events.
pub fn is_block_event(e: &Event) -> bool {
    matches!(e.class(), OpClass::BlockAlloc | OpClass::BlockFree)
}

impl<'a> Collector<'a> {
    /// A pass from the session's first call (no `starts`) or from a keyframe's states.
    pub fn new(window: Window, inputs: &Inputs<'a>, starts: Vec<ProcessState>) -> Collector<'a> {
        let mut calls = Vec::new();
        for s in &starts {
            calls.extend(live_allocations(s, i64::MIN));
        }
        calls.sort_by_key(|e| e.ts_ns);
        Collector {
            window,
            confs: inputs.confs,
            budgets: inputs.budgets,
            sites: inputs.sites,
            calls,
            processes: BTreeMap::new(),
            starts: starts.into_iter().map(|s| (s.pid, s)).collect(),
        }
    }

    /// Takes in the next call (in time order).
    pub fn feed(&mut self, e: &Event) {
        let (window, sites) = (self.window, self.sites);
        let (replay, tally) = self.processes.entry(e.pid).or_insert_with(|| {
            let conf = self.confs.get(&e.pid).copied().unwrap_or_default();
            let start = self.starts.get(&e.pid);
            (
                allocator::LayoutMeasure::new(start, window, conf, sites)
                    .with_budget(self.budgets.get(&e.pid).cloned()),
                BlockTally::default(),
            )
        });
        replay.feed(e);
        if !is_block_event(e) {
            self.calls.push(*e);
            return;
        }
        if window.contains(e.ts_ns) {
            tally.in_window += 1;
            tally.ops.entry(e.op).or_default().add(e);
            if let Some(id) = e.stack {
                tally.sites.entry((e.op, id)).or_default().add(e);
            }
        }
    }

    /// Goes on after calls --max-db deleted (`hole`) from the processes' states after them: the
    /// allocator replays resume from them; allocations the calls kept show as freed unless
    /// still live there, and those made in the hole and still live join the calls.
    pub fn resume(&mut self, hole: &Hole, states: Vec<ProcessState>) {
        for s in states {
            if let Some((replay, _)) = self.processes.get_mut(&s.pid) {
                replay.resume(&s);
            }
            let live: HashSet<u64> = s.live.values().map(|a| a.ptr).collect();
            let freed_unseen: HashSet<usize> = open_allocations(&self.calls, s.pid)
                .into_iter()
                .filter(|&i| !live.contains(&self.calls[i].ptr))
                .collect();
            let mut i = 0;
            self.calls.retain(|_| {
                i += 1;
                !freed_unseen.contains(&(i - 1))
            });
            self.calls.extend(live_allocations(&s, hole.from_ns));
            self.starts.insert(s.pid, s);
        }
    }

    pub fn finish(self) -> Collected {
        let mut calls = self.calls;
        // Calls come in time order, the keyframe's allocations before them: a stable sort of
        // what is nearly sorted.
        calls.sort_by_key(|e| e.ts_ns);
        Collected {
            calls,
            processes: self
                .processes
                .into_iter()
                .map(|(pid, (replay, tally))| (pid, (replay.finish(), tally)))
                .collect(),
        }
    }
}

/// A state's live allocations made at or after `since_ns`, as the calls that made them.
fn live_allocations(s: &ProcessState, since_ns: i64) -> impl Iterator<Item = Event> + '_ {
    s.live
        .values()
        .filter(move |a| a.ts_ns >= since_ns)
        .filter_map(|a| {
            let op = a.op()?;
            (op.spec().class == OpClass::Alloc).then_some(Event {
                ts_ns: a.ts_ns,
                duration_ns: 0,
                size: a.size,
                ptr: a.ptr,
                aux0: 0,
                aux1: 0,
                pid: s.pid,
                tid: 0,
                ret: 0,
                device: a.device.unwrap_or(NO_DEVICE),
                stack: None,
                op,
            })
        })
}

/// Where `pid`'s allocations that no later call freed lie in `calls`.
fn open_allocations(calls: &[Event], pid: u32) -> Vec<usize> {
    let mut open: HashMap<u64, usize> = HashMap::new();
    for (i, c) in calls.iter().enumerate() {
        if c.pid != pid || c.ret != 0 {
            continue;
        }
        match c.class() {
            OpClass::Alloc => {
                open.insert(c.ptr, i);
            }
            OpClass::Free => {
                open.remove(&c.ptr);
            }
            _ => {}
        }
    }
    open.into_values().collect()
}
