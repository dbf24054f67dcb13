//! Decoder of [`tracer_common::CallStackEvent`]: the call, then its call site as the kernel saw
//! it (addresses only; symbolization is its own layer).

use tracer_common::{
    stack::{py_status, MAX_NATIVE_FRAMES, MAX_PY_FRAMES},
    CallStackEvent,
};

use super::{Call, DecodeError};

/// Whether and how the calling thread's Python frames were read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PyStatus {
    NotPython,
    Ok,
    NoThreadState,
    ReadFailed,
    Truncated,
}

impl PyStatus {
    pub fn name(self) -> &'static str {
        match self {
            PyStatus::NotPython => "not python",
            PyStatus::Ok => "ok",
            PyStatus::NoThreadState => "no python thread",
            PyStatus::ReadFailed => "unreadable",
            PyStatus::Truncated => "truncated",
        }
    }
}

/// One interpreter frame: its code object and instruction (see [`tracer_common::PyFrame`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RawPyFrame {
    pub code: u64,
    pub instr: u64,
    /// Entered from C: native frames separate it from the next outer frame.
    pub entry: bool,
}

/// A call site, unsymbolized.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RawSite {
    /// User return addresses, innermost first.
    pub native: Vec<u64>,
    pub py_status: PyStatus,
    /// Innermost first.
    pub py: Vec<RawPyFrame>,
}

pub fn from_raw(raw: &CallStackEvent) -> Result<Call, DecodeError> {
    let mut call = Call::from_raw(&raw.call)?;
    let native_depth = raw.native_depth as usize;
    if native_depth > MAX_NATIVE_FRAMES {
        return Err(DecodeError::BadField {
            field: "native_depth",
            value: native_depth as u64,
        });
    }
    let py_depth = raw.py.depth as usize;
    if py_depth > MAX_PY_FRAMES {
        return Err(DecodeError::BadField {
            field: "py.depth",
            value: py_depth as u64,
        });
    }
    let py_status = match raw.py.status {
        py_status::NOT_PYTHON => PyStatus::NotPython,
        py_status::OK => PyStatus::Ok,
        py_status::NO_THREAD_STATE => PyStatus::NoThreadState,
        py_status::READ_FAILED => PyStatus::ReadFailed,
        py_status::TRUNCATED => PyStatus::Truncated,
        other => {
            return Err(DecodeError::BadField {
                field: "py.status",
                value: other.into(),
            })
        }
    };
    call.site = Some(Box::new(RawSite {
        native: raw.native[..native_depth].to_vec(),
        py_status,
        py: raw.py.frames[..py_depth]
            .iter()
            .map(|f| RawPyFrame {
                code: f.code,
                instr: f.instr,
                entry: f.flags & tracer_common::stack::py_frame_flags::ENTRY != 0,
            })
            .collect(),
    }));
    Ok(call)
}
