//! Messages the traced program produced at a probe (PyTorch's out-of-memory text).

use tracer_common::{
    usdt::{MessageEvent, MESSAGE_BYTES},
    Op,
};

use super::DecodeError;

/// A message, e.g. "CUDA out of memory. Tried to allocate 46.00 MiB. GPU 0 has ...".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// CLOCK_MONOTONIC nanoseconds when it was produced.
    pub ts_mono_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub op: Op,
    pub text: String,
    /// The text was longer than the record holds (cut at [`MESSAGE_BYTES`]).
    pub truncated: bool,
}

impl Message {
    pub fn from_raw(raw: &MessageEvent) -> Result<Self, DecodeError> {
        let op = Op::from_u32(raw.op).ok_or(DecodeError::BadField {
            field: "op",
            value: raw.op.into(),
        })?;
        let len = raw.len as usize;
        if len > MESSAGE_BYTES {
            return Err(DecodeError::BadField {
                field: "len",
                value: raw.len.into(),
            });
        }
        Ok(Message {
            ts_mono_ns: raw.header.ts_ns,
            pid: raw.header.pid,
            tid: raw.header.tid,
            op,
            text: String::from_utf8_lossy(&raw.text[..len]).into_owned(),
            truncated: raw.full_len > len as u64,
        })
    }
}
