//! USDT probes (sys/sdt.h sites): the plan the generic USDT program follows at each site, built
//! in userspace from the site's note (where each argument lives) and the probe table (what each
//! argument means), and the message record of PyTorch's out-of-memory error.

use crate::event::{EventHeader, EventKind};

/// Arguments read per site (PyTorch's malloc has four; sys/sdt.h allows twelve).
pub const MAX_USDT_ARGS: usize = 6;
/// Sites the plan map holds.
pub const MAX_USDT_SITES: u32 = 1024;

/// Where a USDT argument lives ([`UsdtArg::kind`]).
pub mod arg_kind {
    pub const NONE: u8 = 0;
    /// A constant (`$5`): [`super::UsdtArg::offset`] is the value.
    pub const CONST: u8 = 1;
    /// A register (`%rax`, `%al`, ...).
    pub const REG: u8 = 2;
    /// Memory at a register plus a displacement (`-56(%rbp)`).
    pub const MEM: u8 = 3;
}

/// Registers, by their index in the kernel's x86-64 `struct pt_regs` (8 bytes each).
pub mod reg {
    pub const R15: u8 = 0;
    pub const R14: u8 = 1;
    pub const R13: u8 = 2;
    pub const R12: u8 = 3;
    pub const RBP: u8 = 4;
    pub const RBX: u8 = 5;
    pub const R11: u8 = 6;
    pub const R10: u8 = 7;
    pub const R9: u8 = 8;
    pub const R8: u8 = 9;
    pub const RAX: u8 = 10;
    pub const RCX: u8 = 11;
    pub const RDX: u8 = 12;
    pub const RSI: u8 = 13;
    pub const RDI: u8 = 14;
    pub const RIP: u8 = 16;
    pub const RSP: u8 = 19;
}

/// One argument of a site: how to fetch it, and how wide and signed it is.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtArg {
    /// An [`arg_kind`] value.
    pub kind: u8,
    /// A [`reg`] index (REG and MEM).
    pub reg: u8,
    /// Bytes: 1, 2, 4 or 8.
    pub size: u8,
    /// 1 when the value is signed (the note's size is negative).
    pub signed: u8,
    pub _pad: u32,
    /// The constant (CONST) or the displacement (MEM).
    pub offset: i64,
}

/// What the USDT program does at one site (indexed by the attach cookie).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UsdtPlan {
    /// The [`crate::Op`] the site reports.
    pub op: u32,
    pub nargs: u32,
    /// Per argument, what it means: a [`crate::probes::ArgRole`] as [`role`] codes.
    pub roles: [u8; MAX_USDT_ARGS],
    pub _pad: [u8; 2],
    pub args: [UsdtArg; MAX_USDT_ARGS],
}

/// [`UsdtPlan::roles`] codes.
pub mod role {
    pub const IGNORED: u8 = 0;
    pub const PTR: u8 = 1;
    pub const DEVICE: u8 = 2;
    pub const SIZE: u8 = 3;
    /// Stored in aux0.
    pub const STREAM: u8 = 4;
}

/// Bytes of an out-of-memory message kept (PyTorch's are about 400).
pub const MESSAGE_BYTES: usize = 1024;

/// How PyTorch's out-of-memory messages begin. The real wheels build OutOfMemoryError inline
/// from c10::Error's constructor, which every c10 error goes through: only messages that begin
/// so are kept (the program compares them in the kernel, so other errors' texts never leave
/// it).
pub const OOM_MESSAGE_PREFIX: &[u8; 18] = b"CUDA out of memory";

/// [`OOM_MESSAGE_PREFIX`] as the program reads it: two 8-byte little-endian words and a
/// 2-byte one.
pub const OOM_MESSAGE_WORDS: (u64, u64, u64) = (
    word(OOM_MESSAGE_PREFIX, 0, 8),
    word(OOM_MESSAGE_PREFIX, 8, 8),
    word(OOM_MESSAGE_PREFIX, 16, 2),
);

const fn word(bytes: &[u8], at: usize, len: usize) -> u64 {
    let mut v = 0u64;
    let mut i = 0;
    while i < len {
        v |= (bytes[at + i] as u64) << (8 * i);
        i += 1;
    }
    v
}

/// A text the traced program produced at a probe: PyTorch's OutOfMemoryError message.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MessageEvent {
    pub header: EventHeader,
    /// The [`crate::Op`] that produced it.
    pub op: u32,
    /// Bytes of `text` that hold the message (it is cut at [`MESSAGE_BYTES`]).
    pub len: u32,
    /// The message's full length, when the program said it.
    pub full_len: u64,
    pub text: [u8; MESSAGE_BYTES],
}

impl MessageEvent {
    pub const LEN: u32 = core::mem::size_of::<Self>() as u32;
    pub const KIND: EventKind = EventKind::Message;
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: each is repr(C), only integers and byte arrays, with explicit padding fields.
    unsafe impl aya::Pod for super::UsdtArg {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::UsdtPlan {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::MessageEvent {}
}

#[cfg(test)]
mod tests {
    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(core::mem::size_of::<super::UsdtArg>(), 16);
        assert_eq!(
            core::mem::size_of::<super::UsdtPlan>(),
            16 + 16 * super::MAX_USDT_ARGS
        );
        assert_eq!(
            core::mem::size_of::<super::MessageEvent>(),
            24 + 16 + super::MESSAGE_BYTES
        );
    }
}
