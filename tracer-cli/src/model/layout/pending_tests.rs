use super::*;

const SEG: u64 = 0x7f00_0000_0000;
pub(crate) const EVENT: u64 = 0x5555_0000;

pub(crate) fn ev(op: Op, ptr: u64, size: u64, ts_ns: i64) -> Event {
    Event {
        ts_ns,
        ..super::tests::ev(op, ptr, size)
    }
}

pub(crate) fn record(ts_ns: i64, from_allocator: bool) -> Event {
    Event {
        aux1: from_allocator as u64,
        ..ev(Op::CudaEventRecord, EVENT, 0, ts_ns)
    }
}

/// A 20 MiB segment with two 4 MiB blocks; the first freed at t=1000.
pub(crate) fn freed_first() -> Layout {
    let mut l = Layout::default();
    l.apply(&ev(Op::CudaMalloc, SEG, LARGE_SEGMENT, 0));
    l.apply(&ev(Op::TorchMalloc, SEG, 4 << 20, 10));
    l.apply(&ev(Op::TorchMalloc, SEG + (4 << 20), 4 << 20, 20));
    l.apply(&ev(Op::TorchFree, SEG, 0, 1000));
    l
}

#[test]
fn a_block_whose_free_recorded_events_is_kept_until_the_last_completes() {
    let mut l = freed_first();
    assert_eq!(l.total().free_blocks, 2);
    l.apply(&record(1500, true));
    l.apply(&Event {
        ptr: EVENT + 1,
        ..record(1600, true)
    });
    // Kept: not allocated (PyTorch's figure dropped at the free), not free either.
    assert_eq!(l.pending(None), (1, 4 << 20));
    assert_eq!(l.total().allocated, 4 << 20);
    assert_eq!(l.total().free_blocks, 1);
    let runs = &l.segments()[0].runs;
    assert_eq!(runs[0].kind, RunKind::Pending);
    // Not ready yet: nothing changes.
    l.apply(&Event {
        ret: 600,
        ..ev(Op::CudaEventQuery, EVENT, 0, 2000)
    });
    l.apply(&ev(Op::CudaEventQuery, EVENT, 0, 3000));
    assert_eq!(l.pending(None), (1, 4 << 20));
    l.apply(&ev(Op::CudaEventSynchronize, EVENT + 1, 0, 4000));
    assert_eq!(l.pending(None), (0, 0));
    assert_eq!(l.total().free_blocks, 2);
    assert_eq!(l.total().allocated, 4 << 20);
    assert!(l.unknown.exact());
}

#[test]
fn events_the_program_records_or_recorded_long_after_a_free_keep_nothing() {
    let mut l = freed_first();
    l.apply(&record(1500, false));
    assert_eq!(l.pending(None), (0, 0));
    l.apply(&record(1000 + FREE_RECORDS_WITHIN_NS + 1, true));
    assert_eq!(l.pending(None), (0, 0));
    assert_eq!(l.total().free_blocks, 2);
}
