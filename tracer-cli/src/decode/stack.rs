//! Decoders of [`tracer_common::CallStackEvent`] and [`tracer_common::stack::CallPyEvent`]: the
//! call, then its call site as the kernel saw it (addresses, or the id of a native stack the
//! kernel keeps; symbolization is its own layer).

use tracer_common::{
    stack::{py_status, CallPyEvent, MAX_NATIVE_FRAMES, MAX_PY_FRAMES},
    CallStackEvent, PyStack,
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

/// A call's native stack: its return addresses, or the id under which the kernel keeps them
/// (`NATIVE_STACKS`, read once per id by the reader).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NativeStackRef {
    /// User return addresses, innermost first.
    Inline(Vec<u64>),
    Kept(i64),
}

/// A call site, unsymbolized.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RawSite {
    pub native: NativeStackRef,
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
    let (py_status, py) = python(&raw.py)?;
    call.site = Some(Box::new(RawSite {
        native: NativeStackRef::Inline(raw.native[..native_depth].to_vec()),
        py_status,
        py,
    }));
    Ok(call)
}

/// A call with its Python frames, its native stack kept by id. `raw` holds the record's bytes
/// (`len` of them, checked against its depth), the rest zero.
pub fn from_raw_py(raw: &CallPyEvent, len: usize) -> Result<Call, DecodeError> {
    let expected = CallPyEvent::len_for(raw.py.depth.min(MAX_PY_FRAMES as u32)) as usize;
    if raw.py.depth as usize > MAX_PY_FRAMES || len != expected {
        return Err(DecodeError::BadField {
            field: "py.depth",
            value: raw.py.depth.into(),
        });
    }
    if raw.call.stack_id < 0 {
        return Err(DecodeError::BadField {
            field: "stack_id",
            value: raw.call.stack_id as u64,
        });
    }
    let mut call = Call::from_raw(&raw.call)?;
    let (py_status, py) = python(&raw.py)?;
    call.site = Some(Box::new(RawSite {
        native: NativeStackRef::Kept(raw.call.stack_id),
        py_status,
        py,
    }));
    Ok(call)
}

fn python(raw: &PyStack) -> Result<(PyStatus, Vec<RawPyFrame>), DecodeError> {
    let py_depth = raw.depth as usize;
    if py_depth > MAX_PY_FRAMES {
        return Err(DecodeError::BadField {
            field: "py.depth",
            value: py_depth as u64,
        });
    }
    let py_status = match raw.status {
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
    let frames = raw.frames[..py_depth]
        .iter()
        .map(|f| RawPyFrame {
            code: f.code,
            instr: f.instr,
            entry: f.flags & tracer_common::stack::py_frame_flags::ENTRY != 0,
        })
        .collect();
    Ok((py_status, frames))
}
