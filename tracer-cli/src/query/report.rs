//! Reading a session into the HTML report's data (`tracer report`): the same report `explain
//! --json` gives, the session's loss counters, each process and device's figures over time
//! (downsampled, see model/series.rs), the moments worth marking, and the allocator's segment
//! map at the OOM, at the end and at evenly spaced times between.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use anyhow::Result;
use serde::Serialize;
use tracer_common::{Op, OpClass};

use crate::{
    analysis::Explanation,
    model::{
        figures::Figures,
        layout::AllocConf,
        live::LiveAllocators,
        run_series::Hole,
        series::{Line, Sample, Timeline},
        state::ProcessState,
        Event, MessageRow,
    },
    query::{
        explain::{self, ExplainQuery},
        layout::{self as layouts, ProcessLayout},
    },
    store::{
        events::{self, SessionSummary},
        Access, Store,
    },
};

/// Evenly spaced segment maps between the window's ends (besides the OOM and the end).
const SPACED_SNAPSHOTS: usize = 24;
/// Block runs in all the maps together, at most: the page stays light whatever the session.
const MAX_RUNS: usize = 120_000;
/// How long after the window's last call an OOM still counts in it.
const OOM_AFTER_END_NS: i64 = 1_000_000_000;
/// Marked moments, at most (the rest are counted).
const MAX_MARKERS: usize = 2_000;

/// A moment worth marking on the charts.
#[derive(Clone, Debug, Serialize)]
pub struct Marker {
    pub ts_ns: i64,
    pub pid: u32,
    pub device: i32,
    /// "oom", "failed", "retry" or "warning".
    pub kind: &'static str,
    pub text: String,
}

/// The segment maps of every process at one moment.
#[derive(Clone, Debug, Serialize)]
pub struct SegmentMaps {
    pub at_ns: i64,
    /// "oom", "end" or "time".
    pub label: &'static str,
    pub processes: Vec<ProcessLayout>,
    /// Segments left out to keep the page light (the largest are kept first; one that does
    /// not fit the budget left is left out).
    pub segments_omitted: u64,
}

/// Everything the page shows.
#[derive(Clone, Debug, Serialize)]
pub struct ReportData {
    pub tracer_version: &'static str,
    pub session: SessionSummary,
    /// Loss counters by their session column, and the events --max-db evicted.
    pub losses: Vec<(&'static str, u64)>,
    /// What the page covers: evictions (and the whole-run series in their place), the keyframe
    /// read from, what tracer did not see, when each layout was exact again.
    pub coverage: Vec<String>,
    /// Exactly what `tracer explain --json` prints for the same window.
    pub explain: Explanation,
    /// Ordered, so that the page is the same for the same session.
    pub comms: BTreeMap<u32, String>,
    /// The calls read to draw the charts (the whole session up to the window's end).
    pub calls_read: u64,
    /// Each chart point covers this many ns.
    pub bucket_ns: i64,
    pub lines: Vec<Line>,
    pub markers: Vec<Marker>,
    pub markers_omitted: u64,
    pub snapshots: Vec<SegmentMaps>,
    /// Call sites of the blocks in the maps, by stack id.
    pub sites: BTreeMap<u32, String>,
    /// The recorded requests under other allocator settings (`tracer whatif`), for runs of at
    /// most [`WHATIF_EVENTS`] events in the window.
    pub whatif: Option<super::whatif::WhatIf>,
}

/// The report replays the requests under the default settings (with the least-memory search)
/// up to this many events in its window; `tracer whatif` takes any size.
const WHATIF_EVENTS: u64 = 100_000;

/// Reads and analyses the session in one walk; `q` as for explain.
pub fn report_data(db: &Path, q: &ExplainQuery) -> Result<ReportData> {
    let store = Store::open(db, Access::ReadOnly)?;
    let conn = store.conn();
    // The window and the moments to map are known before the walk.
    let windowed = explain::window(conn, q)?;
    let (window, session_id) = (windowed.window, windowed.session);
    let comms = events::comms(conn, session_id)?;
    let confs: HashMap<u32, AllocConf> = events::alloc_confs(conn, session_id)?
        .into_iter()
        .map(|(p, c)| (p, AllocConf::parse(&c)))
        .collect();
    let messages = events::messages(conn, session_id)?;
    // PyTorch raises its OOM just after the last call of a session that ended with it: such
    // an OOM still belongs to the window.
    let oom = layouts::oom_time(conn, session_id, q.pid)?
        .filter(|t| (window.from_ns..=window.to_ns.saturating_add(OOM_AFTER_END_NS)).contains(t))
        .map(|t| t.min(window.to_ns));
    let mut times: Vec<(i64, &'static str)> = (0..SPACED_SNAPSHOTS)
        .map(|i| {
            let span = (window.to_ns - window.from_ns) as i128;
            let at =
                window.from_ns as i128 + span * (i as i128 + 1) / (SPACED_SNAPSHOTS as i128 + 1);
            (at as i64, "time")
        })
        .collect();
    times.extend(oom.map(|t| (t, "oom")));
    times.push((window.to_ns, "end"));
    times.sort_by_key(|&(t, label)| (t, label != "oom"));

    let mut pass = Pass::new(&confs, &comms, window.from_ns, window.to_ns);
    pass.placements = events::placements(conn, session_id)?;
    pass.readings = layouts::Readings::read(conn, session_id)?;
    pass.oom = layouts::OomAt {
        pid: q.pid,
        message: layouts::oom_message(conn, session_id, q.pid)?,
    };
    let mut walk = ReportWalk {
        pass,
        times: &times,
        next: 0,
        calls: 0,
    };
    let explained = explain::explain_beside(db, q, &mut walk)?;
    let calls_read = walk.calls;
    let mut pass = walk.pass;
    for &(at, label) in &times[walk.next..] {
        pass.snapshot(at, label);
    }
    for m in &messages {
        if q.pid.is_none_or(|p| p == m.pid) {
            pass.message(m);
        }
    }
    let report = explained.report;
    pass.markers.sort_by_key(|m| m.ts_ns);
    let snapshots = bound_runs(pass.snapshots);
    let site_labels = events::site_labels(conn, session_id, &q.skip_frames)?;
    let sites = snapshots
        .iter()
        .flat_map(|s| &s.processes)
        .flat_map(|p| &p.segments)
        .flat_map(|s| &s.runs)
        .filter_map(|r| r.stack)
        .filter_map(|id| {
            Some((
                id,
                site_labels.get(&std::num::NonZeroU32::new(id)?)?.clone(),
            ))
        })
        .collect();
    let session = events::session_summary(conn, session_id)?;
    let mut losses = session.counters.losses().to_vec();
    losses.push(("evicted_events", session.evicted_events));
    let coverage = report.coverage.lines(report.window);
    let whatif = (report.events_in_window <= WHATIF_EVENTS)
        .then(|| {
            let q = super::whatif::WhatIfQuery {
                session: Some(session_id),
                pid: q.pid,
                search: true,
                ..Default::default()
            };
            super::whatif::whatif(db, &q).ok()
        })
        .flatten();
    Ok(ReportData {
        tracer_version: env!("CARGO_PKG_VERSION"),
        losses,
        coverage,
        explain: report,
        comms: comms.iter().map(|(&k, v)| (k, v.clone())).collect(),
        calls_read,
        bucket_ns: pass.timeline.bucket_ns(),
        lines: pass.timeline.lines(),
        markers: pass.markers,
        markers_omitted: pass.markers_omitted,
        snapshots,
        sites,
        session,
        whatif,
    })
}

/// The report's share of explain's walk: the pass, and the moments to map as it goes by them.
struct ReportWalk<'a, 't> {
    pass: Pass<'a>,
    times: &'t [(i64, &'static str)],
    next: usize,
    calls: u64,
}

impl explain::Visit for ReportWalk<'_, '_> {
    fn start(&mut self, begin: &super::Begin) {
        self.pass.start_from(begin);
    }

    fn resume(&mut self, _hole: &Hole, states: &[ProcessState]) {
        for s in states {
            self.pass.allocators.restore(s.clone());
        }
    }

    fn call(&mut self, e: &Event) {
        self.calls += 1;
        while let Some(&(at, label)) = self.times.get(self.next) {
            if e.ts_ns <= at {
                break;
            }
            self.pass.snapshot(at, label);
            self.next += 1;
        }
        self.pass.call(e);
    }
}

/// One walk over the calls in time order.
struct Pass<'a> {
    comms: &'a HashMap<u32, String>,
    /// Each process's job and physical GPUs, and the session's cudaMemGetInfo calls, for the
    /// layouts' GPU shares.
    placements: HashMap<u32, crate::model::Placement>,
    readings: layouts::Readings,
    /// The OOM the window shows, for its map.
    oom: layouts::OomAt,
    from_ns: i64,
    to_ns: i64,
    allocators: LiveAllocators,
    figures: Figures,
    timeline: Timeline,
    markers: Vec<Marker>,
    markers_omitted: u64,
    snapshots: Vec<SegmentMaps>,
}

impl<'a> Pass<'a> {
    fn new(
        confs: &HashMap<u32, AllocConf>,
        comms: &'a HashMap<u32, String>,
        from_ns: i64,
        to_ns: i64,
    ) -> Self {
        let mut allocators = LiveAllocators::default();
        for (&pid, &conf) in confs {
            allocators.describe(pid, Some(conf), None);
        }
        Pass {
            comms,
            placements: HashMap::new(),
            readings: layouts::Readings::default(),
            oom: layouts::OomAt {
                pid: None,
                message: None,
            },
            from_ns,
            to_ns,
            allocators,
            figures: Figures::default(),
            timeline: Timeline::default(),
            markers: Vec::new(),
            markers_omitted: 0,
            snapshots: Vec::new(),
        }
    }

    /// The processes' states where the walk begins (a keyframe's).
    fn start_from(&mut self, begin: &super::Begin) {
        for s in &begin.states {
            self.allocators.restore(s.clone());
        }
    }

    fn mark(
        &mut self,
        ts_ns: i64,
        pid: u32,
        device: i32,
        kind: &'static str,
        text: impl FnOnce() -> String,
    ) {
        let until = match kind {
            "oom" => self.to_ns.saturating_add(OOM_AFTER_END_NS),
            _ => self.to_ns,
        };
        if !(self.from_ns..=until).contains(&ts_ns) {
            return;
        }
        // The OOMs are few and the point of the page: the cap never drops one.
        if self.markers.len() < MAX_MARKERS
            || (kind == "oom" && self.markers.len() < 2 * MAX_MARKERS)
        {
            self.markers.push(Marker {
                ts_ns,
                pid,
                device,
                kind,
                text: text(),
            });
        } else {
            self.markers_omitted += 1;
        }
    }

    fn call(&mut self, e: &Event) {
        let device = e.device.max(-1);
        let failures = |f: &Figures| {
            f.get(e.pid)
                .and_then(|p| p.devices.get(&device))
                .map_or((0, 0), |d| (d.alloc_failures, d.retries))
        };
        let before = failures(&self.figures);
        self.figures.apply(e);
        let after = failures(&self.figures);
        let end = e.ts_ns.saturating_add(e.duration_ns as i64);
        let what = |how: &str| format!("{} of {} bytes {how}", e.op.name(), e.size);
        if after.0 > before.0 {
            self.mark(end, e.pid, device, "failed", || what("failed"));
        }
        if after.1 > before.1 {
            self.mark(end, e.pid, device, "retry", || what("retried"));
        }
        if let Some(alarm) = self.allocators.apply(e) {
            self.mark(
                end,
                e.pid,
                alarm.device,
                "warning",
                || {
                    format!(
                        "early warning: a request of {} bytes lately, largest free block {} bytes, device free {} bytes",
                        alarm.request, alarm.stats.largest_free, alarm.device_free
                    )
                },
            );
        }
        if e.ts_ns < self.from_ns {
            return;
        }
        self.sample(e, device);
    }

    fn sample(&mut self, e: &Event, device: i32) {
        let class = e.class();
        if !crate::model::moves_memory(class) {
            return;
        }
        let Some(row) = self.allocators.row(e.pid, device) else {
            return;
        };
        let blocks = row.view == "blocks";
        let request =
            (class == OpClass::BlockAlloc || (class == OpClass::Alloc && !blocks)) && e.size > 0;
        self.timeline.add(
            e.ts_ns,
            e.pid,
            device,
            Sample {
                allocated: blocks.then_some(row.stats.allocated),
                reserved: Some(row.stats.reserved),
                outside: blocks.then_some(row.outside),
                largest_free: blocks.then_some(row.stats.largest_free),
                fragmentation: blocks.then_some(row.fragmentation),
                device_free: self
                    .allocators
                    .device_free(e.pid, device)
                    .map(|f| f.max(0) as u64),
                request: request.then_some(e.size),
                latency_ns: (class == OpClass::Alloc && e.duration_ns > 0).then_some(e.duration_ns),
            },
        );
    }

    fn message(&mut self, m: &MessageRow) {
        if m.op == Op::TorchOom.name() {
            let device = oom_device(&m.text).unwrap_or(-1);
            self.mark(m.ts_ns, m.pid, device, "oom", || m.text.clone());
        }
    }

    fn snapshot(&mut self, at_ns: i64, label: &'static str) {
        let mut pids: Vec<u32> = self
            .figures
            .processes()
            .map(|p| p.pid)
            .filter(|&pid| self.allocators.layout(pid).is_some_and(layouts::shown))
            .collect();
        pids.sort_unstable();
        let mut processes: Vec<layouts::ProcessLayout> = pids
            .into_iter()
            .filter_map(|pid| {
                let layout = self.allocators.layout(pid)?;
                Some(layouts::process_layout(
                    pid,
                    self.comms.get(&pid).cloned(),
                    layout,
                    at_ns,
                    None,
                ))
            })
            .collect();
        let held: Vec<(u32, i32, u64)> = self
            .figures
            .processes()
            .filter_map(|p| Some((p.pid, self.allocators.layout(p.pid)?)))
            .flat_map(|(pid, l)| layouts::held_per_device(pid, l))
            .collect();
        // The map at the OOM is `layout --at oom`'s: one account of who held the GPU.
        let oom = (label == "oom").then_some(&self.oom);
        layouts::share_at(
            &mut processes,
            held,
            &self.placements,
            &self.readings,
            at_ns,
            oom,
            true,
        );
        self.snapshots.push(SegmentMaps {
            at_ns,
            label,
            processes,
            segments_omitted: 0,
        });
    }
}

/// The device of PyTorch's message: "... GPU 0 has a total capacity ...".
fn oom_device(text: &str) -> Option<i32> {
    let rest = &text[text.find("GPU ")? + 4..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Keeps each snapshot's largest segments within its share of [`MAX_RUNS`].
fn bound_runs(mut snapshots: Vec<SegmentMaps>) -> Vec<SegmentMaps> {
    let share = MAX_RUNS / snapshots.len().max(1);
    for s in &mut snapshots {
        let mut all: Vec<(usize, usize, u64, usize)> = Vec::new();
        for (pi, p) in s.processes.iter().enumerate() {
            for (si, seg) in p.segments.iter().enumerate() {
                all.push((pi, si, seg.size, seg.runs.len()));
            }
        }
        if all.iter().map(|a| a.3).sum::<usize>() <= share {
            continue;
        }
        all.sort_by_key(|a| std::cmp::Reverse(a.2));
        let mut budget = share;
        let mut keep = std::collections::HashSet::new();
        for (pi, si, _, runs) in all {
            if runs <= budget {
                budget -= runs;
                keep.insert((pi, si));
            } else {
                s.segments_omitted += 1;
            }
        }
        for (pi, p) in s.processes.iter_mut().enumerate() {
            let mut si = 0;
            p.segments.retain(|_| {
                let kept = keep.contains(&(pi, si));
                si += 1;
                kept
            });
        }
    }
    snapshots
}
