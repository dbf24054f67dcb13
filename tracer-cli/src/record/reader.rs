//! The ring-buffer reader: drains, orders and hands over, nothing else, so the kernel's ring
//! is emptied as fast as it fills. Decoding, and what is slow to learn about a call (its
//! process, its call site), are the registry's work, on its own thread.
//!
//! Call events reach the ring a CPU's stage at a time (record/stage.rs), so the ring's order
//! is not the order the calls returned in. Every round the reader empties the stages and
//! hands over, in the order the kernel made them, the records made before the round began;
//! later ones wait for the next round. Under --stack, a call with Python frames goes to the
//! ring by itself; while such calls come, rounds come every millisecond: their code objects
//! are read from the process, which may exit milliseconds after its last call.

use std::{
    os::fd::AsFd as _,
    sync::{atomic::Ordering, mpsc::SyncSender},
    time::{Duration, Instant},
};

use anyhow::{anyhow, Result};
use aya::maps::{MapData, RingBuf};
use nix::{
    poll::{poll, PollFd, PollFlags, PollTimeout},
    sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout},
    time::{clock_gettime, ClockId},
};

use super::{registry::Inbound, shared::Shared};
use crate::{
    decode::{self, EventBytes},
    probe::stage::{Round, Stages},
};

/// How long events may wait in the ring before the reader looks (the delivery bound).
const POLL_INTERVAL_MS: u16 = 25;
/// The look after one that found events, when nothing is staged (records handed over as read):
/// a burst's tail is not left for a whole interval.
const BUSY_POLL_INTERVAL_MS: u16 = 1;
/// How often the stages are emptied (each a call into the kernel per CPU) and what was made
/// by then handed over. Each round wakes the registry and the writer behind it, their caches
/// cold: in the step bench, 50 ms instead of 25 took a ninth off tracer's CPU an event (a
/// delivery cost the registry some 50 us beyond its calls), 100 ms instead of 50 another
/// twentieth. What must not wait that long does not: a thread's first call and PyTorch's
/// out-of-memory message bring their round forward ([`URGENT_ROUND_AFTER`]), and the writer
/// commits a message at once.
const ROUND_INTERVAL: Duration = Duration::from_millis(100);
/// Under `--allocator auto`: the registry decides from the calls when to arm a process's
/// allocator probes, and the blocks made before they are armed are not seen.
const ARMING_ROUND_INTERVAL: Duration = Duration::from_millis(50);
/// After an event that must not wait for the round is read (a thread's first call, which the
/// programs send at once with its CPU's stage, or a message), the round that hands it over comes
/// this long past the margin: a new process's first calls reach the registry within
/// milliseconds, while its /proc entry can still be read.
const URGENT_ROUND_AFTER: Duration = Duration::from_millis(1);
/// How often while calls with Python frames come (--stack): a burst's tail (a process's last
/// calls, whose code objects must be read while it lives) is not left for a whole interval.
const PYTHON_ROUND_INTERVAL: Duration = Duration::from_millis(1);
/// Records made this long before a round began are handed over by it: a program that read the
/// clock and has not yet written its record to the ring is given that long to do so. A record
/// later still (a vCPU held off by a virtual machine's host, say: 8 frees once came before their
/// allocations) is handed over late and counted (`events_late`). Every answer must stay right
/// at any margin (the flight recorder's eviction test runs at 20 ms too:
/// `TRACER_ROUND_MARGIN_MS`, for tests and for machines whose vCPUs are held off longer).
const ROUND_MARGIN_NS: u64 = 2_000_000;

/// [`ROUND_MARGIN_NS`], or the milliseconds `TRACER_ROUND_MARGIN_MS` says (at most a second).
fn round_margin_ns() -> u64 {
    let Ok(text) = std::env::var("TRACER_ROUND_MARGIN_MS") else {
        return ROUND_MARGIN_NS;
    };
    match text.trim().parse::<u64>() {
        Ok(ms) => ms.min(1_000) * 1_000_000,
        Err(_) => {
            eprintln!(
                "tracer: TRACER_ROUND_MARGIN_MS={text:?} is not a whole number of milliseconds: the reader waits {} ms (set it to e.g. 20, or unset it)",
                ROUND_MARGIN_NS / 1_000_000
            );
            ROUND_MARGIN_NS
        }
    }
}

/// Where the reader's records come from.
pub struct Source {
    pub ring: RingBuf<MapData>,
    /// None when nothing is staged (--stack): the ring is then in order.
    pub stages: Option<Stages>,
    /// The registry decides when to arm processes' allocator probes (`--allocator auto`).
    pub arming: bool,
}

/// Drains the ring until the session stops: wakes on the kernel's signal (a batch is waiting)
/// or every POLL_INTERVAL_MS, whichever comes first, so delivery latency stays bounded. After
/// the stop flag is set it empties the stages and drains once more, so every record submitted
/// before is handed over.
pub fn read_loop(mut source: Source, tx: SyncSender<Inbound>, shared: &Shared) -> Result<()> {
    let result = (|| -> Result<()> {
        let mut order = Reorder::default();
        let wakeups = match source.stages {
            Some(_) => Some(Wakeups::new(&source.ring)?),
            None => None,
        };
        let mut last_round = Instant::now();
        let every = if source.arming {
            ARMING_ROUND_INTERVAL
        } else {
            ROUND_INTERVAL
        };
        let mut interval = every;
        let margin = round_margin_ns();
        // When an urgent event was read: the round that hands it over.
        let mut hurry: Option<Instant> = None;
        loop {
            let stopping = shared.stop.load(Ordering::SeqCst);
            let hurried = hurry.is_some_and(|at| Instant::now() >= at);
            let round = match source.stages.as_mut() {
                Some(stages) if stopping || hurried || last_round.elapsed() >= interval => {
                    if hurried {
                        hurry = None;
                    }
                    last_round = Instant::now();
                    let began = monotonic_ns()?;
                    // Stopping, every stage is emptied.
                    let until = if stopping {
                        u64::MAX
                    } else {
                        began.saturating_sub(margin)
                    };
                    Some((began, stages.flush(until)?))
                }
                _ => None,
            };
            let mut decode_errors = 0;
            let mut found = false;
            // Nothing staged: the ring's order is the kernel's, and events go as read.
            let mut unstaged = EventBytes::default();
            let mut python = false;
            while let Some(item) = source.ring.next() {
                found = true;
                python |= decode::is_call_py(&item);
                if source.stages.is_some() {
                    decode_errors += order.push(&item);
                } else {
                    decode_errors += push_events(&item, &mut unstaged);
                }
            }
            if let (true, Some(stages)) = (stopping, source.stages.as_mut()) {
                let left = stages.take_left()?;
                shared
                    .taken_from_stages
                    .fetch_add(left.len() as u64, Ordering::SeqCst);
                for item in left {
                    decode_errors += order.push(&item);
                }
            }
            let until = match round {
                _ if stopping => Some(u64::MAX),
                Some((began, Round::Complete)) => Some(began.saturating_sub(margin)),
                _ => None,
            };
            let ready = match until {
                Some(until) if source.stages.is_some() => order.release(until),
                _ => unstaged,
            };
            shared
                .decode_errors
                .fetch_add(decode_errors, Ordering::SeqCst);
            shared.events_late.store(order.late, Ordering::SeqCst);
            if !ready.is_empty() {
                hand_over(ready, &tx)?;
            }
            if stopping {
                return Ok(());
            }
            if let Some(wakeups) = wakeups.as_ref() {
                // Records are handed over only at rounds: until the next one, only a full
                // batch in the ring (its wake-up) is worth a look.
                if python {
                    interval = PYTHON_ROUND_INTERVAL;
                } else if round.is_some() {
                    interval = every;
                }
                if order.take_urgent() && hurry.is_none() {
                    hurry =
                        Some(Instant::now() + Duration::from_nanos(margin) + URGENT_ROUND_AFTER);
                }
                let mut left = interval.saturating_sub(last_round.elapsed());
                if let Some(at) = hurry {
                    left = left.min(at.saturating_duration_since(Instant::now()));
                }
                // Rounded up: a wait that ends just short of the round is a wake-up for nothing.
                let ms = left.as_micros().div_ceil(1000) as u16;
                wakeups.wait(ms.clamp(1, POLL_INTERVAL_MS))?;
                continue;
            }
            let mut fds = [PollFd::new(source.ring.as_fd(), PollFlags::POLLIN)];
            let wait = if found {
                BUSY_POLL_INTERVAL_MS
            } else {
                POLL_INTERVAL_MS
            };
            match poll(&mut fds, PollTimeout::from(wait)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(anyhow!("poll the event ring buffer: {e}")),
            }
        }
    })();
    if result.is_err() {
        shared.stop.store(true, Ordering::SeqCst);
    }
    result
}

/// The ring's wake-ups alone, edge-triggered: a ring polled for its data answers at once
/// whenever a record waits, and under a steady load one always does, so the reader woke some
/// 230 times a second to find a few records; it now sleeps until the round, or until the
/// programs say a batch waits (`WAKEUP_BYTES`).
struct Wakeups {
    epoll: Epoll,
}

impl Wakeups {
    fn new(ring: &RingBuf<MapData>) -> Result<Wakeups> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| anyhow!("create an epoll instance for the event ring: {e}"))?;
        epoll
            .add(
                ring.as_fd(),
                EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLET, 0),
            )
            .map_err(|e| anyhow!("watch the event ring's wake-ups: {e}"))?;
        Ok(Wakeups { epoll })
    }

    /// Until the next wake-up or `ms` milliseconds.
    fn wait(&self, ms: u16) -> Result<()> {
        let mut events = [EpollEvent::empty()];
        match self.epoll.wait(&mut events, EpollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
            Err(e) => Err(anyhow!("wait for the event ring's wake-ups: {e}")),
        }
    }
}

fn monotonic_ns() -> Result<u64> {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map_err(|e| anyhow!("read CLOCK_MONOTONIC: {e}"))?;
    Ok(now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64)
}

/// Events read but not yet handed over, kept as the ring's bytes with when each was made, and
/// handed over as those bytes in the order they were made (decoded by the registry). Events
/// come by the million a second: only their times are sorted.
#[derive(Default)]
struct Reorder {
    raw: Vec<u8>,
    /// (time made, offset in `raw`, length), in the order of their bytes: the ring's order.
    keys: Vec<(u64, u32, u32)>,
    spare_keys: Vec<(u64, u32, u32)>,
    /// The latest time handed over: an event made before it and read now is late.
    released_ns: u64,
    /// Events read after events made later than them had been handed over.
    late: u64,
    /// An event that must not wait for the round (a thread's first call, a message) was read
    /// since [`Reorder::take_urgent`] last asked.
    urgent: bool,
}

impl Reorder {
    /// Keeps the events of one ring record; returns how many could not be read (the record's
    /// rest is then dropped: a bad length cannot be trusted to find the next event).
    fn push(&mut self, item: &[u8]) -> u64 {
        for event in decode::events(item) {
            let Ok((event, sent)) = event else {
                return 1;
            };
            self.late += u64::from(sent < self.released_ns);
            self.urgent |= decode::is_urgent(event);
            self.keys
                .push((sent, self.raw.len() as u32, event.len() as u32));
            self.raw.extend_from_slice(event);
        }
        0
    }

    /// Whether an urgent event was read since the last time this was asked.
    fn take_urgent(&mut self) -> bool {
        std::mem::take(&mut self.urgent)
    }

    /// The events made up to `until_ns`, in the order they were made (the ring's order among
    /// equals); the later ones are kept.
    fn release(&mut self, until_ns: u64) -> EventBytes {
        // The kept events are sorted already and the new ones in runs (a CPU's stage at a
        // time): the stable sort merges runs (120 us a round for 20,000 kept and 10,000 new
        // here, against 291 us unstable). By time alone: the keys lie in the order their bytes
        // do, so a stable sort keeps the ring's order among equals (a quarter faster than
        // comparing the offsets too).
        self.keys.sort_by_key(|&(ns, _, _)| ns);
        let cut = self.keys.partition_point(|&(ns, _, _)| ns <= until_ns);
        let Some(&(last, _, _)) = cut.checked_sub(1).and_then(|i| self.keys.get(i)) else {
            return EventBytes::default();
        };
        self.released_ns = self.released_ns.max(last);
        let spans = self.keys[..cut]
            .iter()
            .map(|&(_, at, len)| (at, len))
            .collect();
        // The bytes go with the released events; the kept ones are copied to a room as large.
        let mut kept = Vec::with_capacity(self.raw.capacity());
        self.spare_keys.clear();
        for &(ns, at, len) in &self.keys[cut..] {
            self.spare_keys.push((ns, kept.len() as u32, len));
            kept.extend_from_slice(&self.raw[at as usize..(at + len) as usize]);
        }
        std::mem::swap(&mut self.keys, &mut self.spare_keys);
        EventBytes::new(std::mem::replace(&mut self.raw, kept), spans)
    }
}

/// Appends the events of one ring record; returns how many could not be read (the record's
/// rest is then dropped, as [`Reorder::push`] does).
fn push_events(item: &[u8], to: &mut EventBytes) -> u64 {
    for event in decode::events(item) {
        match event {
            Ok((event, _)) => to.push(event),
            Err(_) => return 1,
        }
    }
    0
}

fn hand_over(batch: EventBytes, tx: &SyncSender<Inbound>) -> Result<()> {
    tx.send(Inbound::Ring(batch))
        .map_err(|_| anyhow!("the process registry stopped"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Record;
    use tracer_common::{
        sched::ExitEvent, usdt::MessageEvent, CallEvent, EventHeader, EventKind, Op,
    };

    /// The header of an event of `kind` made at `ts_ns` by process `pid`'s main thread.
    fn header(kind: EventKind, len: u32, ts_ns: u64, pid: u32) -> EventHeader {
        EventHeader {
            kind: kind as u32,
            len,
            ts_ns,
            pid,
            tid: pid,
        }
    }

    fn exit(pid: u32, ts_ns: u64) -> Vec<u8> {
        decode::pod_bytes(&ExitEvent {
            header: header(ExitEvent::KIND, ExitEvent::LEN, ts_ns, pid),
        })
        .to_vec()
    }

    /// A call that began at `ts_ns` and returned `duration_ns` later.
    fn call(pid: u32, ts_ns: u64, duration_ns: u64) -> Vec<u8> {
        decode::pod_bytes(&CallEvent {
            header: header(CallEvent::KIND, CallEvent::LEN, ts_ns, pid),
            op: Op::CudaMalloc as u32,
            device: -1,
            duration_ns,
            ..Default::default()
        })
        .to_vec()
    }

    fn pids(events: &EventBytes) -> Vec<u32> {
        events
            .decode()
            .map(|r| match r.expect("decodes") {
                Record::Call(c) => c.pid,
                Record::Exit { pid, .. } => pid,
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn an_event_read_after_later_ones_were_handed_over_is_counted_late() {
        let mut order = Reorder::default();
        for item in [exit(1, 10), exit(2, 30)] {
            assert_eq!(order.push(&item), 0);
        }
        let ready = order.release(20);
        assert_eq!(pids(&ready), [1]);
        // Made at 5, before the event at 10 already handed over: late. Made at 15: not.
        for item in [exit(3, 5), exit(4, 15)] {
            assert_eq!(order.push(&item), 0);
        }
        assert_eq!(order.late, 1);
        let ready = order.release(u64::MAX);
        assert_eq!(pids(&ready), [3, 4, 2]);
    }

    #[test]
    fn release_hands_over_what_was_made_by_then_in_order_and_keeps_the_rest() {
        let mut order = Reorder::default();
        // A stage of two calls (sent when they returned: 5 + 25 = 30 and 12), then events
        // sent by themselves.
        let mut stage = call(1, 5, 25);
        stage.extend(call(2, 2, 10));
        assert_eq!(order.push(&stage), 0);
        for item in [exit(3, 50), exit(4, 12), exit(5, 20)] {
            assert_eq!(order.push(&item), 0);
        }
        let ready = order.release(30);
        // Equal times keep the ring's order: pid 2 was read before pid 4.
        assert_eq!(pids(&ready), [2, 4, 5, 1]);
        assert_eq!(order.push(&exit(6, 40)), 0);
        let ready = order.release(45);
        assert_eq!(pids(&ready), [6]);
        let ready = order.release(u64::MAX);
        assert_eq!(pids(&ready), [3]);
        let ready = order.release(u64::MAX);
        assert!(ready.is_empty());
    }

    /// A thread's first call (it carries the thread's name) and a message are noticed, in a
    /// stage of others or alone, once; other events are not.
    #[test]
    fn a_threads_first_call_and_a_message_are_noticed_once() {
        let mut order = Reorder::default();
        let mut stage = call(1, 5, 1);
        stage.extend(exit(2, 6));
        assert_eq!(order.push(&stage), 0);
        assert!(!order.take_urgent());
        let mut named = CallEvent {
            header: header(CallEvent::KIND, CallEvent::LEN, 7, 3),
            op: Op::CudaMalloc as u32,
            device: -1,
            ..Default::default()
        };
        named.comm[..6].copy_from_slice(b"python");
        let mut stage = call(1, 8, 1);
        stage.extend(decode::pod_bytes(&named));
        assert_eq!(order.push(&stage), 0);
        assert!(order.take_urgent());
        assert!(!order.take_urgent());
        let message = MessageEvent {
            header: header(MessageEvent::KIND, MessageEvent::LEN, 9, 4),
            op: Op::TorchOom as u32,
            len: 3,
            full_len: 3,
            text: [b'O'; tracer_common::usdt::MESSAGE_BYTES],
        };
        assert_eq!(order.push(decode::pod_bytes(&message)), 0);
        assert!(order.take_urgent());
        assert!(!order.take_urgent());
        let ready = order.release(u64::MAX);
        let kinds: Vec<(u32, bool)> = ready
            .decode()
            .map(|r| match r.expect("decodes") {
                Record::Call(c) => (c.pid, false),
                Record::Exit { pid, .. } => (pid, false),
                Record::Message(m) => (m.pid, true),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(
            kinds,
            [(1, false), (2, false), (3, false), (1, false), (4, true)]
        );
    }

    #[test]
    fn a_record_that_cannot_be_read_is_counted_and_its_rest_dropped() {
        let mut order = Reorder::default();
        let mut item = exit(1, 10);
        let mut lying = exit(2, 11);
        lying[4] = 99;
        item.extend(lying);
        item.extend(exit(3, 12));
        assert_eq!(order.push(&item), 1);
        let ready = order.release(u64::MAX);
        assert_eq!(pids(&ready), [1]);
    }
}
