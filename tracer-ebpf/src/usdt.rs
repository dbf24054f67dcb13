//! One program serves every USDT site: the attach cookie indexes the site's plan, which says
//! where each argument lives (a register, memory at a register plus a displacement, or a
//! constant; how wide; signed or not) and what it means. And the uprobe at PyTorch's
//! OutOfMemoryError constructor, which sends the message the user sees.

use core::mem::MaybeUninit;

use aya_ebpf::{
    bindings::BPF_RB_NO_WAKEUP,
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user,
    },
    macros::{map, uprobe},
    maps::{Array, PerCpuArray},
    programs::ProbeContext,
    EbpfContext,
};
use tracer_common::{
    call::DEVICE_UNKNOWN,
    maps::{Counter, FLOOR_USDT_PARTS},
    usdt::{
        arg_kind, role, MessageEvent, UsdtArg, UsdtPlan, MAX_USDT_ARGS, MAX_USDT_SITES,
        MESSAGE_BYTES, OOM_MESSAGE_PREFIX, OOM_MESSAGE_WORDS,
    },
    CallEvent, EventHeader, Op,
};

use crate::{
    counters::bump,
    deliver::deliver,
    maps::{floor_done, global, paused, stack_enabled, EVENTS, FLOOR_MODE},
    stage::{claim_stage, commit_slot, next_slot, release_stage},
};

#[map(name = "USDT_PLANS")]
static USDT_PLANS: Array<UsdtPlan> = Array::with_max_entries(MAX_USDT_SITES, 0);

/// A message is built here (too large for the stack) before it is copied to the ring.
#[map(name = "MESSAGE_BUF")]
static MESSAGE_BUF: PerCpuArray<MessageEvent> = PerCpuArray::with_max_entries(1, 0);

/// Register `reg` (a pt_regs index) of the probed thread.
#[inline(always)]
fn register(ctx: &ProbeContext, reg: u8) -> u64 {
    // SAFETY: the context's registers, valid for this run; each arm reads one fixed field.
    let r = unsafe { &*ctx.regs };
    match reg {
        0 => r.r15,
        1 => r.r14,
        2 => r.r13,
        3 => r.r12,
        4 => r.rbp,
        5 => r.rbx,
        6 => r.r11,
        7 => r.r10,
        8 => r.r9,
        9 => r.r8,
        10 => r.rax,
        11 => r.rcx,
        12 => r.rdx,
        13 => r.rsi,
        14 => r.rdi,
        16 => r.rip,
        19 => r.rsp,
        _ => 0,
    }
}

/// `size` bytes of user memory at `addr`, zero-extended.
#[inline(always)]
fn read_user(addr: u64, size: u8) -> Option<u64> {
    // SAFETY: bpf_probe_read_user validates the address; a fault returns an error.
    unsafe {
        match size {
            1 => bpf_probe_read_user(addr as *const u8).ok().map(u64::from),
            2 => bpf_probe_read_user(addr as *const u16).ok().map(u64::from),
            4 => bpf_probe_read_user(addr as *const u32).ok().map(u64::from),
            _ => bpf_probe_read_user(addr as *const u64).ok(),
        }
    }
}

/// The argument's value, narrowed to its size and sign-extended when signed.
#[inline(always)]
fn fetch(ctx: &ProbeContext, a: &UsdtArg) -> Option<u64> {
    let raw = match a.kind {
        arg_kind::CONST => a.offset as u64,
        arg_kind::REG => register(ctx, a.reg),
        arg_kind::MEM => read_user(register(ctx, a.reg).wrapping_add(a.offset as u64), a.size)?,
        _ => return None,
    };
    Some(match (a.size, a.signed != 0) {
        (1, true) => raw as i8 as i64 as u64,
        (1, false) => raw as u8 as u64,
        (2, true) => raw as i16 as i64 as u64,
        (2, false) => raw as u16 as u64,
        (4, true) => raw as i32 as i64 as u64,
        (4, false) => raw as u32 as u64,
        _ => raw,
    })
}

/// Every part of [`usdt_hit`] (the bench's `--usdt-parts` stops after fewer).
const ALL_PARTS: u32 = 5;

/// How many of [`usdt_hit`]'s parts to do: all, none on the floors (their work done here).
#[inline(always)]
fn usdt_parts() -> u32 {
    let floor = global(&FLOOR_MODE);
    if floor > FLOOR_USDT_PARTS {
        return floor - FLOOR_USDT_PARTS;
    }
    if floor_done() {
        0
    } else {
        ALL_PARTS
    }
}

/// Frees the stage claimed by a run the bench stops early.
#[inline(always)]
fn stop_early(stage: Option<*mut tracer_common::maps::Stage>) -> u32 {
    if let Some(stage) = stage {
        release_stage(stage);
    }
    0
}

#[uprobe]
pub fn usdt_hit(ctx: ProbeContext) -> u32 {
    if paused() {
        return 0;
    }
    bump(Counter::Entries);
    // On the benchmark's floors: the bare probe at the site, or with the one clock read an
    // event's time needs; with --usdt-parts, its first parts.
    let parts = usdt_parts();
    if parts == 0 {
        return 0;
    }
    // Part 1: the site's plan.
    // SAFETY: the helper only reads the cookie of the perf link that fired.
    let site = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) } as u32;
    let Some(plan) = USDT_PLANS.get(site) else {
        return 0;
    };
    if parts == 1 {
        return 0;
    }
    // Part 2: the thread, and this CPU's stage, claimed before the clock is read as the return
    // program does (stage::flush_stage).
    let pid_tgid = bpf_get_current_pid_tgid();
    let stack = stack_enabled();
    let stage = claim_stage();
    if parts == 2 {
        return stop_early(stage);
    }
    // Part 3: the clock. Part 4: the arguments. Part 5: to the stage (or the call-site
    // program). Written in place in the stage's next slot when there is one to write (no copy),
    // else here and handed over.
    let slot = match (stack, stage) {
        (false, Some(stage)) => next_slot(stage),
        _ => None,
    };
    let mut local = MaybeUninit::<CallEvent>::uninit();
    // SAFETY: the slot is the claimed stage's next free one, this CPU's, written by this run
    // only; `local` is written whole by `begin_event` before any read.
    let event = unsafe { &mut *slot.unwrap_or(local.as_mut_ptr()) };
    begin_event(event, plan.op, pid_tgid);
    if parts == 3 {
        return stop_early(stage);
    }
    read_args(&ctx, plan, event);
    if parts == 4 {
        return stop_early(stage);
    }
    match (slot, stage) {
        // A block event names no thread: never urgent.
        (Some(_), Some(stage)) => commit_slot(stage, false),
        // Under --stack, the call site of a block: who holds the memory.
        _ => deliver(&ctx, stage, stack, event, false),
    }
    0
}

/// Every field of a block event but its arguments' (the clock read here).
#[inline(always)]
fn begin_event(event: &mut CallEvent, op: u32, pid_tgid: u64) {
    *event = CallEvent {
        header: EventHeader {
            kind: CallEvent::KIND as u32,
            len: CallEvent::LEN,
            // SAFETY: no preconditions.
            ts_ns: unsafe { bpf_ktime_get_ns() },
            pid: (pid_tgid >> 32) as u32,
            tid: pid_tgid as u32,
        },
        op,
        device: DEVICE_UNKNOWN,
        ret: 0,
        flags: 0,
        duration_ns: 0,
        size: 0,
        ptr: 0,
        aux0: 0,
        aux1: 0,
        stack_id: -1,
        comm: [0; 16],
    };
}

/// The site's arguments, each where its plan says, into the fields their roles name.
#[inline(always)]
fn read_args(ctx: &ProbeContext, plan: &UsdtPlan, event: &mut CallEvent) {
    let mut i = 0;
    while i < MAX_USDT_ARGS {
        if i as u32 >= plan.nargs {
            break;
        }
        let Some(v) = fetch(ctx, &plan.args[i]) else {
            event.flags |= tracer_common::call::flags::READ_FAILED;
            i += 1;
            continue;
        };
        match plan.roles[i] {
            role::PTR => {
                event.ptr = v;
                event.flags |= tracer_common::call::flags::PTR_KNOWN;
            }
            role::DEVICE => event.device = v as i32,
            role::SIZE => {
                event.size = v;
                event.flags |= tracer_common::call::flags::SIZE_KNOWN;
            }
            role::STREAM => event.aux0 = v,
            _ => {}
        }
        i += 1;
    }
}

/// The message at `data` (`len` bytes) is PyTorch's out-of-memory message.
#[inline(always)]
fn out_of_memory(data: u64, len: u64) -> bool {
    let (w0, w1, w2) = OOM_MESSAGE_WORDS;
    len >= OOM_MESSAGE_PREFIX.len() as u64
        && read_user(data, 8) == Some(w0)
        && read_user(data.wrapping_add(8), 8) == Some(w1)
        && read_user(data.wrapping_add(16), 2) == Some(w2)
}

/// `c10::Error::Error(SourceLocation, std::string)`, which PyTorch's OutOfMemoryError (built
/// inline in the real wheels) goes through: the second register argument points at the
/// message, a libstdc++ std::string (data pointer, then length). Only out-of-memory messages
/// are kept ([`OOM_MESSAGE_PREFIX`]), compared here.
#[uprobe]
pub fn torch_oom(ctx: ProbeContext) -> u32 {
    if paused() {
        return 0;
    }
    let msg: u64 = ctx.arg(1).unwrap_or(0);
    let data = read_user(msg, 8).unwrap_or(0);
    let full_len = read_user(msg.wrapping_add(8), 8).unwrap_or(0);
    if !out_of_memory(data, full_len) {
        return 0;
    }
    bump(Counter::Entries);
    let Some(buf) = MESSAGE_BUF.get_ptr_mut(0) else {
        return 0;
    };
    let pid_tgid = bpf_get_current_pid_tgid();
    // SAFETY: this CPU's buffer, valid for this run.
    let ev = unsafe { &mut *buf };
    ev.header = EventHeader {
        kind: MessageEvent::KIND as u32,
        len: MessageEvent::LEN,
        // SAFETY: no preconditions.
        ts_ns: unsafe { bpf_ktime_get_ns() },
        pid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
    };
    ev.op = Op::TorchOom as u32;
    ev.full_len = full_len;
    let len = if full_len < MESSAGE_BYTES as u64 {
        full_len as usize
    } else {
        MESSAGE_BYTES
    };
    // The verifier needs the length bounded and non-zero for the helper.
    let len = len & (MESSAGE_BYTES * 2 - 1);
    ev.len = 0;
    if data != 0 && len > 0 && len <= MESSAGE_BYTES {
        // SAFETY: the destination is the buffer's own text array, at least `len` bytes; the
        // helper validates the user address.
        let read = unsafe {
            aya_ebpf::helpers::generated::bpf_probe_read_user(
                ev.text.as_mut_ptr() as *mut _,
                len as u32,
                data as *const _,
            )
        };
        if read == 0 {
            ev.len = len as u32;
        }
    }
    if EVENTS
        .output::<MessageEvent>(&*ev, BPF_RB_NO_WAKEUP as u64)
        .is_err()
    {
        bump(Counter::RingFull);
        return 0;
    }
    bump(Counter::Submitted);
    0
}
