//! The allocator's layout at a moment (`tracer layout`): each process's state from the nearest
//! keyframe before the moment, advanced call by call to it.

use std::path::Path;

use anyhow::Result;

use crate::{
    analysis::oom::MESSAGE_ROUNDING,
    exit::user_error,
    model::state::ProcessState,
    store::{events, Access, Store},
};

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
    /// What tracer did not see of the allocator, and whether the layout is exact again.
    pub unknown: crate::model::layout::Unknown,
    /// Blocks in segments tracer never saw created, and blocks carried over a gap not seen
    /// since: (blocks, bytes).
    pub orphans: (u64, u64),
    pub carried: (u64, u64),
    /// New segments made while a free block that fit was believed free (blocks handed out
    /// without PyTorch's probes hold memory shown free).
    pub held_unseen: u64,
    /// Whether PyTorch's allocator probes were armed then (`--allocator auto`).
    pub block_sight: crate::model::layout::BlockSight,
    /// Segments whose contents tracer did not see (made before the probes were armed, or
    /// while they were not): (segments, bytes). Not in the pools' figures: their free bytes
    /// and largest free block are unknown, never shown as free.
    pub unseen_contents: (u64, u64),
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<crate::model::layout::SegmentMap>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceLayout {
    pub device: i32,
    /// The physical GPU behind the device number ("GPU 3": model/process.rs `Placement`).
    pub gpu: String,
    pub total: crate::model::layout::PoolStats,
    pub pools: Vec<(crate::model::layout::Pool, crate::model::layout::PoolStats)>,
    /// Device memory allocated outside the allocator's segments.
    pub outside: u64,
    /// Blocks freed but kept for other streams' work (`record_stream`): (blocks, bytes).
    pub pending: (u64, u64),
    /// The private pools (CUDA graphs', MemPools') among the figures above, where tracer knows
    /// them: their free bytes serve only requests routed to them.
    pub private_pools: Vec<crate::model::pools::PrivatePool>,
    /// Who else held the same physical GPU then, and what the device said of itself.
    pub gpu_share: GpuShare,
}

/// The physical GPU at the moment, beside one process's view of it.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GpuShare {
    /// All this process held on the device through its traced calls (segments and outside).
    pub held: u64,
    /// The other processes laid out on the same GPU: pid, its device number, bytes held.
    pub others: Vec<(u32, i32, u64)>,
    /// Every process was laid out (no `--pid`): `others` and `unattributed` are whole.
    pub everyone_laid_out: bool,
    /// The device's capacity and free bytes when this process's cudaMemGetInfo last said,
    /// and when.
    pub device_total: Option<u64>,
    pub device_free: Option<u64>,
    pub said_at_ns: Option<i64>,
    /// In use then and held by no traced process: the CUDA contexts, processes that
    /// allocated before the trace, libraries not traced (traced processes' bytes taken at the
    /// layout's moment).
    pub unattributed: Option<u64>,
}

/// The session's processes' layouts at `q.at` (processes with device allocations only).
pub fn layout(db: &Path, q: &LayoutQuery) -> Result<(i64, Vec<ProcessLayout>)> {
    use crate::model::layout::{AllocConf, Layout};
    let store = Store::open(db, Access::ReadOnly)?;
    let conn = store.conn();
    let info = events::session(conn, q.session)?;
    let at_ns = instant(conn, info.id, q.at, q.pid)?;
    let comms = events::comms(conn, info.id)?;
    let confs = events::alloc_confs(conn, info.id)?;
    let begin = super::begin(conn, info.id, at_ns, q.pid)?;
    let mut states: std::collections::BTreeMap<u32, (ProcessState, i64)> = begin
        .states
        .iter()
        .map(|s| (s.pid, (s.clone(), s.last_ns)))
        .collect();
    super::walk(conn, info.id, &begin, at_ns, q.pid, |step| {
        let e = match step {
            super::Step::Call(e) => e,
            super::Step::Resume { states: after, .. } => {
                for s in after {
                    let last = s.last_ns;
                    states.insert(s.pid, (s, last));
                }
                return;
            }
        };
        let (s, last) = states.entry(e.pid).or_insert_with(|| {
            let conf = confs
                .get(&e.pid)
                .map_or_else(AllocConf::default, |c| AllocConf::parse(c));
            (
                ProcessState {
                    pid: e.pid,
                    layout: Layout::new(conf),
                    ..Default::default()
                },
                e.ts_ns,
            )
        });
        s.layout.apply(e);
        *last = e.ts_ns;
    })?;
    let placements = events::placements(conn, info.id)?;
    // At an instant every process is shown as it was then, not at its own last call.
    let moment = |last: i64| if at_ns == i64::MAX { last } else { at_ns };
    let mut out: Vec<ProcessLayout> = states
        .iter()
        .map(|(&pid, (s, last))| (pid, &s.layout, *last))
        .filter(|(_, l, _)| shown(l))
        .map(|(pid, l, last)| {
            process_layout(pid, comms.get(&pid).cloned(), l, moment(last), q.device)
        })
        .collect();
    label_captures(conn, info.id, &mut out)?;
    let readings = Readings::read(conn, info.id)?;
    let held: Vec<(u32, i32, u64)> = states
        .iter()
        .flat_map(|(&pid, (s, _))| held_per_device(pid, &s.layout))
        .collect();
    let oom = if q.at == At::Oom {
        Some(OomAt {
            pid: q.pid,
            message: oom_message(conn, info.id, q.pid)?,
        })
    } else {
        None
    };
    share_at(
        &mut out,
        held,
        &placements,
        &readings,
        at_ns,
        oom.as_ref(),
        q.pid.is_none() && q.device.is_none(),
    );
    Ok((info.id, out))
}

/// Where each private pool's first capture was made, where `--stack` recorded it (its call,
/// found by process and time: the live recording's keyframes carry no call-site ids).
fn label_captures(
    conn: &rusqlite::Connection,
    session: i64,
    out: &mut [ProcessLayout],
) -> Result<()> {
    let mut labels = None;
    for p in out.iter_mut() {
        for pool in p.devices.iter_mut().flat_map(|d| &mut d.private_pools) {
            let Some(first_ns) = pool.captures.map(|c| c.first_ns) else {
                continue;
            };
            let Some(stack) = events::capture_site(conn, session, p.pid, first_ns)? else {
                continue;
            };
            if labels.is_none() {
                labels = Some(events::site_labels(conn, session, &[])?);
            }
            pool.captured_at = labels.as_ref().and_then(|l| l.get(&stack).cloned());
        }
    }
    Ok(())
}

/// A process laid out: it held device memory or PyTorch's probes showed its blocks.
pub(crate) fn shown(l: &crate::model::layout::Layout) -> bool {
    !l.stats().is_empty() || !l.segments().is_empty() || l.blocks_seen > 0
}

/// Bytes a process held on one of its devices: (pid, device, bytes).
type Held = (u32, i32, u64);

/// An out-of-memory a layout is taken at: the process whose OOM it is (`--pid`, where given)
/// and PyTorch's message of it, where recorded.
pub(crate) struct OomAt {
    pub pid: Option<u32>,
    pub message: Option<crate::model::MessageRow>,
}

/// PyTorch's first out-of-memory message of `pid` (or of any process).
pub(crate) fn oom_message(
    conn: &rusqlite::Connection,
    session: i64,
    pid: Option<u32>,
) -> Result<Option<crate::model::MessageRow>> {
    Ok(events::messages(conn, session)?
        .into_iter()
        .find(|m| m.op == tracer_common::Op::TorchOom.name() && pid.is_none_or(|p| p == m.pid)))
}

/// Sets each layout's GPU share at `at_ns` (`share_gpus`). At an out-of-memory, one account
/// for `layout --at oom` and the report's map at it: the process that ran out first, what
/// PyTorch's message says processes had beyond their traced calls (their CUDA contexts)
/// counted beside them as explain counts it, and the device as that process last read it for
/// every process on its GPU.
pub(crate) fn share_at(
    out: &mut [ProcessLayout],
    mut held: Vec<Held>,
    placements: &std::collections::HashMap<u32, crate::model::Placement>,
    readings: &Readings,
    at_ns: i64,
    oom: Option<&OomAt>,
    everyone: bool,
) {
    let mut ran_out: Option<(u32, i32)> = None;
    if let Some(oom) = oom {
        let (who, named) = oom_named(oom, &held);
        out.sort_by_key(|p| Some(p.pid) != who);
        ran_out = who.map(|w| (w, named.first().map_or(0, |n| n.1)));
        for (pid, device, bytes) in named {
            match held.iter_mut().find(|h| h.0 == pid && h.1 == device) {
                Some(h) => h.2 += bytes,
                None => held.push((pid, device, bytes)),
            }
        }
    }
    let place =
        |pid: u32, device: i32| crate::model::Placement::of(placements, pid).gpu(device).key;
    share_gpus(
        out,
        &held,
        placements,
        |pid, device| match ran_out {
            Some((w, wd)) if place(pid, device) == place(w, wd) => readings
                .last(w, wd, at_ns)
                .or_else(|| readings.last(pid, device, at_ns)),
            _ => readings.last(pid, device, at_ns),
        },
        everyone,
    );
}

/// The process whose OOM `oom` names, and what its message says processes had on its device
/// beyond their traced bytes (`held`): (pid, device, bytes) to add to them.
fn oom_named(oom: &OomAt, held: &[(u32, i32, u64)]) -> (Option<u32>, Vec<Held>) {
    let Some(m) = &oom.message else {
        return (oom.pid, Vec::new());
    };
    let device = held.iter().find(|h| h.0 == m.pid).map_or(0, |h| h.1);
    let traced = |q: u32| -> u64 { held.iter().filter(|h| h.0 == q).map(|h| h.2).sum() };
    use crate::analysis::oom::{processes_named, this_process_said};
    let said = this_process_said(&m.text)
        .map(|b| (m.pid, b))
        .into_iter()
        .chain(processes_named(&m.text));
    let extra = said
        .map(|(q, b)| (q, device, b.saturating_sub(traced(q))))
        .filter(|&(_, _, b)| b > MESSAGE_ROUNDING)
        .collect();
    (Some(m.pid), extra)
}

/// What a process holds on each device through its traced calls (segments and outside):
/// (pid, device, bytes), for [`share_gpus`].
pub(crate) fn held_per_device(
    pid: u32,
    l: &crate::model::layout::Layout,
) -> impl Iterator<Item = (u32, i32, u64)> + '_ {
    let mut devices: Vec<i32> = l.stats().keys().map(|(d, _)| *d).collect();
    devices.extend(l.outside_devices());
    devices.sort_unstable();
    devices.dedup();
    devices
        .into_iter()
        .map(move |d| (pid, d, l.device_total(d).reserved + l.outside(d)))
}

/// Every successful cudaMemGetInfo of a session (few: PyTorch asks at an out-of-memory and when
/// the program asks), to say what one said last before a moment.
#[derive(Default)]
pub(crate) struct Readings(Vec<crate::model::Event>);

impl Readings {
    pub(crate) fn read(conn: &rusqlite::Connection, session: i64) -> Result<Readings> {
        let mut calls =
            events::calls_of_classes(conn, session, &[tracer_common::OpClass::MemInfo], None)?;
        calls.retain(|e| e.ret == 0 && e.aux1 > 0);
        Ok(Readings(calls))
    }

    /// What `pid`'s last cudaMemGetInfo of `device` at or before `at_ns` said, as it said it:
    /// (when, capacity, free). A call stored without a device stands for any.
    pub(crate) fn last(&self, pid: u32, device: i32, at_ns: i64) -> Option<(i64, u64, u64)> {
        self.0
            .iter()
            .rev()
            .find(|e| e.ts_ns <= at_ns && e.pid == pid && (e.device == device || e.device < 0))
            .map(|e| (e.ts_ns, e.aux1, e.aux0.min(e.aux1)))
    }
}

/// Names each device's physical GPU and sets beside it the other laid-out processes on that
/// GPU and what no traced process held then (`everyone`: every process was laid out, so those
/// are whole; the traced bytes are those at the layout's moment). `said`: what a process's
/// cudaMemGetInfo last said of a device.
pub(crate) fn share_gpus(
    layouts: &mut [ProcessLayout],
    held: &[(u32, i32, u64)],
    placements: &std::collections::HashMap<u32, crate::model::Placement>,
    said: impl Fn(u32, i32) -> Option<(i64, u64, u64)>,
    everyone: bool,
) {
    let placement = |pid: u32| crate::model::Placement::of(placements, pid);
    // Every process's bytes on each physical GPU, by GPU key: (pid, device, held).
    let mut on_gpu: std::collections::HashMap<String, Vec<(u32, i32, u64)>> =
        std::collections::HashMap::new();
    for &(pid, device, bytes) in held {
        on_gpu
            .entry(placement(pid).gpu(device).key)
            .or_default()
            .push((pid, device, bytes));
    }
    for p in layouts.iter_mut() {
        let place = placement(p.pid);
        for d in &mut p.devices {
            let gpu = place.gpu(d.device);
            let there = on_gpu.get(&gpu.key).map(Vec::as_slice).unwrap_or_default();
            let reading = said(p.pid, d.device);
            let traced: u64 = there.iter().map(|(_, _, b)| b).sum();
            d.gpu = gpu.label;
            d.gpu_share = GpuShare {
                held: d.total.reserved + d.outside,
                others: there
                    .iter()
                    .filter(|(q, _, b)| *q != p.pid && *b > 0)
                    .copied()
                    .collect(),
                everyone_laid_out: everyone,
                device_total: reading.map(|r| r.1),
                device_free: reading.map(|r| r.2),
                said_at_ns: reading.map(|r| r.0),
                unattributed: reading
                    .filter(|_| everyone)
                    .map(|r| r.1.saturating_sub(r.2).saturating_sub(traced))
                    .filter(|&b| b > MESSAGE_ROUNDING),
            };
        }
    }
}

pub(crate) fn process_layout(
    pid: u32,
    comm: Option<String>,
    l: &crate::model::layout::Layout,
    at_ns: i64,
    device: Option<i32>,
) -> ProcessLayout {
    // A process whose segments all predate the trace still names its devices by its blocks.
    let mut devices: Vec<i32> = l.stats().keys().map(|(d, _)| *d).collect();
    devices.extend(l.orphan_devices());
    devices.sort_unstable();
    devices.dedup();
    devices.retain(|d| device.is_none_or(|want| want == *d));
    let private = l.private_pools();
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
                gpu: format!("GPU {d}"),
                total: l.device_total(d),
                pools: l.default_pools(d),
                outside: l.outside(d),
                pending: l.pending(Some(d)),
                private_pools: private.iter().filter(|p| p.device == d).cloned().collect(),
                gpu_share: GpuShare::default(),
            })
            .collect(),
        unexplained: l.unexplained,
        unknown: l.unknown,
        orphans: l.orphans(device),
        carried: l.carried(),
        held_unseen: l.held_unseen(),
        block_sight: l.block_sight(),
        unseen_contents: l.unseen_contents(device),
        segments: l
            .segments()
            .into_iter()
            .filter(|s| device.is_none_or(|d| d == s.device))
            .collect(),
    }
}

/// The instant `at` names in `session` (of `pid`'s OOM, or any process's), in wall ns.
pub(crate) fn instant(
    conn: &rusqlite::Connection,
    session: i64,
    at: At,
    pid: Option<u32>,
) -> Result<i64> {
    Ok(match at {
        At::End => i64::MAX,
        At::Time(t) => t,
        At::Oom => oom_time(conn, session, pid)?.ok_or_else(|| {
            user_error(format!(
                "session {session} recorded no out-of-memory: no failed allocation and no PyTorch OOM"
            ))
        })?,
    })
}

/// When PyTorch raised out-of-memory first (of one process, or any): its message, else the
/// failed attempt no retry followed (model/attempts.rs: a failure its allocator recovered
/// from by releasing its cache is not the OOM). The same instant explain's OOM chain shows.
pub(crate) fn oom_time(
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
    // Device allocations are CUDA calls: they have rows (the block events do not fail), and
    // --max-db keeps those around a failure.
    use crate::model::attempts;
    let calls = events::calls_of_classes(conn, session, &[tracer_common::OpClass::Alloc], pid)?;
    Ok(attempts::oom_instant(
        &attempts::attempts(calls.iter()),
        None,
    ))
}

/// The figures after one of PyTorch's block events.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayoutPoint {
    pub ts_ns: i64,
    pub pid: u32,
    pub op: &'static str,
    pub ptr: u64,
    pub total: crate::model::layout::PoolStats,
    /// The default pools (private pools' segments left out).
    pub pools: std::collections::BTreeMap<String, crate::model::layout::PoolStats>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub private_pools: Vec<crate::model::pools::PrivatePool>,
}

/// The layout's figures after every block event of the session (one process, or all), from
/// its first stored call (or the keyframe the calls --max-db left begin at). A free's figures
/// include the stream events the allocator recorded for it (`record_stream`: the block is then
/// kept, not free); a block returned to its pool when its last event completed has a point of
/// its own (op `free_completed`).
pub fn layout_timeline(
    db: &Path,
    session: Option<i64>,
    pid: Option<u32>,
    mut point: impl FnMut(LayoutPoint) -> Result<()>,
) -> Result<()> {
    use crate::model::layout::{AllocConf, Layout};
    use tracer_common::OpClass;
    let store = Store::open(db, Access::ReadOnly)?;
    let conn = store.conn();
    let info = events::session(conn, session)?;
    let confs = events::alloc_confs(conn, info.id)?;
    let begin = super::begin(conn, info.id, i64::MIN, pid)?;
    let mut layouts: std::collections::HashMap<u32, Layout> = begin
        .states
        .iter()
        .map(|s| (s.pid, s.layout.clone()))
        .collect();
    // Per process, the free whose point waits for the event records that may follow it.
    let mut held: std::collections::HashMap<u32, (i64, &'static str, u64)> = Default::default();
    let mut result = Ok(());
    super::walk(conn, info.id, &begin, i64::MAX, pid, |step| {
        let e = match step {
            super::Step::Call(e) => e,
            super::Step::Resume { states, .. } => {
                layouts.extend(states.into_iter().map(|s| (s.pid, s.layout)));
                return;
            }
        };
        if result.is_err() {
            return;
        }
        let l = layouts.entry(e.pid).or_insert_with(|| {
            Layout::new(
                confs
                    .get(&e.pid)
                    .map_or_else(AllocConf::default, |c| AllocConf::parse(c)),
            )
        });
        let class = e.class();
        if class != OpClass::EventRecord {
            if let Some((ts, op, ptr)) = held.remove(&e.pid) {
                result = point(point_of(l, e.pid, ts, op, ptr));
            }
        }
        let pending = l.pending(None).0;
        l.apply(e);
        if result.is_err() {
            return;
        }
        result = match class {
            OpClass::BlockAlloc => point(point_of(l, e.pid, e.ts_ns, e.op.name(), e.ptr)),
            OpClass::BlockFree => {
                held.insert(e.pid, (e.ts_ns, e.op.name(), e.ptr));
                Ok(())
            }
            OpClass::EventWait if l.pending(None).0 < pending => {
                point(point_of(l, e.pid, e.ts_ns, "free_completed", e.ptr))
            }
            _ => Ok(()),
        };
    })?;
    result?;
    let mut rest: Vec<_> = held.into_iter().collect();
    rest.sort_by_key(|(_, (ts, _, _))| *ts);
    for (pid, (ts, op, ptr)) in rest {
        if let Some(l) = layouts.get(&pid) {
            point(point_of(l, pid, ts, op, ptr))?;
        }
    }
    Ok(())
}

/// The layout's figures in total and per pool, as one point of the timeline.
fn point_of(
    l: &crate::model::layout::Layout,
    pid: u32,
    ts_ns: i64,
    op: &'static str,
    ptr: u64,
) -> LayoutPoint {
    use crate::model::layout::{Pool, PoolStats};
    let mut pools = std::collections::BTreeMap::new();
    let mut devices: Vec<i32> = l.stats().keys().map(|(d, _)| *d).collect();
    devices.dedup();
    let default_pools = devices.into_iter().flat_map(|d| l.default_pools(d));
    for (pool, s) in default_pools {
        let name = if pool == Pool::Small {
            "small"
        } else {
            "large"
        };
        let p: &mut PoolStats = pools.entry(name.to_owned()).or_default();
        p.allocated += s.allocated;
        p.reserved += s.reserved;
        p.free_blocks += s.free_blocks;
        p.largest_free = p.largest_free.max(s.largest_free);
    }
    LayoutPoint {
        ts_ns,
        pid,
        op,
        ptr,
        total: l.total(),
        pools,
        private_pools: l.private_pools(),
    }
}
