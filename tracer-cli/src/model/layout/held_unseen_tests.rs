use super::*;

const SEG: u64 = 0x7f00_0000_0000;

fn ev(op: Op, ptr: u64, size: u64, stream: u64) -> Event {
    Event {
        ts_ns: 1,
        aux0: stream,
        ..super::tests::ev(op, ptr, size)
    }
}

/// A 4 MiB block in a 20 MiB segment; then a new segment for an 8 MiB request on `stream`.
fn second_segment_for(stream: u64) -> Layout {
    let mut l = Layout::default();
    l.apply(&ev(Op::CudaMalloc, SEG, LARGE_SEGMENT, 0));
    l.apply(&ev(Op::TorchMalloc, SEG, 4 << 20, 7));
    l.apply(&ev(Op::CudaMalloc, SEG + (1 << 30), LARGE_SEGMENT, 0));
    l.apply(&ev(Op::TorchMalloc, SEG + (1 << 30), 8 << 20, stream));
    l
}

#[test]
fn a_new_segment_while_a_fitting_block_looked_free_means_blocks_held_unseen() {
    let l = second_segment_for(7);
    assert_eq!(l.held_unseen(), 1);
    assert!(!l.unknown.exact());
}

#[test]
fn a_new_segment_for_another_stream_is_the_allocators_rule() {
    let l = second_segment_for(8);
    assert_eq!(l.held_unseen(), 0);
    assert!(l.unknown.exact());
}
