//! Discovery in the kernel (issue 52): every `openat` of a file named like a probed library
//! (tracer_common::libwatch::WATCHED) is remembered at entry and sent to userspace when it
//! succeeds; a process opening a path not yet probed is stopped before the open returns to it,
//! so that userspace attaches by file before the library is even mapped, then continues it.

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_task, bpf_ktime_get_ns,
        bpf_probe_read_kernel, bpf_probe_read_user_str_bytes,
    },
    macros::{map, tracepoint},
    maps::{Array, HashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use tracer_common::{
    libwatch::{self, Hold, LibOpen, PATH_LEN},
    maps as names,
};

use crate::maps::global;

#[map(name = "LIB_OPENS")]
static LIB_OPENS: RingBuf = RingBuf::with_byte_size(names::LIB_OPENS_BYTES, 0);

/// tid -> the open under way (its path and time), from entry to exit.
#[map(name = "LIB_PENDING")]
static LIB_PENDING: HashMap<u32, LibOpen> =
    HashMap::with_max_entries(names::LIB_PENDING_ENTRIES, 0);

/// Paths (NUL-padded) whose file tracer has probed: a process opening one is not stopped.
#[map(name = "LIB_KNOWN")]
static LIB_KNOWN: HashMap<[u8; PATH_LEN], u32> =
    HashMap::with_max_entries(names::LIB_KNOWN_ENTRIES, 0);

/// Where an open's path is read to (too large for the stack beside the rest).
#[map(name = "LIB_SCRATCH")]
static LIB_SCRATCH: PerCpuArray<LibOpen> = PerCpuArray::with_max_entries(1, 0);

/// Slot [`names::LIB_HOLD_UNTIL`]: processes are stopped only before this CLOCK_MONOTONIC
/// time, which userspace keeps renewing while it is there to continue them (a tracer that died
/// stops nobody for long).
#[map(name = "LIB_STATE")]
static LIB_STATE: Array<u64> = Array::with_max_entries(names::LIB_STATE_SLOTS, 0);

/// Per CPU, slots [`names::LIB_LOST_RING`] and [`names::LIB_LOST_PENDING`]: opens not sent,
/// the ring or the pending map full.
#[map(name = "LIB_LOST")]
static LIB_LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(names::LIB_LOST_SLOTS, 0);

/// Offsets set by userspace at load: the tracepoints' fields (tracefs) and task_struct's
/// members (the kernel's BTF; 0 when unknown: then nobody is stopped).
#[unsafe(no_mangle)]
static OPENAT_FILENAME_OFF: u32 = 24;
#[unsafe(no_mangle)]
static OPENAT_RET_OFF: u32 = 16;
#[unsafe(no_mangle)]
static OPENAT_FLAGS_OFF: u32 = 32;
#[unsafe(no_mangle)]
static TASK_REAL_PARENT_OFF: u32 = 0;
#[unsafe(no_mangle)]
static TASK_COMM_OFF: u32 = 0;
#[unsafe(no_mangle)]
static TASK_PTRACE_OFF: u32 = 0;
#[unsafe(no_mangle)]
static TASK_SIGNAL_OFF: u32 = 0;
#[unsafe(no_mangle)]
static SIGNAL_PGID_OFF: u32 = 0;
#[unsafe(no_mangle)]
static PID_NR_OFF: u32 = 0;
/// tracer's own process: its opens (reading a library's symbols) are not watched.
#[unsafe(no_mangle)]
static SELF_TGID: u32 = 0;

const SIGSTOP: u32 = 19;
/// open(2)'s access mode bits: a loader opens read-only; an installer or a copy writing the
/// file is not loading it.
const O_ACCMODE: u64 = 3;

#[tracepoint]
pub fn lib_open_enter(ctx: TracePointContext) -> u32 {
    let Some(ev) = LIB_SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: the per-CPU slot is this program's alone while it runs.
    let ev = unsafe { &mut *ev };
    // SAFETY: reads within the tracepoint record, at the offsets its format file gives.
    let Ok(flags) = (unsafe { ctx.read_at::<u64>(global(&OPENAT_FLAGS_OFF) as usize) }) else {
        return 0;
    };
    if flags & O_ACCMODE != 0 {
        return 0;
    }
    // SAFETY: as above.
    let Ok(name) = (unsafe { ctx.read_at::<u64>(global(&OPENAT_FILENAME_OFF) as usize) }) else {
        return 0;
    };
    // SAFETY: the helper reads user memory and bounds the copy to the slice.
    let Ok(len) = (unsafe { bpf_probe_read_user_str_bytes(name as *const u8, &mut ev.path) })
        .map(<[u8]>::len)
    else {
        return 0;
    };
    if !libwatch::is_watched(&ev.path, len) {
        return 0;
    }
    // The path is a map key: what follows its NUL must be the same every time, so it is read
    // again into zeroes (only for the few opens watched).
    ev.path = [0; PATH_LEN];
    // SAFETY: as above.
    if unsafe { bpf_probe_read_user_str_bytes(name as *const u8, &mut ev.path) }.is_err() {
        return 0;
    }
    let id = bpf_get_current_pid_tgid();
    if (id >> 32) as u32 == global(&SELF_TGID) {
        return 0;
    }
    // SAFETY: no preconditions.
    ev.ts_ns = unsafe { bpf_ktime_get_ns() };
    ev.pid = (id >> 32) as u32;
    ev.tid = id as u32;
    ev.fd = -1;
    ev.hold = Hold::Known as u32;
    ev.comm = bpf_get_current_comm().unwrap_or([0; 16]);
    let tid = ev.tid;
    if LIB_PENDING.insert(&tid, &*ev, 0).is_err() {
        add(names::LIB_LOST_PENDING, 1);
    }
    0
}

#[tracepoint]
pub fn lib_open_exit(ctx: TracePointContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    let Some(pending) = LIB_PENDING.get_ptr(&tid) else {
        return 0;
    };
    // SAFETY: a read within the tracepoint record, at the offset its format file gives.
    let ret: i64 = unsafe { ctx.read_at(global(&OPENAT_RET_OFF) as usize) }.unwrap_or(-1);
    if ret >= 0 {
        send(pending, ret as i32);
    }
    let _ = LIB_PENDING.remove(&tid);
    0
}

/// Sends the open to userspace, stopping the process first when it must wait.
#[inline(always)]
fn send(pending: *const LibOpen, fd: i32) {
    let Some(mut entry) = LIB_OPENS.reserve::<LibOpen>(0) else {
        add(names::LIB_LOST_RING, 1);
        return;
    };
    let out = entry.as_mut_ptr();
    // SAFETY: both point to a whole LibOpen: the map's value and the ring's reservation.
    unsafe { core::ptr::copy_nonoverlapping(pending, out, 1) };
    // SAFETY: the reservation was just filled.
    let ev = unsafe { &mut *out };
    ev.fd = fd;
    let hold = if libwatch::is_tracer_comm(&ev.comm) {
        Hold::Tracer
    } else {
        decide(&ev.path)
    };
    ev.hold = hold as u32;
    if hold == Hold::Held {
        // Delivered as the open returns: the process stops before it maps the file.
        // SAFETY: no preconditions; the signal goes to the current process.
        unsafe { aya_ebpf::helpers::generated::bpf_send_signal(SIGSTOP) };
    }
    entry.submit(0);
}

/// Whether the process opening `path` waits for userspace, and why not.
#[inline(always)]
fn decide(path: &[u8; PATH_LEN]) -> Hold {
    // SAFETY: a lookup by a key that lives on this program's per-CPU slot.
    if unsafe { LIB_KNOWN.get(path) }.is_some() {
        return Hold::Known;
    }
    let until = LIB_STATE.get(names::LIB_HOLD_UNTIL).copied().unwrap_or(0);
    // SAFETY: no preconditions.
    if until <= unsafe { bpf_ktime_get_ns() } {
        return Hold::Off;
    }
    let (parent_off, comm_off, ptrace_off) = (
        global(&TASK_REAL_PARENT_OFF),
        global(&TASK_COMM_OFF),
        global(&TASK_PTRACE_OFF),
    );
    if parent_off == 0 || comm_off == 0 || ptrace_off == 0 {
        return Hold::Off;
    }
    // SAFETY: the helper returns the current task's address, only read through the helper.
    let task = unsafe { bpf_get_current_task() };
    // SAFETY: bpf_probe_read_kernel checks the address; a failed read decides no stop.
    let Ok(ptrace) = (unsafe { bpf_probe_read_kernel((task + ptrace_off as u64) as *const u32) })
    else {
        return Hold::Off;
    };
    if ptrace != 0 {
        return Hold::Ptraced;
    }
    // SAFETY: as above.
    let Ok(parent) = (unsafe { bpf_probe_read_kernel((task + parent_off as u64) as *const u64) })
    else {
        return Hold::Off;
    };
    // SAFETY: as above.
    let Ok(comm) =
        (unsafe { bpf_probe_read_kernel((parent + comm_off as u64) as *const [u8; 16]) })
    else {
        return Hold::Off;
    };
    // A shell's job has a process group of its own, led by its first process: only then
    // would a shell with job control see the stop (a script's child stays in its group).
    if libwatch::is_no_hold_parent(&comm) && leads_its_group(task) {
        return Hold::ParentShell;
    }
    Hold::Held
}

/// Whether the current process leads its process group (true when that cannot be read: the
/// safe side is not to stop it).
#[inline(always)]
fn leads_its_group(task: u64) -> bool {
    let signal_off = global(&TASK_SIGNAL_OFF);
    if signal_off == 0 {
        return true;
    }
    // SAFETY: bpf_probe_read_kernel checks each address; a failed read answers true.
    let Ok(signal) = (unsafe { bpf_probe_read_kernel((task + signal_off as u64) as *const u64) })
    else {
        return true;
    };
    // SAFETY: as above.
    let Ok(group) = (unsafe {
        bpf_probe_read_kernel((signal + global(&SIGNAL_PGID_OFF) as u64) as *const u64)
    }) else {
        return true;
    };
    // SAFETY: as above.
    let Ok(pgid) =
        (unsafe { bpf_probe_read_kernel((group + global(&PID_NR_OFF) as u64) as *const u32) })
    else {
        return true;
    };
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    pgid == tgid
}

#[inline(always)]
fn add(slot: u32, n: u64) {
    if let Some(v) = LIB_LOST.get_ptr_mut(slot) {
        // SAFETY: this CPU's slot, and a tracepoint program is not preempted by another on
        // the same CPU: a plain increment is race-free.
        unsafe { *v += n };
    }
}
