//! The ring-buffer reader: drains, decodes and hands over, nothing else, so the kernel's ring
//! is emptied as fast as it fills. What is slow to learn about a call (its process, its call
//! site) is the registry's work, on its own thread.
//!
//! Call events reach the ring a CPU's stage at a time (record/stage.rs), so the ring's order
//! is not the order the calls returned in. Every round the reader empties the stages and
//! hands over, in the order the kernel made them, the records made before the round began;
//! later ones wait for the next round. With --stack every event goes to the ring by itself,
//! already in order, and is handed over as read.

use std::{
    os::fd::AsFd as _,
    sync::{atomic::Ordering, mpsc::SyncSender},
    time::{Duration, Instant},
};

use anyhow::{anyhow, Result};
use aya::maps::{MapData, RingBuf};
use nix::{
    poll::{poll, PollFd, PollFlags, PollTimeout},
    time::{clock_gettime, ClockId},
};

use super::{
    registry::Inbound,
    shared::Shared,
    stage::{Round, Stages},
};
use crate::decode::{self, Record};

/// How long events may wait in the ring before the reader looks (the delivery bound).
const POLL_INTERVAL_MS: u16 = 10;
/// The look after one that found events: a burst's tail (a process's last calls, whose call
/// sites must be read while it lives) is not left for a whole interval.
const BUSY_POLL_INTERVAL_MS: u16 = 1;
/// How often the stages are emptied (each a call into the kernel per CPU).
const ROUND_INTERVAL: Duration = Duration::from_millis(10);
/// Records made this long before a round began are handed over by it: a program that read the
/// clock and has not yet written its record to the ring is given that long to do so.
const ROUND_MARGIN_NS: u64 = 2_000_000;
/// Records handed over at most at once.
const BATCH: usize = 8192;

/// Where the reader's records come from.
pub struct Source {
    pub ring: RingBuf<MapData>,
    /// None when nothing is staged (--stack): the ring is then in order.
    pub stages: Option<Stages>,
}

/// Drains the ring until the session stops: wakes on the kernel's signal (a batch is waiting)
/// or every POLL_INTERVAL_MS, whichever comes first, so delivery latency stays bounded. After
/// the stop flag is set it empties the stages and drains once more, so every record submitted
/// before is handed over.
pub fn read_loop(mut source: Source, tx: SyncSender<Inbound>, shared: &Shared) -> Result<()> {
    let result = (|| -> Result<()> {
        let mut order = Reorder::default();
        let mut last_round = Instant::now();
        loop {
            let stopping = shared.stop.load(Ordering::SeqCst);
            let round = match source.stages.as_ref() {
                Some(stages) if stopping || last_round.elapsed() >= ROUND_INTERVAL => {
                    last_round = Instant::now();
                    let began = monotonic_ns()?;
                    Some((began, stages.flush()?))
                }
                _ => None,
            };
            let mut decode_errors = 0;
            let mut found = false;
            while let Some(item) = source.ring.next() {
                found = true;
                for record in decode::decode_all(&item) {
                    match record {
                        Ok(record) => order.push(record),
                        Err(_) => decode_errors += 1,
                    }
                }
            }
            if stopping {
                if let Some(stages) = source.stages.as_mut() {
                    for item in stages.take_left()? {
                        for record in decode::decode_all(&item) {
                            match record {
                                Ok(record) => order.push(record),
                                Err(_) => decode_errors += 1,
                            }
                        }
                    }
                }
            }
            shared
                .decode_errors
                .fetch_add(decode_errors, Ordering::SeqCst);
            let ready = if stopping || source.stages.is_none() {
                order.release(u64::MAX)
            } else {
                match round {
                    Some((began, Round::Complete)) => {
                        order.release(began.saturating_sub(ROUND_MARGIN_NS))
                    }
                    _ => Vec::new(),
                }
            };
            for batch in ready.chunks(BATCH) {
                hand_over(batch.to_vec(), &tx)?;
            }
            if stopping {
                return Ok(());
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

fn monotonic_ns() -> Result<u64> {
    let now = clock_gettime(ClockId::CLOCK_MONOTONIC)
        .map_err(|e| anyhow!("read CLOCK_MONOTONIC: {e}"))?;
    Ok(now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64)
}

/// Records read but not yet handed over, put back in the order the kernel made them.
#[derive(Default)]
struct Reorder {
    pending: Vec<Record>,
}

impl Reorder {
    fn push(&mut self, record: Record) {
        self.pending.push(record);
    }

    /// The records made up to `until_ns`, in the order they were made (the ring's order among
    /// equals), leaving the later ones.
    fn release(&mut self, until_ns: u64) -> Vec<Record> {
        self.pending.sort_by_key(Record::sent_ns);
        let cut = self.pending.partition_point(|r| r.sent_ns() <= until_ns);
        let later = self.pending.split_off(cut);
        std::mem::replace(&mut self.pending, later)
    }
}

fn hand_over(batch: Vec<Record>, tx: &SyncSender<Inbound>) -> Result<()> {
    tx.send(Inbound::Ring(batch))
        .map_err(|_| anyhow!("the process registry stopped"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::OffCpu;

    fn off(on_ns: u64) -> Record {
        Record::OffCpu(OffCpu {
            pid: 1,
            tid: 1,
            off_mono_ns: 0,
            on_mono_ns: on_ns,
            wakeup_mono_ns: None,
            preempted: false,
        })
    }

    fn exit(pid: u32, ts: u64) -> Record {
        Record::Exit {
            pid,
            ts_mono_ns: ts,
        }
    }

    #[test]
    fn release_hands_over_what_was_made_by_then_in_order_and_keeps_the_rest() {
        let mut order = Reorder::default();
        for r in [off(30), exit(1, 10), off(50), exit(2, 20), exit(3, 10)] {
            order.push(r);
        }
        // Equal times keep the ring's order (pid 1 was read before pid 3).
        assert_eq!(
            order.release(30),
            vec![exit(1, 10), exit(3, 10), exit(2, 20), off(30)]
        );
        order.push(off(40));
        assert_eq!(order.release(45), vec![off(40)]);
        assert_eq!(order.release(u64::MAX), vec![off(50)]);
        assert!(order.release(u64::MAX).is_empty());
    }
}
