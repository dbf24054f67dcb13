//! Off-CPU blocks: the intervals followed threads spent off the CPU (host context), packed as
//! call blocks are. A training step blocks and wakes a hundred times or more; a row each cost
//! the writer about 4 us and the database 60 bytes, a packed interval a few hundred ns and about
//! 8 bytes.
//!
//! Format 1, per interval, in the writer's order: a flags byte ([`PREEMPTED`], [`HAS_WAKEUP`]),
//! then LEB128 varints: pid and tid (zigzag deltas from the previous interval), the time it left
//! the CPU (zigzag delta), how long it stayed off, and when it was woken (zigzag, from the time
//! it left) if it was. Deltas start from 0 in each block, so every block decodes on its own.

use super::blocks::{put, zigzag, BlockError, Reader, MAX_CALLS};
use crate::{decode::OffCpu, model::OffSlice};

/// The format written into `offcpu_blocks.format`.
pub const FORMAT: i64 = 1;

/// Intervals per block at most (as many as a call block holds calls).
pub const MAX_INTERVALS: usize = MAX_CALLS;

const PREEMPTED: u8 = 1;
const HAS_WAKEUP: u8 = 2;
const KNOWN: u8 = PREEMPTED | HAS_WAKEUP;

/// One encoded block and what its row records about it.
#[derive(Debug)]
pub struct OffBlock {
    pub intervals: usize,
    pub min_off_ns: i64,
    pub max_on_ns: i64,
    pub data: Vec<u8>,
}

/// Encodes `intervals` (monotonic clock, made wall-clock by `wall_offset_ns`).
pub fn encode(intervals: &[OffCpu], wall_offset_ns: i64) -> OffBlock {
    let mut data = Vec::with_capacity(intervals.len() * 10);
    let (mut pid, mut tid, mut off) = (0i64, 0i64, 0i64);
    let (mut min_off_ns, mut max_on_ns) = (i64::MAX, i64::MIN);
    let wall = |mono: u64| (mono as i64).wrapping_add(wall_offset_ns);
    for o in intervals {
        let (off_ns, on_ns) = (wall(o.off_mono_ns), wall(o.on_mono_ns));
        min_off_ns = min_off_ns.min(off_ns);
        max_on_ns = max_on_ns.max(on_ns);
        let flags = if o.preempted { PREEMPTED } else { 0 }
            | if o.wakeup_mono_ns.is_some() {
                HAS_WAKEUP
            } else {
                0
            };
        data.push(flags);
        put(&mut data, zigzag(i64::from(o.pid) - pid));
        pid = i64::from(o.pid);
        put(&mut data, zigzag(i64::from(o.tid) - tid));
        tid = i64::from(o.tid);
        put(&mut data, zigzag(off_ns.wrapping_sub(off)));
        off = off_ns;
        // The decoder refuses on before off, as the ring's decoder does.
        put(&mut data, on_ns.wrapping_sub(off_ns) as u64);
        if let Some(w) = o.wakeup_mono_ns {
            put(&mut data, zigzag(wall(w).wrapping_sub(off_ns)));
        }
    }
    OffBlock {
        intervals: intervals.len(),
        min_off_ns,
        max_on_ns,
        data,
    }
}

/// Decodes a block of `intervals` intervals, handing each to `emit` in block order.
pub fn decode(
    data: &[u8],
    intervals: usize,
    mut emit: impl FnMut(OffSlice),
) -> Result<(), BlockError> {
    if intervals > MAX_INTERVALS {
        return Err(BlockError::TooMany { calls: intervals });
    }
    let mut r = Reader {
        data,
        pos: 0,
        call: 0,
    };
    let (mut pid, mut tid, mut off) = (0i64, 0i64, 0i64);
    while r.call < intervals {
        let flags = r.byte()?;
        if flags & !KNOWN != 0 {
            return Err(BlockError::UnknownFields {
                call: r.call,
                bits: flags,
            });
        }
        pid = pid.wrapping_add(r.signed()?);
        tid = tid.wrapping_add(r.signed()?);
        off = off.wrapping_add(r.signed()?);
        let stayed = r.varint()?;
        let wakeup = if flags & HAS_WAKEUP != 0 {
            Some(off.wrapping_add(r.signed()?))
        } else {
            None
        };
        let on = i64::try_from(stayed).ok().and_then(|d| off.checked_add(d));
        let (Ok(p), Ok(t), Some(on)) = (u32::try_from(pid), u32::try_from(tid), on) else {
            return Err(BlockError::BadValue { call: r.call });
        };
        if off < 0 {
            return Err(BlockError::BadValue { call: r.call });
        }
        r.call += 1;
        emit(OffSlice {
            pid: p,
            tid: t,
            off_ns: off,
            on_ns: on,
            wakeup_ns: wakeup,
            preempted: flags & PREEMPTED != 0,
        });
    }
    r.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn interval(i: u64) -> OffCpu {
        let off = 7_000_000 + i * 50_000 - (i % 4) * 30_000;
        OffCpu {
            pid: 300 + (i % 2) as u32,
            tid: 400 + (i % 5) as u32,
            off_mono_ns: off,
            on_mono_ns: off + (i % 7) * 11_000,
            wakeup_mono_ns: (!i.is_multiple_of(3)).then_some(off + (i % 7) * 9_000),
            preempted: i.is_multiple_of(3),
        }
    }

    #[test]
    fn round_trip_keeps_every_field_and_the_order() {
        let intervals: Vec<OffCpu> = (0..500).map(interval).collect();
        let offset = 1_700_000_000_000_000_000;
        let block = encode(&intervals, offset);
        assert!(
            block.data.len() < intervals.len() * 12,
            "{} bytes for {} intervals",
            block.data.len(),
            intervals.len()
        );
        let mut back = Vec::new();
        decode(&block.data, block.intervals, |s| back.push(s)).unwrap();
        let wall = |m: u64| m as i64 + offset;
        let expected: Vec<OffSlice> = intervals
            .iter()
            .map(|o| OffSlice {
                pid: o.pid,
                tid: o.tid,
                off_ns: wall(o.off_mono_ns),
                on_ns: wall(o.on_mono_ns),
                wakeup_ns: o.wakeup_mono_ns.map(wall),
                preempted: o.preempted,
            })
            .collect();
        assert_eq!(back, expected);
        assert_eq!(
            block.min_off_ns,
            expected.iter().map(|s| s.off_ns).min().unwrap()
        );
        assert_eq!(
            block.max_on_ns,
            expected.iter().map(|s| s.on_ns).max().unwrap()
        );
    }

    #[test]
    fn damaged_blocks_are_refused_not_misread() {
        let block = encode(&(0..20).map(interval).collect::<Vec<_>>(), 0);
        let cut = &block.data[..block.data.len() - 1];
        assert_eq!(
            decode(cut, 20, |_| {}),
            Err(BlockError::Truncated { call: 19 })
        );
        let mut extra = block.data.clone();
        extra.push(0);
        assert_eq!(
            decode(&extra, 20, |_| {}),
            Err(BlockError::Trailing { bytes: 1 })
        );
        let mut flags = block.data.clone();
        flags[0] |= 0x80;
        assert!(matches!(
            decode(&flags, 20, |_| {}),
            Err(BlockError::UnknownFields { call: 0, .. })
        ));
        // A pid delta that leaves u32.
        assert_eq!(
            decode(&[0, 1, 0, 2, 0], 1, |_| {}),
            Err(BlockError::BadValue { call: 0 })
        );
        assert!(decode(&[], MAX_INTERVALS + 1, |_| {}).is_err());
    }
}
