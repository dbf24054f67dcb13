//! Turns raw ring-buffer records into owned values. Lengths and kinds are checked before any
//! field is read; nothing here needs privileges, so it is unit-tested directly.

mod batch;
mod call;
pub mod memory_snapshot;
pub mod pickle;
mod sched;
pub mod simlog;
mod stack;
mod usdt;

pub use batch::EventBytes;
pub use call::Call;
pub use sched::OffCpu;
pub use stack::{NativeStackRef, PyStatus, RawPyFrame, RawSite};
pub use usdt::Message;

use tracer_common::{
    stack::CallPyEvent, usdt::MessageEvent, CallEvent, CallStackEvent, EventHeader, EventKind,
    SchedEvent,
};

/// A decoded record.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Call(Call),
    OffCpu(OffCpu),
    Message(Message),
    /// A followed process ended.
    Exit {
        pid: u32,
        ts_mono_ns: u64,
    },
}

impl Record {
    /// When the kernel made the record (CLOCK_MONOTONIC ns): a call's return, the end of a
    /// time off the CPU, a message's or an exit's moment. The registry sees records in this
    /// order, whatever order the ring delivered them in.
    pub fn sent_ns(&self) -> u64 {
        match self {
            Record::Call(call) => call.ts_mono_ns.saturating_add(call.duration_ns),
            Record::OffCpu(off) => off.on_mono_ns,
            Record::Message(message) => message.ts_mono_ns,
            Record::Exit { ts_mono_ns, .. } => *ts_mono_ns,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// Shorter than the header.
    Truncated { len: usize },
    /// The header's kind is unknown to this tracer.
    UnknownKind(u32),
    /// The header's length disagrees with the bytes received or with the kind's size.
    BadLength {
        kind: u32,
        header_len: u32,
        actual: usize,
        expected: usize,
    },
    /// A field holds a value this tracer does not know (e.g. an op id).
    BadField { field: &'static str, value: u64 },
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Truncated { len } => write!(f, "record of {len} bytes is shorter than its header"),
            DecodeError::UnknownKind(kind) => write!(f, "unknown record kind {kind}"),
            DecodeError::BadLength { kind, header_len, actual, expected } => write!(
                f,
                "record kind {kind}: header says {header_len} bytes, got {actual}, expected {expected}"
            ),
            DecodeError::BadField { field, value } => write!(f, "field {field} has unknown value {value}"),
        }
    }
}

impl std::error::Error for DecodeError {}

/// Reads a `#[repr(C)]` plain-old-data value from the start of `bytes`.
fn read_pod<T: aya::Pod>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: the length was checked; T is Pod (any bit pattern is valid); read_unaligned
    // copes with the ring buffer's 8-byte alignment not matching T's.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// The bytes of a record as the kernel's programs write it (a Pod value of tracer-common).
pub fn pod_bytes<T: aya::Pod>(value: &T) -> &[u8] {
    // SAFETY: T is Pod: repr(C) plain data without padding, so every byte is initialised; the
    // slice borrows `value`.
    unsafe {
        std::slice::from_raw_parts((value as *const T).cast::<u8>(), std::mem::size_of::<T>())
    }
}

/// The length a record of `kind` must have; `header_len` for a kind whose length varies, when
/// in its range.
fn expected_len(kind: EventKind, header_len: u32) -> usize {
    match kind {
        EventKind::Call => std::mem::size_of::<CallEvent>(),
        EventKind::Sched => std::mem::size_of::<SchedEvent>(),
        EventKind::CallStack => std::mem::size_of::<CallStackEvent>(),
        EventKind::Message => std::mem::size_of::<MessageEvent>(),
        EventKind::Exit => std::mem::size_of::<tracer_common::sched::ExitEvent>(),
        EventKind::CallPy => {
            let frame = std::mem::size_of::<tracer_common::PyFrame>() as u32;
            let fits = (CallPyEvent::BASE_LEN..=CallPyEvent::MAX_LEN).contains(&header_len)
                && (header_len - CallPyEvent::BASE_LEN).is_multiple_of(frame);
            if fits {
                header_len as usize
            } else {
                CallPyEvent::MAX_LEN as usize
            }
        }
    }
}

/// A [`CallPyEvent`] from its first `len` bytes (the frames not sent read as zero).
fn read_call_py(bytes: &[u8], len: usize) -> Option<CallPyEvent> {
    let mut full = [0u8; std::mem::size_of::<CallPyEvent>()];
    full.get_mut(..len)?.copy_from_slice(bytes.get(..len)?);
    read_pod(&full)
}

pub fn decode(bytes: &[u8]) -> Result<Record, DecodeError> {
    let header: EventHeader = read_pod(bytes).ok_or(DecodeError::Truncated { len: bytes.len() })?;
    let kind = EventKind::from_u32(header.kind).ok_or(DecodeError::UnknownKind(header.kind))?;
    let expected = expected_len(kind, header.len);
    // The ring buffer may round a record up; the header's length is the truth.
    if header.len as usize != expected || bytes.len() < expected {
        return Err(DecodeError::BadLength {
            kind: header.kind,
            header_len: header.len,
            actual: bytes.len(),
            expected,
        });
    }
    match kind {
        EventKind::Call => {
            let raw: CallEvent =
                read_pod(bytes).ok_or(DecodeError::Truncated { len: bytes.len() })?;
            Call::from_raw(&raw).map(Record::Call)
        }
        EventKind::Sched => {
            let raw: SchedEvent =
                read_pod(bytes).ok_or(DecodeError::Truncated { len: bytes.len() })?;
            OffCpu::from_raw(&raw).map(Record::OffCpu)
        }
        EventKind::CallStack => {
            let raw: CallStackEvent =
                read_pod(bytes).ok_or(DecodeError::Truncated { len: bytes.len() })?;
            stack::from_raw(&raw).map(Record::Call)
        }
        EventKind::CallPy => {
            let raw =
                read_call_py(bytes, expected).ok_or(DecodeError::Truncated { len: bytes.len() })?;
            stack::from_raw_py(&raw, expected).map(Record::Call)
        }
        EventKind::Message => {
            let raw: MessageEvent =
                read_pod(bytes).ok_or(DecodeError::Truncated { len: bytes.len() })?;
            Message::from_raw(&raw).map(Record::Message)
        }
        EventKind::Exit => Ok(Record::Exit {
            pid: header.pid,
            ts_mono_ns: header.ts_ns,
        }),
    }
}

/// The event at the start of `bytes`: its length and when the kernel made it (as
/// [`Record::sent_ns`]), from the few fields that say so, without decoding the rest; None when
/// its header cannot be trusted ([`decode`] then says why).
pub fn frame(bytes: &[u8]) -> Option<(usize, u64)> {
    let header: EventHeader = read_pod(bytes)?;
    let kind = EventKind::from_u32(header.kind)?;
    let u64_at = |offset: usize| read_pod::<u64>(bytes.get(offset..)?);
    let call_end = |call: usize| {
        let duration = u64_at(call + std::mem::offset_of!(CallEvent, duration_ns))?;
        Some(header.ts_ns.saturating_add(duration))
    };
    let (expected, sent) = match kind {
        EventKind::Call => (std::mem::size_of::<CallEvent>(), call_end(0)?),
        EventKind::CallPy => (expected_len(kind, header.len), call_end(0)?),
        EventKind::CallStack => (
            std::mem::size_of::<CallStackEvent>(),
            call_end(std::mem::offset_of!(CallStackEvent, call))?,
        ),
        EventKind::Sched => (
            std::mem::size_of::<SchedEvent>(),
            u64_at(std::mem::offset_of!(SchedEvent, on_ns))?,
        ),
        EventKind::Message => (std::mem::size_of::<MessageEvent>(), header.ts_ns),
        EventKind::Exit => (
            std::mem::size_of::<tracer_common::sched::ExitEvent>(),
            header.ts_ns,
        ),
    };
    (header.len as usize == expected && bytes.len() >= expected).then_some((expected, sent))
}

/// Whether a ring record is a call with Python frames (--stack; such a record holds one event).
pub fn is_call_py(bytes: &[u8]) -> bool {
    read_pod::<EventHeader>(bytes).is_some_and(|h| h.kind == EventKind::CallPy as u32)
}

/// Whether one event (of [`events`]) must reach the registry without waiting for the next
/// round: a thread's first call of an op (a call event that carries the thread's name: a new
/// process's is read from /proc while it lives), or a message (PyTorch's out-of-memory error).
pub fn is_urgent(event: &[u8]) -> bool {
    let Some(header) = read_pod::<EventHeader>(event) else {
        return false;
    };
    let names_thread = || {
        event
            .get(std::mem::offset_of!(CallEvent, comm))
            .is_some_and(|&b| b != 0)
    };
    header.kind == EventKind::Message as u32
        || (header.kind == EventKind::Call as u32 && names_thread())
}

/// The events of one ring record (a single event, or a CPU's staged call events back to back,
/// each with its own header), each with when it was made ([`frame`]). Ends after the first
/// event whose header cannot be trusted, which is the error [`decode`] gives it: its length
/// cannot find the next.
pub fn events(bytes: &[u8]) -> impl Iterator<Item = Result<(&[u8], u64), DecodeError>> + '_ {
    let mut rest = Some(bytes);
    std::iter::from_fn(move || {
        let bytes = rest.take()?;
        // Nothing left, or zeros shorter than a header: the ring's rounding.
        if bytes.len() < std::mem::size_of::<EventHeader>() && bytes.iter().all(|&b| b == 0) {
            return None;
        }
        let Some((len, sent)) = frame(bytes) else {
            let error = decode(bytes).err();
            return Some(Err(
                error.unwrap_or(DecodeError::Truncated { len: bytes.len() })
            ));
        };
        let (event, after) = bytes.split_at(len);
        rest = Some(after);
        Some(Ok((event, sent)))
    })
}

/// Decodes one ring record's [`events`]; stops at the first that does not decode.
pub fn decode_all(bytes: &[u8]) -> impl Iterator<Item = Result<Record, DecodeError>> + '_ {
    let mut failed = false;
    events(bytes).map_while(move |event| {
        if failed {
            return None;
        }
        let record = event.and_then(|(event, _)| decode(event));
        failed = record.is_err();
        Some(record)
    })
}

#[cfg(test)]
mod tests;
