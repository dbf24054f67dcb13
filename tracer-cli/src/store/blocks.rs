//! Call blocks: a compact copy of a session's calls for `tracer explain`, written in the same
//! transaction as the `calls` rows they copy.
//!
//! Stepping through SQLite rows costs about half a microsecond per call per core, so reading ten
//! million rows alone takes seconds; a block packs up to [`MAX_CALLS`] calls into one BLOB that
//! is read in one go and decoded at a few tens of nanoseconds per call.
//!
//! Format 1, per call, in the writer's order: a presence byte ([`HAS_DEVICE`] ...), then LEB128
//! varints: op, entry time (zigzag delta from the previous call), duration, pid and tid (zigzag
//! deltas), return code (zigzag), then the present fields: device (zigzag), size, pointer (zigzag
//! delta from the previous pointer), aux0, aux1, stack id (zigzag delta). Deltas start from 0 in
//! each block, so every block decodes on its own.

use tracer_common::Op;

use crate::{
    decode::Call,
    model::{stack_id, Event, NO_DEVICE},
};

/// The format written into `call_blocks.format`; a reader that does not know a block's format
/// reads the session's rows instead.
pub const FORMAT: i64 = 1;

/// Calls per block at most: large enough that SQLite's per-row cost vanishes, small enough that
/// a session's blocks divide evenly among reader threads.
pub const MAX_CALLS: usize = 8192;

const HAS_DEVICE: u8 = 1;
const HAS_SIZE: u8 = 2;
const HAS_PTR: u8 = 4;
const HAS_AUX0: u8 = 8;
const HAS_AUX1: u8 = 16;
const HAS_STACK: u8 = 32;
const KNOWN: u8 = HAS_DEVICE | HAS_SIZE | HAS_PTR | HAS_AUX0 | HAS_AUX1 | HAS_STACK;

/// One encoded block and what its row records about it.
#[derive(Debug)]
pub struct Block {
    pub calls: usize,
    pub min_ts_ns: i64,
    pub max_ts_ns: i64,
    pub data: Vec<u8>,
}

pub(super) fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    (v >> 1) as i64 ^ -((v & 1) as i64)
}

pub(super) fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The most bytes one call takes in a block: its fields' bits and twelve varints.
const MAX_CALL_BYTES: usize = 1 + 12 * 10;

/// One call's bytes, written on the stack and copied into the block at once (a push per byte
/// into the block's vector, each checking its capacity, was most of the encoding's time).
struct CallBytes {
    buf: [u8; MAX_CALL_BYTES],
    len: usize,
}

impl Default for CallBytes {
    fn default() -> CallBytes {
        CallBytes {
            buf: [0; MAX_CALL_BYTES],
            len: 0,
        }
    }
}

impl CallBytes {
    /// As [`put`].
    fn put(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.buf[self.len] = v as u8 | 0x80;
            self.len += 1;
            v >>= 7;
        }
        self.buf[self.len] = v as u8;
        self.len += 1;
    }
}

/// A call as the model needs it, in wall-clock time as stored: what a block gives back for
/// it, and what the recording feeds the live layouts.
pub fn event_of(c: &Call, wall_offset_ns: i64) -> Event {
    Event {
        ts_ns: c.ts_mono_ns as i64 + wall_offset_ns,
        duration_ns: c.duration_ns,
        size: c.size.unwrap_or(0),
        ptr: c.ptr.unwrap_or(0),
        aux0: c.aux0,
        aux1: c.aux1,
        pid: c.pid,
        tid: c.tid,
        ret: c.ret,
        device: c.device.unwrap_or(NO_DEVICE),
        // Live, the call site's id local to this recording (the writer maps it to the stored one).
        stack: c.stack.and_then(crate::model::stack_id),
        op: c.op,
    }
}

/// Encodes `calls` (entry times on the monotonic clock, made wall-clock by `wall_offset_ns`).
pub fn encode(calls: &[Call], wall_offset_ns: i64) -> Block {
    let mut data = Vec::with_capacity(calls.len() * 24);
    let mut one = CallBytes::default();
    let (mut ts, mut pid, mut tid, mut ptr, mut stack) = (0i64, 0i64, 0i64, 0i64, 0i64);
    let (mut min_ts_ns, mut max_ts_ns) = (i64::MAX, i64::MIN);
    for c in calls {
        let wall = c.ts_mono_ns as i64 + wall_offset_ns;
        min_ts_ns = min_ts_ns.min(wall);
        max_ts_ns = max_ts_ns.max(wall);
        // The rows store aux values of 0 as NULL: so do blocks.
        let flag = |set: bool, bit: u8| if set { bit } else { 0 };
        let present = flag(c.device.is_some(), HAS_DEVICE)
            | flag(c.size.is_some(), HAS_SIZE)
            | flag(c.ptr.is_some(), HAS_PTR)
            | flag(c.aux0 != 0, HAS_AUX0)
            | flag(c.aux1 != 0, HAS_AUX1)
            | flag(c.stack.is_some(), HAS_STACK);
        one.buf[0] = present;
        one.len = 1;
        one.put(u64::from(c.op as u32));
        one.put(zigzag(wall.wrapping_sub(ts)));
        ts = wall;
        one.put(c.duration_ns);
        one.put(zigzag(i64::from(c.pid) - pid));
        pid = i64::from(c.pid);
        one.put(zigzag(i64::from(c.tid) - tid));
        tid = i64::from(c.tid);
        one.put(zigzag(i64::from(c.ret)));
        if let Some(device) = c.device {
            one.put(zigzag(i64::from(device)));
        }
        if let Some(size) = c.size {
            one.put(size);
        }
        if let Some(p) = c.ptr {
            one.put(zigzag((p as i64).wrapping_sub(ptr)));
            ptr = p as i64;
        }
        if c.aux0 != 0 {
            one.put(c.aux0);
        }
        if c.aux1 != 0 {
            one.put(c.aux1);
        }
        if let Some(s) = c.stack {
            one.put(zigzag(s.wrapping_sub(stack)));
            stack = s;
        }
        data.extend_from_slice(&one.buf[..one.len]);
    }
    Block {
        calls: calls.len(),
        min_ts_ns,
        max_ts_ns,
        data,
    }
}

/// Why a block could not be decoded.
#[derive(Debug, PartialEq, Eq)]
pub enum BlockError {
    Truncated {
        call: usize,
    },
    Overlong {
        call: usize,
    },
    UnknownFields {
        call: usize,
        bits: u8,
    },
    Trailing {
        bytes: usize,
    },
    /// A process or thread id out of range, or a time before 1970.
    BadValue {
        call: usize,
    },
    /// The row claims more calls than a block holds.
    TooMany {
        calls: usize,
    },
}

impl std::fmt::Display for BlockError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlockError::Truncated { call } => write!(f, "ends inside record {call}"),
            BlockError::Overlong { call } => {
                write!(f, "a number of record {call} is longer than 64 bits")
            }
            BlockError::UnknownFields { call, bits } => {
                write!(
                    f,
                    "record {call} has unknown fields (presence byte {bits:#04x})"
                )
            }
            BlockError::Trailing { bytes } => write!(f, "{bytes} bytes follow the last record"),
            BlockError::BadValue { call } => {
                write!(
                    f,
                    "record {call} has an impossible process id, thread id or time"
                )
            }
            BlockError::TooMany { calls } => {
                write!(
                    f,
                    "it claims {calls} records, more than a block holds ({MAX_CALLS})"
                )
            }
        }
    }
}

/// Reads a block's varints; `call` is the record being read, for the errors.
pub(super) struct Reader<'a> {
    pub(super) data: &'a [u8],
    pub(super) pos: usize,
    pub(super) call: usize,
}

impl Reader<'_> {
    #[inline]
    pub(super) fn byte(&mut self) -> Result<u8, BlockError> {
        let b = *self
            .data
            .get(self.pos)
            .ok_or(BlockError::Truncated { call: self.call })?;
        self.pos += 1;
        Ok(b)
    }

    #[inline(always)]
    pub(super) fn varint(&mut self) -> Result<u64, BlockError> {
        let mut v = 0u64;
        let mut shift = 0;
        loop {
            let b = self.byte()?;
            if shift == 63 && b > 1 {
                return Err(BlockError::Overlong { call: self.call });
            }
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(v);
            }
            shift += 7;
            if shift > 63 {
                return Err(BlockError::Overlong { call: self.call });
            }
        }
    }

    #[inline]
    pub(super) fn signed(&mut self) -> Result<i64, BlockError> {
        Ok(unzigzag(self.varint()?))
    }

    /// After the last record: nothing may follow it.
    pub(super) fn finish(&self) -> Result<(), BlockError> {
        match self.data.len() - self.pos {
            0 => Ok(()),
            bytes => Err(BlockError::Trailing { bytes }),
        }
    }
}

/// Decodes a block of `calls` calls, handing each to `emit` in block order. Calls of ops this
/// tracer does not know are skipped, as when reading rows.
pub fn decode(data: &[u8], calls: usize, mut emit: impl FnMut(Event)) -> Result<(), BlockError> {
    if calls > MAX_CALLS {
        return Err(BlockError::TooMany { calls });
    }
    let mut r = Reader {
        data,
        pos: 0,
        call: 0,
    };
    let (mut ts, mut pid, mut tid, mut ptr, mut stack) = (0i64, 0i64, 0i64, 0i64, 0i64);
    while r.call < calls {
        let present = r.byte()?;
        if present & !KNOWN != 0 {
            return Err(BlockError::UnknownFields {
                call: r.call,
                bits: present,
            });
        }
        let op = r.varint()?;
        ts = ts.wrapping_add(r.signed()?);
        let duration_ns = r.varint()?;
        // Deltas of a damaged or crafted block may overflow: wrap, and let the checks below
        // refuse what cannot be a process or thread id.
        pid = pid.wrapping_add(r.signed()?);
        tid = tid.wrapping_add(r.signed()?);
        let ret = r.signed()?;
        let device = if present & HAS_DEVICE != 0 {
            r.signed()? as i32
        } else {
            NO_DEVICE
        };
        let size = if present & HAS_SIZE != 0 {
            r.varint()?
        } else {
            0
        };
        if present & HAS_PTR != 0 {
            ptr = ptr.wrapping_add(r.signed()?);
        }
        let aux0 = if present & HAS_AUX0 != 0 {
            r.varint()?
        } else {
            0
        };
        let aux1 = if present & HAS_AUX1 != 0 {
            r.varint()?
        } else {
            0
        };
        if present & HAS_STACK != 0 {
            stack = stack.wrapping_add(r.signed()?);
        }
        r.call += 1;
        // Durations are kept whole: readers saturate (Event::end_ns).
        if u32::try_from(pid).is_err() || u32::try_from(tid).is_err() || ts < 0 {
            return Err(BlockError::BadValue { call: r.call - 1 });
        }
        let Some(op) = u32::try_from(op).ok().and_then(Op::from_u32) else {
            continue;
        };
        let event = Event {
            ts_ns: ts,
            duration_ns,
            size,
            ptr: if present & HAS_PTR != 0 {
                ptr as u64
            } else {
                0
            },
            aux0,
            aux1,
            pid: pid as u32,
            tid: tid as u32,
            ret: ret as i32,
            device,
            stack: if present & HAS_STACK != 0 {
                stack_id(stack)
            } else {
                None
            },
            op,
        };
        emit(event);
    }
    r.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(i: u64) -> Call {
        Call {
            ts_mono_ns: 5_000_000 + i * 1_000 - (i % 3) * 700,
            pid: 100 + (i % 2) as u32,
            tid: 200 + (i % 4) as u32,
            op: if i.is_multiple_of(2) {
                Op::CudaMalloc
            } else {
                Op::CudaFree
            },
            device: (!i.is_multiple_of(5)).then_some((i % 3) as i32),
            ret: if i == 7 { 2 } else { 0 },
            duration_ns: 60_000 + i,
            size: (i % 4 != 3).then_some(i << 20),
            ptr: (i % 6 != 5).then_some(0x7f00_0000_0000 + (i * 7919 % 13) * 4096),
            aux0: if i.is_multiple_of(9) { u64::MAX } else { 0 },
            aux1: i % 2,
            flags: 0,
            comm: String::new(),
            site: None,
            stack: (!i.is_multiple_of(3)).then_some((i % 5 + 1) as i64),
        }
    }

    #[test]
    fn round_trip_keeps_every_field_and_the_order() {
        let calls: Vec<Call> = (0..500).map(call).collect();
        let offset = 1_795_000_000_000_000_000;
        let block = encode(&calls, offset);
        assert_eq!(block.calls, 500);
        let want: Vec<Event> = calls.iter().map(|c| event_of(c, offset)).collect();
        assert_eq!(block.min_ts_ns, want.iter().map(|e| e.ts_ns).min().unwrap());
        assert_eq!(block.max_ts_ns, want.iter().map(|e| e.ts_ns).max().unwrap());
        let mut got = Vec::new();
        decode(&block.data, block.calls, |e| got.push(e)).unwrap();
        assert_eq!(got, want);
        // Compact: the deltas keep a typical call well under the 68 bytes of a row.
        assert!(block.data.len() < 500 * 24, "{} bytes", block.data.len());
    }

    #[test]
    fn extreme_values_survive() {
        let mut c = call(1);
        c.ts_mono_ns = u64::MAX / 2;
        c.duration_ns = u64::MAX;
        c.size = Some(u64::MAX);
        c.ptr = Some(u64::MAX);
        c.ret = i32::MIN;
        c.device = Some(i32::MAX);
        c.pid = u32::MAX;
        let mut d = call(2);
        d.ptr = Some(0);
        d.ts_mono_ns = 0;
        let block = encode(&[c.clone(), d.clone()], 0);
        let mut got = Vec::new();
        decode(&block.data, 2, |e| got.push(e)).unwrap();
        assert_eq!(got, vec![event_of(&c, 0), event_of(&d, 0)]);
    }

    #[test]
    fn damaged_blocks_are_refused_not_misread() {
        let calls: Vec<Call> = (0..20).map(call).collect();
        let block = encode(&calls, 0);
        let cut = &block.data[..block.data.len() - 1];
        assert!(matches!(
            decode(cut, 20, |_| {}),
            Err(BlockError::Truncated { call: 19 })
        ));
        assert_eq!(
            decode(&block.data, 19, |_| {}),
            Err(BlockError::Trailing {
                bytes: block.data.len() - encode(&calls[..19], 0).data.len()
            })
        );
        let mut unknown = block.data.clone();
        unknown[0] |= 0x80;
        assert_eq!(
            decode(&unknown, 20, |_| {}),
            Err(BlockError::UnknownFields {
                call: 0,
                bits: unknown[0]
            })
        );
        let overlong = [
            0u8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02,
        ];
        assert_eq!(
            decode(&overlong, 1, |_| {}),
            Err(BlockError::Overlong { call: 0 })
        );
    }

    #[test]
    fn unknown_ops_are_skipped() {
        let calls: Vec<Call> = (0..3).map(call).collect();
        let mut block = encode(&calls, 0);
        // The second call's op byte (after its presence byte) becomes an op from the future.
        let second = encode(&calls[..1], 0).data.len();
        block.data[second + 1] = 0x7f;
        let mut got = Vec::new();
        decode(&block.data, 3, |e| got.push(e)).unwrap();
        assert_eq!(got, vec![event_of(&calls[0], 0), event_of(&calls[2], 0)]);
    }
}
