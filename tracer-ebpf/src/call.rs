//! One entry and one return program serve every API in the probe table: the attach cookie says
//! which op fired, and `PLANS` says which argument means what. They do only what must be done
//! at the call: save the arguments, read the out-parameters, time it, send it. Joining a free
//! to its allocation's size and a call to its thread's device happens in userspace, from the
//! events themselves, which userspace puts back in the order they returned (each CPU's events
//! wait in its stage: stage.rs).

use aya_ebpf::{
    bindings::BPF_ANY,
    helpers::{
        bpf_get_attach_cookie, bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns,
        bpf_probe_read_user,
    },
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
    EbpfContext,
};
use tracer_common::{
    call::{flags, DEVICE_UNKNOWN},
    maps::{Counter, Inflight},
    probes::{ALLOC_PROP_DEVICE_OFFSET, MAX_ARGS, NO_ARG, OP_COUNT},
    CallEvent, EventHeader, OpPlan, PLANS,
};

use crate::{
    counters::bump,
    deliver::deliver,
    inflight::{save_inflight, take_inflight},
    maps::{entry_proceeds, floor_done, stack_enabled, SCHED_TIDS},
    stage::claim_stage,
};

#[inline(always)]
fn plan_for(cookie: u64) -> Option<(u32, &'static OpPlan)> {
    let op = cookie as usize;
    if op >= OP_COUNT {
        return None;
    }
    Some((op as u32, &PLANS[op]))
}

#[inline(always)]
fn arg_at(args: &[u64; MAX_ARGS], idx: u8) -> Option<u64> {
    if idx == NO_ARG || idx as usize >= MAX_ARGS {
        None
    } else {
        Some(args[idx as usize])
    }
}

#[inline(always)]
fn read_user_u64(addr: u64) -> Option<u64> {
    if addr == 0 {
        return None;
    }
    // SAFETY: bpf_probe_read_user validates the address; a fault returns an error.
    unsafe { bpf_probe_read_user(addr as *const u64).ok() }
}

/// (process id, thread id) of the caller.
#[inline(always)]
fn current_ids() -> (u32, u32) {
    let pid_tgid = bpf_get_current_pid_tgid();
    ((pid_tgid >> 32) as u32, pid_tgid as u32)
}

#[uprobe]
pub fn call_entry(ctx: ProbeContext) -> u32 {
    if !entry_proceeds() {
        return 0;
    }
    // SAFETY: the helper only reads the cookie of the perf link that fired.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let Some((op, plan)) = plan_for(cookie) else {
        return 0;
    };
    let tid = bpf_get_current_pid_tgid() as u32;
    let mut state = Inflight {
        // SAFETY: no preconditions.
        ts_ns: unsafe { bpf_ktime_get_ns() },
        args: [0; MAX_ARGS],
    };
    let mut i = 0;
    while i < MAX_ARGS {
        state.args[i] = ctx.arg::<u64>(i).unwrap_or(0);
        i += 1;
    }
    if (plan.caller_arg as usize) < MAX_ARGS {
        // At a function's first instruction the return address is on top of the stack.
        // SAFETY: `regs` is the probed thread's saved registers, valid for this program's run.
        let sp = unsafe { (*ctx.regs).rsp };
        state.args[plan.caller_arg as usize] = read_user_u64(sp).unwrap_or(0);
    }
    save_inflight(tid, op, &state);
    0
}

/// What the return program learns of a call beyond its arguments.
struct Outcome {
    size: u64,
    ptr: u64,
    aux0: u64,
    aux1: u64,
    device: i32,
    flags: u32,
}

/// Reads a user-space u64 out-parameter into `dst`, or flags the failed read.
#[inline(always)]
fn read_out(addr: Option<u64>, dst: &mut u64, flags_out: &mut u32) -> bool {
    let Some(out) = addr else {
        return false;
    };
    match read_user_u64(out) {
        Some(v) => {
            *dst = v;
            true
        }
        None => {
            *flags_out |= flags::READ_FAILED;
            false
        }
    }
}

/// Size, pointer, auxiliary values and the device the call names, from the arguments and, for
/// a successful call, its out-parameters.
#[inline(always)]
fn outcome(args: &[u64; MAX_ARGS], plan: &OpPlan, ok: bool) -> Outcome {
    let mut o = Outcome {
        size: 0,
        ptr: 0,
        aux0: arg_at(args, plan.aux0_arg).unwrap_or(0),
        aux1: arg_at(args, plan.aux1_arg).unwrap_or(0),
        device: DEVICE_UNKNOWN,
        flags: 0,
    };
    if let Some(s) = arg_at(args, plan.size_arg) {
        o.size = s;
        o.flags |= flags::SIZE_KNOWN;
    }
    if let Some(p) = arg_at(args, plan.ptr_arg) {
        o.ptr = p;
        o.flags |= flags::PTR_KNOWN;
    }
    if !ok {
        if let Some(d) = arg_at(args, plan.device_arg) {
            // A failed cudaSetDevice still says which device was asked for.
            o.aux0 = d;
        }
        return o;
    }
    if read_out(arg_at(args, plan.ptr_out_arg), &mut o.ptr, &mut o.flags) {
        o.flags |= flags::PTR_KNOWN;
    }
    let mut pitch = 0;
    if read_out(arg_at(args, plan.pitch_out_arg), &mut pitch, &mut o.flags) {
        o.aux0 = pitch;
        o.size = pitch.wrapping_mul(arg_at(args, plan.height_arg).unwrap_or(0));
        o.flags |= flags::SIZE_KNOWN;
    }
    read_out(arg_at(args, plan.free_out_arg), &mut o.aux0, &mut o.flags);
    read_out(arg_at(args, plan.total_out_arg), &mut o.aux1, &mut o.flags);
    if let Some(d) = arg_at(args, plan.device_arg) {
        o.device = d as i32;
    }
    // cuMemCreate names the device in its properties, whatever the thread's context.
    if let Some(prop) = arg_at(args, plan.prop_arg).filter(|&p| p != 0) {
        let at = (prop + ALLOC_PROP_DEVICE_OFFSET) as *const i32;
        // SAFETY: bpf_probe_read_user validates the address; a fault returns an error.
        match unsafe { bpf_probe_read_user(at) } {
            Ok(d) => o.device = d,
            Err(_) => o.flags |= flags::READ_FAILED,
        }
    }
    o
}

#[uretprobe]
pub fn call_return(ctx: RetProbeContext) -> u32 {
    if floor_done() {
        return 0;
    }
    // SAFETY: as in call_entry.
    let cookie = unsafe { bpf_get_attach_cookie(ctx.as_ptr()) };
    let Some((op, plan)) = plan_for(cookie) else {
        return 0;
    };
    let (pid, tid) = current_ids();
    let Some((state, send_comm)) = take_inflight(tid, op) else {
        return 0;
    };
    let stack = stack_enabled();
    // Claimed before the clock is read: a flush that finds the stage free knows that every
    // event of this CPU that returned before it is in the ring (see `flush_stage`).
    let stage = claim_stage();
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let ret: i32 = ctx.ret::<u64>() as i32;
    let o = outcome(&state.args, plan, ret == 0);
    let comm = if send_comm {
        // First event of this (thread, op): let the scheduler programs follow the thread.
        if SCHED_TIDS.insert(&tid, &pid, BPF_ANY as u64).is_err() {
            bump(Counter::MapInsertFailed);
        }
        bpf_get_current_comm().unwrap_or([0; 16])
    } else {
        [0; 16]
    };
    let event = CallEvent {
        header: EventHeader {
            kind: CallEvent::KIND as u32,
            len: CallEvent::LEN,
            ts_ns: state.ts_ns,
            pid,
            tid,
        },
        op,
        device: o.device,
        ret,
        flags: o.flags,
        duration_ns: now.wrapping_sub(state.ts_ns),
        size: o.size,
        ptr: o.ptr,
        aux0: o.aux0,
        aux1: o.aux1,
        stack_id: -1,
        comm,
    };
    deliver(&ctx, stage, stack, &event, send_comm);
    0
}
