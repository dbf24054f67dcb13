//! Decoder of [`tracer_common::CallEvent`].

use tracer_common::{
    call::{flags, DEVICE_UNKNOWN},
    ArgRole, CallEvent, Library, Op,
};

use super::DecodeError;

/// One CUDA call, as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    /// CLOCK_MONOTONIC nanoseconds at entry.
    pub ts_mono_ns: u64,
    pub pid: u32,
    pub tid: u32,
    pub op: Op,
    pub device: Option<i32>,
    pub ret: i32,
    pub duration_ns: u64,
    pub size: Option<u64>,
    pub ptr: Option<u64>,
    pub aux0: u64,
    pub aux1: u64,
    pub flags: u32,
    pub comm: String,
    /// The call site as the kernel sent it (--stack), until the reader interns it.
    pub site: Option<Box<super::RawSite>>,
    /// The call site's id: the reader's own until the writer stores the site, then stacks.id.
    pub stack: Option<i64>,
}

impl Call {
    pub fn from_raw(raw: &CallEvent) -> Result<Self, DecodeError> {
        let op = Op::from_u32(raw.op).ok_or(DecodeError::BadField {
            field: "op",
            value: raw.op.into(),
        })?;
        // PyTorch's allocator methods take the device as a signed byte (c10::DeviceIndex) and
        // flags as a bool: the rest of their registers is whatever was there.
        let spec = op.spec();
        let byte_args = spec.library == Library::Torch
            && !op.returns_status()
            && spec.args.contains(&ArgRole::Device);
        if raw.device < DEVICE_UNKNOWN && !byte_args {
            return Err(DecodeError::BadField {
                field: "device",
                value: raw.device as u64,
            });
        }
        let comm_len = raw
            .comm
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(raw.comm.len());
        let device = match raw.device {
            d if byte_args => Some(i32::from(d as i8)),
            DEVICE_UNKNOWN => None,
            d => Some(d),
        };
        let size = (raw.flags & flags::SIZE_KNOWN != 0).then_some(raw.size);
        Ok(Call {
            ts_mono_ns: raw.header.ts_ns,
            pid: raw.header.pid,
            tid: raw.header.tid,
            op,
            device,
            // A function returning nothing leaves whatever rax held.
            ret: if op.returns_status() { raw.ret } else { 0 },
            duration_ns: raw.duration_ns,
            size: if byte_args {
                size.map(|s| s & 0xff)
            } else {
                size
            },
            ptr: (raw.flags & flags::PTR_KNOWN != 0).then_some(raw.ptr),
            aux0: raw.aux0,
            aux1: raw.aux1,
            flags: raw.flags,
            comm: String::from_utf8_lossy(&raw.comm[..comm_len]).into_owned(),
            // Under --stack, a call from a process that is not Python: its native stack by id.
            site: (raw.stack_id >= 0).then(|| {
                Box::new(super::RawSite {
                    native: super::NativeStackRef::Kept(raw.stack_id),
                    py_status: super::PyStatus::NotPython,
                    py: Vec::new(),
                })
            }),
            stack: None,
        })
    }
}
