//! The one ending every program that makes a call event shares: to the stage, straight to the
//! ring, or, under --stack, to the call-site programs (which then use the stage or the ring).

use aya_ebpf::EbpfContext;
use tracer_common::{
    maps::{Counter, Stage},
    CallEvent,
};

use crate::{
    counters::bump,
    stack::tail_call_site,
    stage::{release_stage, send_event, stage_event},
};

/// Where a program's call event goes: `claimed` is this CPU's stage when the program claimed
/// it (before reading the clock), `stack` whether call sites are wanted.
#[inline(always)]
pub fn deliver<C: EbpfContext>(
    ctx: &C,
    claimed: Option<*mut Stage>,
    stack: bool,
    event: &CallEvent,
    send_comm: bool,
) {
    if stack {
        // The call-site program sends the event (and counts it), to the claimed stage when its
        // native stack is kept by id and it has no Python frames, else to the ring.
        tail_call_site(ctx, event, claimed.is_some());
        // Only a failed tail call gets here: the event is lost, and counted as such.
        if let Some(stage) = claimed {
            release_stage(stage);
        }
        bump(Counter::TailCallFailed);
        return;
    }
    match claimed {
        Some(stage) => stage_event(stage, event),
        None => send_event(event, send_comm),
    }
}
