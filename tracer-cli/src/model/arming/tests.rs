use tracer_common::Op;

use super::*;
use crate::model::{
    layout::{BlockSight, Layout, LARGE_SEGMENT},
    state::{ProcessState, KEYFRAME_FORMAT},
};

const S: i64 = 1_000_000_000;
const GIB: u64 = 1 << 30;
const SEG: u64 = 0x7f00_0000_0000;

fn call(op: Op, ptr: u64, size: u64, ts_ns: i64) -> Event {
    Event {
        ts_ns,
        duration_ns: 0,
        size,
        ptr,
        aux0: 0,
        aux1: 0,
        pid: 7,
        tid: 7,
        ret: 0,
        device: 0,
        stack: None,
        op,
    }
}

fn auto() -> Arming {
    Arming::new(Mode::Auto, Settings::default())
}

/// Arms once, then says nothing more while the arming is carried out.
fn arms(a: &mut Arming, e: &Event) -> Reason {
    let d = a.observe(e).expect("a trigger arms");
    assert!(d.arm);
    assert_eq!(a.observe(e), None, "asked once");
    a.armed(d.pid, true, e.ts_ns);
    d.reason
}

#[test]
fn a_failed_device_allocation_arms() {
    let mut a = auto();
    assert_eq!(a.observe(&call(Op::CudaMalloc, SEG, GIB, 0)), None);
    let failed = Event {
        ret: 2,
        ..call(Op::CudaMalloc, 0, 80 * GIB, S)
    };
    assert_eq!(arms(&mut a, &failed), Reason::FailedAllocation);
    // Another error (not out of memory) is no trigger.
    let mut b = auto();
    let invalid = Event {
        ret: 1,
        ..call(Op::CudaMalloc, 0, GIB, S)
    };
    assert_eq!(b.observe(&invalid), None);
}

#[test]
fn a_device_allocation_after_warm_up_arms_and_one_during_it_does_not() {
    let mut a = auto();
    let warmup = a.settings.warmup_ns;
    assert_eq!(a.observe(&call(Op::CudaMalloc, SEG, GIB, 0)), None);
    assert_eq!(
        a.observe(&call(Op::CudaMalloc, SEG + GIB, GIB, warmup - 1)),
        None
    );
    // The driver call nested in the runtime's is the same allocation.
    assert_eq!(
        a.observe(&call(Op::CuMemAlloc, SEG + GIB, GIB, warmup + 1)),
        None
    );
    let miss = call(Op::CudaMalloc, SEG + 2 * GIB, GIB, warmup);
    assert_eq!(arms(&mut a, &miss), Reason::CacheMiss);
}

#[test]
fn memory_past_the_share_of_the_device_arms_and_pressure_holds_it_armed() {
    let mut a = auto();
    let total = 80 * GIB;
    let info = Event {
        aux1: total,
        ..call(Op::CudaMemGetInfo, 0, 0, 0)
    };
    assert_eq!(a.observe(&info), None);
    assert_eq!(a.observe(&call(Op::CudaMalloc, SEG, 60 * GIB, 1)), None);
    let past = call(Op::CudaMalloc, SEG + 60 * GIB, 8 * GIB, 2);
    let d = a.observe(&past).expect("68 of 80 GiB is past 85 %");
    assert_eq!(
        (d.reason, d.held, d.total),
        (Reason::Reserved, 68 * GIB, total)
    );
    a.armed(7, true, 2);
    // Frees down to 62 GiB (77 %, above the 75 % hold) keep the pressure on.
    let quiet = a.settings.quiet_ns;
    let min = a.settings.min_armed_ns;
    assert_eq!(
        a.observe(&call(Op::CudaFree, SEG + 60 * GIB, 0, quiet)),
        None
    );
    assert_eq!(
        a.observe(&call(Op::CudaMalloc, SEG + 70 * GIB, 2 * GIB, quiet + 1)),
        None
    );
    assert!(a.due(quiet + min).is_empty(), "pressure held it armed");
    // Down to 2 GiB: quiet from then on.
    a.observe(&call(Op::CudaFree, SEG, 0, quiet + 2));
    let later = quiet + 2 + quiet;
    let d = a.due(later);
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].arm, d[0].reason), (false, Reason::Quiet));
    assert!(a.armed_pids().is_empty());
}

#[test]
fn the_quiet_period_disarms_but_not_before_the_minimum_armed_time() {
    let mut a = Arming::new(
        Mode::Auto,
        Settings {
            quiet_ns: 10 * S,
            min_armed_ns: 30 * S,
            ..Settings::default()
        },
    );
    let failed = Event {
        ret: 2,
        ..call(Op::CudaMalloc, 0, GIB, 0)
    };
    arms(&mut a, &failed);
    assert!(a.due(20 * S).is_empty(), "quiet 20 s, armed only 20 s");
    assert_eq!(a.due(30 * S).len(), 1);
    assert!(a.due(31 * S).is_empty(), "disarmed once");
    // A new trigger arms again.
    assert_eq!(
        arms(
            &mut a,
            &Event {
                ts_ns: 40 * S,
                ..failed
            }
        ),
        Reason::FailedAllocation
    );
}

#[test]
fn out_of_memory_and_root_arm_and_roots_asking_holds_it() {
    let mut a = auto();
    let oom = call(Op::TorchOom, 0, 0, S);
    assert_eq!(arms(&mut a, &oom), Reason::OutOfMemory);
    let mut b = auto();
    b.observe(&call(Op::CudaMalloc, SEG, GIB, 0));
    let asked = b.on_demand(true, S);
    assert_eq!(asked.len(), 1);
    assert_eq!(asked[0].reason, Reason::OnDemand);
    b.armed(7, true, S);
    assert!(b.due(1000 * S).is_empty(), "root's asking lasts");
    let ended = b.on_demand(false, 1001 * S);
    assert_eq!(ended[0].reason, Reason::OnDemandEnded);
}

/// Ending root's asking disarms what only the asking held; a process under pressure of its
/// own stays armed until its quiet period passes.
#[test]
fn ending_roots_asking_leaves_a_process_under_pressure_armed() {
    let mut a = auto();
    let failed = Event {
        ret: 2,
        ..call(Op::CudaMalloc, 0, GIB, 0)
    };
    arms(&mut a, &failed);
    let other = Event {
        pid: 8,
        tid: 8,
        ..call(Op::CudaMalloc, SEG, GIB, 0)
    };
    a.observe(&other);
    let asked = a.on_demand(true, S);
    assert_eq!(asked.len(), 1, "pid 7 was armed already");
    a.armed(8, true, S);
    let ended = a.on_demand(false, 2 * S);
    assert_eq!(ended.len(), 1);
    assert_eq!((ended[0].pid, ended[0].reason), (8, Reason::OnDemandEnded));
    assert_eq!(a.armed_pids(), vec![7]);
    let quiet = a.settings.quiet_ns.max(a.settings.min_armed_ns);
    let due = a.due(quiet);
    assert_eq!(due.len(), 1);
    assert_eq!((due[0].pid, due[0].reason), (7, Reason::Quiet));
}

#[test]
fn always_and_off_never_decide() {
    for mode in [Mode::Always, Mode::Off] {
        let mut a = Arming::new(mode, Settings::default());
        let failed = Event {
            ret: 2,
            ..call(Op::CudaMalloc, 0, GIB, 0)
        };
        assert_eq!(a.observe(&failed), None);
        assert!(a.on_demand(true, 0).is_empty());
    }
}

#[test]
fn a_failed_arming_is_marked_as_such_and_asked_again_at_the_next_trigger() {
    let mut a = auto();
    let failed = Event {
        ret: 2,
        ..call(Op::CudaMalloc, 0, GIB, 0)
    };
    let d = a.observe(&failed).unwrap();
    assert_eq!(
        d.mark(false),
        (Op::AllocatorDisarmed, Reason::Failed as i32)
    );
    a.armed(7, false, 0);
    assert!(a.observe(&failed).is_some());
}

/// A layout that saw the process's segments but not the blocks made before arming.
fn armed_late() -> Layout {
    let mut l = Layout::default();
    l.disarm(0);
    l.apply(&call(Op::CudaMalloc, SEG, LARGE_SEGMENT, 10));
    // Blocks PyTorch handed out unseen fill the segment's first 16 MiB.
    l.arm(100);
    // Made before the arming, read after it (the reader's order is by time, the registry's
    // by arrival): its contents are unseen too.
    l.apply(&call(Op::CudaMalloc, SEG + (1 << 30), LARGE_SEGMENT, 50));
    l
}

#[test]
fn a_layout_read_after_a_late_arming_never_shows_unseen_memory_as_free() {
    let mut l = armed_late();
    assert_eq!(l.block_sight(), BlockSight::ArmedAt(100));
    assert_eq!(l.unseen_contents(Some(0)), (2, 2 * LARGE_SEGMENT));
    // A block seen after arming lands in an unseen segment: nothing of it is free.
    l.apply(&call(Op::TorchMalloc, SEG + (16 << 20), 1 << 20, 200));
    let t = l.device_total(0);
    assert_eq!((t.reserved, t.largest_free, t.free_blocks), (0, 0, 0));
    assert_eq!(
        l.worst_fragmentation(0),
        0.0,
        "no verdict from unseen memory"
    );
    // A free of a block allocated before arming is expected, not a gap in the trace.
    l.apply(&call(Op::TorchFree, SEG, 0, 300));
    l.apply(&call(Op::TorchFree, SEG + (16 << 20), 0, 301));
    assert_eq!(l.unexplained.unmatched_frees, 0);
    assert!(l.unknown.exact());
    // A segment made after arming is seen whole.
    l.apply(&call(Op::CudaMalloc, SEG + (2 << 30), LARGE_SEGMENT, 400));
    l.apply(&call(Op::TorchMalloc, SEG + (2 << 30), 4 << 20, 401));
    let t = l.device_total(0);
    assert_eq!(t.reserved, LARGE_SEGMENT);
    assert_eq!(t.largest_free, LARGE_SEGMENT - (4 << 20));
    // Releasing an unseen segment ends what was unknown of it.
    l.apply(&call(Op::CudaFree, SEG, 0, 500));
    assert_eq!(l.unseen_contents(None), (1, LARGE_SEGMENT));
}

/// Between the arming mark and the armed one the semaphores are being raised: a segment made
/// then may hold a block made before they were up (PyTorch's site ran unarmed), so it is of
/// unknown contents; its blocks seen are taken; a segment made after the armed mark is seen
/// whole. Read in time order, as every reader does.
#[test]
fn a_segment_made_while_the_semaphores_are_raised_is_never_shown_free() {
    let mut l = Layout::default();
    l.disarm(0);
    l.apply(&call(Op::AllocatorArming, 0, 0, 100));
    assert_eq!(l.block_sight(), BlockSight::ArmingSince(100));
    assert!(!l.blocks_known());
    // The segment PyTorch made for a block whose site ran before the semaphore was up.
    l.apply(&call(Op::CudaMalloc, SEG, LARGE_SEGMENT, 150));
    l.apply(&call(Op::AllocatorArmed, 0, 0, 200));
    assert_eq!(l.block_sight(), BlockSight::ArmedAt(200));
    assert_eq!(l.unseen_contents(Some(0)), (1, LARGE_SEGMENT));
    let t = l.device_total(0);
    assert_eq!(
        (t.reserved, t.largest_free),
        (0, 0),
        "nothing unseen is free"
    );
    // A block seen in it later is taken (its free is recognised), and shows nothing free.
    l.apply(&call(Op::TorchMalloc, SEG + (16 << 20), 1 << 20, 250));
    l.apply(&call(Op::TorchFree, SEG + (16 << 20), 0, 260));
    assert_eq!(l.unexplained.unmatched_frees, 0);
    assert_eq!(l.device_total(0).largest_free, 0);
    // Made after the armed mark: seen whole.
    l.apply(&call(Op::CudaMalloc, SEG + (1 << 30), LARGE_SEGMENT, 300));
    l.apply(&call(Op::TorchMalloc, SEG + (1 << 30), 4 << 20, 301));
    assert_eq!(l.device_total(0).reserved, LARGE_SEGMENT);
    // An arming that failed: the disarmed mark follows the arming one.
    let mut f = Layout::default();
    f.disarm(0);
    f.apply(&call(Op::AllocatorArming, 0, 0, 100));
    f.apply(&call(Op::AllocatorDisarmed, 0, 0, 110));
    assert_eq!(f.block_sight(), BlockSight::DisarmedAt(110));
}

#[test]
fn a_disarm_drops_block_state_and_later_block_events_are_not_applied() {
    let mut l = Layout::default();
    l.apply(&call(Op::CudaMalloc, SEG, LARGE_SEGMENT, 0));
    l.apply(&call(Op::TorchMalloc, SEG, 4 << 20, 1));
    assert_eq!(l.device_total(0).allocated, 4 << 20);
    l.disarm(10);
    assert_eq!(l.device_total(0), Default::default());
    assert_eq!(l.unseen_contents(Some(0)), (1, LARGE_SEGMENT));
    assert_eq!(l.blocks_held(), 0);
    // Made before the disarm, read after: dropped with the rest.
    l.apply(&call(Op::TorchFree, SEG, 0, 9));
    assert_eq!(l.unexplained.unmatched_frees, 0);
    assert_eq!(l.block_sight(), BlockSight::DisarmedAt(10));
}

#[test]
fn what_the_layout_knows_of_the_blocks_survives_a_keyframe() {
    let mut l = armed_late();
    l.apply(&call(Op::TorchFree, SEG, 0, 300));
    let state = ProcessState {
        pid: 7,
        layout: l,
        ..Default::default()
    };
    let back = ProcessState::decode(&state.encode().unwrap(), KEYFRAME_FORMAT).unwrap();
    assert_eq!(back.layout.block_sight(), BlockSight::ArmedAt(100));
    assert_eq!(back.layout.unseen_contents(None), (2, 2 * LARGE_SEGMENT));
}

#[test]
fn marks_in_the_call_stream_arm_and_disarm_the_layout() {
    let mut state = ProcessState::default();
    let disarmed = call(Op::AllocatorDisarmed, 0, 0, 0);
    state.apply_memory(&disarmed);
    state.apply_memory(&call(Op::CudaMalloc, SEG, LARGE_SEGMENT, 1));
    state.apply_memory(&call(Op::AllocatorArmed, 0, 0, 2));
    assert_eq!(state.layout.block_sight(), BlockSight::ArmedAt(2));
    assert_eq!(state.layout.unseen_contents(None).0, 1);
}

#[test]
fn roots_asking_arms_processes_seen_while_it_lasts() {
    let mut a = auto();
    assert!(a.on_demand(true, 0).is_empty(), "no process seen yet");
    let d = a.observe(&call(Op::CudaMalloc, SEG, GIB, S)).unwrap();
    assert_eq!(d.reason, Reason::OnDemand);
    a.armed(7, true, S);
    assert!(a.due(1000 * S).is_empty());
    assert_eq!(a.on_demand(false, 1001 * S).len(), 1);
}
