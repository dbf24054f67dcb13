//! A session as a Perfetto trace (`tracer export --format perfetto`): Perfetto's protobuf
//! TracePacket stream, written packet by packet as the calls are read, so memory stays bounded
//! whatever the session's size. A slice per call on its thread's track (op, size, ptr, ret,
//! device, call site as arguments); counter tracks per process and device for allocated,
//! reserved, device memory held and the largest free block; instant events for OOMs, failed
//! allocations, retries and early warnings. Timestamps are tracer's (wall-clock ns, converted
//! from CLOCK_MONOTONIC at record time), declared as the REALTIME clock, which a clock snapshot
//! makes the trace's primary clock. Names (of events and arguments) are interned: each is
//! written once, in the packet that first uses it, and referred to by number after; pointers are
//! Perfetto's pointer values. A block event takes about half the bytes it would spelled out.

use std::{collections::HashMap, io::Write};

use anyhow::{Context as _, Result};
use prost::Message as _;
use tracer_common::OpClass;

use crate::model::{Event, FastMap, MessageRow, SiteLabels};
use crate::query::perfetto::{Consequences, COUNTERS};

/// Perfetto's builtin clock ids.
const CLOCK_REALTIME: u32 = 1;
const CLOCK_BOOTTIME: u32 = 6;
/// TrackEvent.Type.
const SLICE_BEGIN: i32 = 1;
const SLICE_END: i32 = 2;
const INSTANT: i32 = 3;
const COUNTER: i32 = 4;
/// CounterDescriptor.Unit.UNIT_SIZE_BYTES.
const UNIT_SIZE_BYTES: i32 = 3;
/// TracePacket.SequenceFlags.SEQ_INCREMENTAL_STATE_CLEARED: the interned names and the packet
/// defaults start here.
const SEQ_INCREMENTAL_STATE_CLEARED: u32 = 1;
/// Every packet comes from this one writer.
const SEQUENCE: u32 = 1;

#[derive(Clone, PartialEq, prost::Message)]
struct TracePacket {
    #[prost(message, optional, tag = "6")]
    clock_snapshot: Option<ClockSnapshot>,
    #[prost(uint64, optional, tag = "8")]
    timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "10")]
    trusted_packet_sequence_id: Option<u32>,
    #[prost(message, optional, tag = "11")]
    track_event: Option<TrackEvent>,
    #[prost(message, optional, tag = "12")]
    interned_data: Option<InternedData>,
    #[prost(uint32, optional, tag = "13")]
    sequence_flags: Option<u32>,
    #[prost(message, optional, tag = "59")]
    trace_packet_defaults: Option<TracePacketDefaults>,
    #[prost(message, optional, tag = "60")]
    track_descriptor: Option<TrackDescriptor>,
}

/// The sequence's defaults: every timestamp is on the REALTIME clock.
#[derive(Clone, PartialEq, prost::Message)]
struct TracePacketDefaults {
    #[prost(uint32, optional, tag = "58")]
    timestamp_clock_id: Option<u32>,
}

/// Names first used by the packet that carries them.
#[derive(Clone, PartialEq, prost::Message)]
struct InternedData {
    #[prost(message, repeated, tag = "2")]
    event_names: Vec<InternedName>,
    #[prost(message, repeated, tag = "3")]
    debug_annotation_names: Vec<InternedName>,
}

/// EventName and DebugAnnotationName have the same two fields.
#[derive(Clone, PartialEq, prost::Message)]
struct InternedName {
    #[prost(uint64, optional, tag = "1")]
    iid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ClockSnapshot {
    #[prost(message, repeated, tag = "1")]
    clocks: Vec<Clock>,
    #[prost(int32, optional, tag = "2")]
    primary_trace_clock: Option<i32>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Clock {
    #[prost(uint32, optional, tag = "1")]
    clock_id: Option<u32>,
    #[prost(uint64, optional, tag = "2")]
    timestamp: Option<u64>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TrackDescriptor {
    #[prost(uint64, optional, tag = "1")]
    uuid: Option<u64>,
    #[prost(string, optional, tag = "2")]
    name: Option<String>,
    #[prost(message, optional, tag = "3")]
    process: Option<ProcessDescriptor>,
    #[prost(message, optional, tag = "4")]
    thread: Option<ThreadDescriptor>,
    #[prost(uint64, optional, tag = "5")]
    parent_uuid: Option<u64>,
    #[prost(message, optional, tag = "8")]
    counter: Option<CounterDescriptor>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProcessDescriptor {
    #[prost(int32, optional, tag = "1")]
    pid: Option<i32>,
    #[prost(string, optional, tag = "6")]
    process_name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ThreadDescriptor {
    #[prost(int32, optional, tag = "1")]
    pid: Option<i32>,
    #[prost(int32, optional, tag = "2")]
    tid: Option<i32>,
    #[prost(string, optional, tag = "5")]
    thread_name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct CounterDescriptor {
    #[prost(int32, optional, tag = "3")]
    unit: Option<i32>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TrackEvent {
    #[prost(message, repeated, tag = "4")]
    debug_annotations: Vec<DebugAnnotation>,
    #[prost(int32, optional, tag = "9")]
    r#type: Option<i32>,
    #[prost(uint64, optional, tag = "10")]
    name_iid: Option<u64>,
    #[prost(uint64, optional, tag = "11")]
    track_uuid: Option<u64>,
    #[prost(int64, optional, tag = "30")]
    counter_value: Option<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct DebugAnnotation {
    #[prost(uint64, optional, tag = "1")]
    name_iid: Option<u64>,
    #[prost(int64, optional, tag = "4")]
    int_value: Option<i64>,
    #[prost(string, optional, tag = "6")]
    string_value: Option<String>,
    #[prost(uint64, optional, tag = "7")]
    pointer_value: Option<u64>,
}

/// An argument before its name is interned.
#[derive(Clone)]
enum Arg {
    Int(&'static str, i64),
    Text(&'static str, String),
    Pointer(&'static str, u64),
}

fn int(name: &'static str, v: i64) -> Arg {
    Arg::Int(name, v)
}

fn text(name: &'static str, v: String) -> Arg {
    Arg::Text(name, v)
}

/// Names written once each, numbered from 1 (a sequence's interning tables).
#[derive(Default)]
struct Interned {
    ids: FastMap<String, u64>,
}

impl Interned {
    /// The name's number; on its first use it goes in `carried` (the packet must carry it).
    fn id(&mut self, name: &str, carried: &mut Vec<InternedName>) -> u64 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.ids.len() as u64 + 1;
        self.ids.insert(name.to_owned(), id);
        carried.push(InternedName {
            iid: Some(id),
            name: Some(name.to_owned()),
        });
        id
    }
}

/// What the trace holds, for the caller's summary.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Written {
    pub slices: u64,
    pub counter_points: u64,
    pub instants: u64,
    pub tracks: u64,
    pub bytes: u64,
}

/// Writes a session's packets as its calls arrive (in the order they were stored).
pub struct PerfettoWriter<W: Write> {
    out: W,
    buf: Vec<u8>,
    names: HashMap<u32, String>,
    sites: SiteLabels,
    next_uuid: u64,
    processes: FastMap<u32, u64>,
    threads: FastMap<(u32, u32), u64>,
    counters: FastMap<(u32, i32, usize), (u64, i64)>,
    event_names: Interned,
    annotation_names: Interned,
    started: bool,
    written: Written,
}

impl<W: Write> PerfettoWriter<W> {
    /// `names`: each process's command name; `sites`: the call sites' labels (a `--stack`
    /// session).
    pub fn new(out: W, names: HashMap<u32, String>, sites: SiteLabels) -> Self {
        PerfettoWriter {
            out,
            buf: Vec::with_capacity(256),
            names,
            sites,
            next_uuid: 1,
            processes: FastMap::default(),
            threads: FastMap::default(),
            counters: FastMap::default(),
            event_names: Interned::default(),
            annotation_names: Interned::default(),
            started: false,
            written: Written::default(),
        }
    }

    fn packet(&mut self, mut p: TracePacket) -> Result<()> {
        p.trusted_packet_sequence_id = Some(SEQUENCE);
        self.buf.clear();
        // Trace.packet (field 1, length-delimited), one at a time.
        self.buf.push(0x0a);
        p.encode_length_delimited(&mut self.buf)
            .context("encoding a trace packet")?;
        self.out
            .write_all(&self.buf)
            .context("writing the Perfetto trace")?;
        self.written.bytes += self.buf.len() as u64;
        Ok(())
    }

    /// The clock snapshot, first: REALTIME is the trace's clock.
    fn start(&mut self, ts: u64) -> Result<()> {
        if self.started {
            return Ok(());
        }
        self.started = true;
        let at = |clock_id| Clock {
            clock_id: Some(clock_id),
            timestamp: Some(ts),
        };
        self.packet(TracePacket {
            clock_snapshot: Some(ClockSnapshot {
                clocks: vec![at(CLOCK_REALTIME), at(CLOCK_BOOTTIME)],
                primary_trace_clock: Some(CLOCK_REALTIME as i32),
            }),
            trace_packet_defaults: Some(TracePacketDefaults {
                timestamp_clock_id: Some(CLOCK_REALTIME),
            }),
            sequence_flags: Some(SEQ_INCREMENTAL_STATE_CLEARED),
            ..Default::default()
        })
    }

    fn describe(&mut self, track: TrackDescriptor) -> Result<u64> {
        let uuid = self.next_uuid;
        self.next_uuid += 1;
        self.written.tracks += 1;
        self.packet(TracePacket {
            track_descriptor: Some(TrackDescriptor {
                uuid: Some(uuid),
                ..track
            }),
            ..Default::default()
        })?;
        Ok(uuid)
    }

    fn process_track(&mut self, pid: u32) -> Result<u64> {
        if let Some(&uuid) = self.processes.get(&pid) {
            return Ok(uuid);
        }
        let name = self.names.get(&pid).cloned();
        let uuid = self.describe(TrackDescriptor {
            process: Some(ProcessDescriptor {
                pid: Some(pid as i32),
                process_name: name,
            }),
            ..Default::default()
        })?;
        self.processes.insert(pid, uuid);
        Ok(uuid)
    }

    fn thread_track(&mut self, pid: u32, tid: u32) -> Result<u64> {
        if let Some(&uuid) = self.threads.get(&(pid, tid)) {
            return Ok(uuid);
        }
        let parent = self.process_track(pid)?;
        let uuid = self.describe(TrackDescriptor {
            parent_uuid: Some(parent),
            thread: Some(ThreadDescriptor {
                pid: Some(pid as i32),
                tid: Some(tid as i32),
                thread_name: Some(format!("thread {tid}")),
            }),
            ..Default::default()
        })?;
        self.threads.insert((pid, tid), uuid);
        Ok(uuid)
    }

    fn event(&mut self, ts: u64, event: TrackEvent) -> Result<()> {
        self.packet(TracePacket {
            timestamp: Some(ts),
            track_event: Some(event),
            ..Default::default()
        })
    }

    /// A named event: its name and its arguments' names by number, the ones used for the first
    /// time carried in the same packet.
    fn named_event(
        &mut self,
        ts: u64,
        name: &str,
        args: Vec<Arg>,
        mut event: TrackEvent,
    ) -> Result<()> {
        let mut new = InternedData::default();
        event.name_iid = Some(self.event_names.id(name, &mut new.event_names));
        event.debug_annotations = args
            .into_iter()
            .map(|arg| {
                let (name, mut annotation) = match arg {
                    Arg::Int(n, v) => (
                        n,
                        DebugAnnotation {
                            int_value: Some(v),
                            ..Default::default()
                        },
                    ),
                    Arg::Text(n, v) => (
                        n,
                        DebugAnnotation {
                            string_value: Some(v),
                            ..Default::default()
                        },
                    ),
                    Arg::Pointer(n, v) => (
                        n,
                        DebugAnnotation {
                            pointer_value: Some(v),
                            ..Default::default()
                        },
                    ),
                };
                annotation.name_iid = Some(
                    self.annotation_names
                        .id(name, &mut new.debug_annotation_names),
                );
                annotation
            })
            .collect();
        let carries = !new.event_names.is_empty() || !new.debug_annotation_names.is_empty();
        self.packet(TracePacket {
            timestamp: Some(ts),
            track_event: Some(event),
            interned_data: carries.then_some(new),
            ..Default::default()
        })
    }

    fn instant(&mut self, ts: u64, track: u64, name: &str, args: Vec<Arg>) -> Result<()> {
        self.written.instants += 1;
        let event = TrackEvent {
            r#type: Some(INSTANT),
            track_uuid: Some(track),
            ..Default::default()
        };
        self.named_event(ts, name, args, event)
    }

    /// One stored call: its slice (an instant for the allocator's probes, which have no
    /// duration), then what it changed (`c`, from the query side).
    pub fn call(&mut self, e: &Event, c: &Consequences) -> Result<()> {
        let ts = e.ts_ns.max(0) as u64;
        self.start(ts)?;
        let track = self.thread_track(e.pid, e.tid)?;
        let class = e.op.spec().class;
        let probe = matches!(class, OpClass::BlockAlloc | OpClass::BlockFree);
        // The allocator's probes return nothing: no `ret` to show.
        let mut args = Vec::with_capacity(4);
        if !probe {
            args.push(int("ret", e.ret.into()));
        }
        if e.size != 0 {
            args.push(int("size", e.size as i64));
        }
        if e.ptr != 0 {
            args.push(Arg::Pointer("ptr", e.ptr));
        }
        if let Some(device) = e.device() {
            args.push(int("device", device.into()));
        }
        if let Some(site) = e.stack.and_then(|s| self.sites.get(&s)) {
            args.push(text("call site", site.clone()));
        }
        if probe {
            self.instant(ts, track, e.op.name(), args)?;
        } else {
            self.written.slices += 1;
            let begin = TrackEvent {
                r#type: Some(SLICE_BEGIN),
                track_uuid: Some(track),
                ..Default::default()
            };
            self.named_event(ts, e.op.name(), args, begin)?;
            self.event(
                ts + e.duration_ns,
                TrackEvent {
                    r#type: Some(SLICE_END),
                    track_uuid: Some(track),
                    ..Default::default()
                },
            )?;
        }
        self.consequences(e, ts + e.duration_ns, c)
    }

    /// Failures, retries, early warnings and the counters a call moved.
    fn consequences(&mut self, e: &Event, end: u64, c: &Consequences) -> Result<()> {
        let process = self.process_track(e.pid)?;
        let size = vec![int("size", e.size as i64), int("device", c.device.into())];
        if c.failed {
            self.instant(end, process, "allocation failed", size.clone())?;
        }
        if c.retried {
            self.instant(end, process, "allocation retried", size)?;
        }
        if let Some(w) = &c.warning {
            let args = vec![
                int("request", w.request as i64),
                int("largest free block", w.largest_free as i64),
                int("device free", w.device_free as i64),
                int("device", w.device.into()),
            ];
            self.instant(end, process, "early warning: the next request fails", args)?;
        }
        for (i, value) in c.counters.iter().enumerate() {
            if let Some(v) = *value {
                self.counter(e.pid, c.device, i, end, v as i64)?;
            }
        }
        Ok(())
    }

    fn counter(&mut self, pid: u32, device: i32, which: usize, ts: u64, value: i64) -> Result<()> {
        let uuid = match self.counters.get(&(pid, device, which)) {
            Some(&(_, last)) if last == value => return Ok(()),
            Some(&(uuid, _)) => uuid,
            None => {
                let parent = self.process_track(pid)?;
                self.describe(TrackDescriptor {
                    parent_uuid: Some(parent),
                    name: Some(format!("{} (device {device})", COUNTERS[which])),
                    counter: Some(CounterDescriptor {
                        unit: Some(UNIT_SIZE_BYTES),
                    }),
                    ..Default::default()
                })?
            }
        };
        self.counters.insert((pid, device, which), (uuid, value));
        self.written.counter_points += 1;
        self.event(
            ts,
            TrackEvent {
                r#type: Some(COUNTER),
                track_uuid: Some(uuid),
                counter_value: Some(value),
                ..Default::default()
            },
        )
    }

    /// A text a traced program produced at a probe (PyTorch's out-of-memory message).
    pub fn message(&mut self, m: &MessageRow) -> Result<()> {
        let ts = m.ts_ns.max(0) as u64;
        self.start(ts)?;
        let track = self.thread_track(m.pid, m.tid)?;
        let name = if m.op == tracer_common::Op::TorchOom.name() {
            "CUDA out of memory"
        } else {
            m.op.as_str()
        };
        let name = name.to_owned();
        self.instant(ts, track, &name, vec![text("message", m.text.clone())])
    }

    /// Flushes; what was written.
    pub fn finish(mut self) -> Result<Written> {
        self.out.flush().context("writing the Perfetto trace")?;
        Ok(self.written)
    }
}
