//! The OOM arithmetic on the figures of real failures (PyTorch's own numbers, from the H200
//! recordings in tests/data and the A100 snapshot issue 49 describes).

use super::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The co-tenant OOM on the H200 (tests/data/gpu-h200/stats-co-tenant.json): PyTorch's
/// message says 256.00 MiB tried, 227.50 MiB free after its flush, 203.86 MiB reserved but
/// unallocated; another process held 136.28 GiB.
fn co_tenant() -> Inputs {
    Inputs {
        request: Some(256 * MIB),
        refused: Some(256 * MIB),
        message_free: Some(238_551_040),
        estimate: Some((300 * MIB, 2_000_000_000)),
        split: Some(213_757_952),
        others: 146_330_000_000,
        ..Inputs::default()
    }
}

#[test]
fn the_co_tenants_oom_is_decided_by_both_each_alone() {
    let a = arithmetic(&co_tenant());
    assert_eq!(a.source, FreeSource::Message);
    assert_eq!(a.could_give, Some(238_551_040));
    assert_eq!(a.shortfall, Some(256 * MIB - 238_551_040));
    assert_eq!(a.cause, Cause::Both { each_enough: true });
    // The estimate said more than the refusal allows: shown as contradicted, with the bytes
    // no traced call took.
    assert_eq!(a.contradicted, Some((300 * MIB, 2_000_000_000)));
    assert_eq!(a.not_taken, Some(300 * MIB - 238_551_040));
    assert!(
        a.figures().contains("short by 28.50 MiB"),
        "{}",
        a.figures()
    );
    assert!(
        a.verdict().contains("each exceed the 28.50 MiB"),
        "{}",
        a.verdict()
    );
}

#[test]
fn split_bytes_larger_than_the_shortfall_decide_it_even_when_the_request_exceeds_them() {
    // Issue 49's A100 snapshot: 3.91 GiB asked, 3.75 GiB free after the flush, 806.57 MiB
    // free in 27 split blocks; no other process. The request is far larger than the cache,
    // but the cache's split bytes are more than it was short.
    let i = Inputs {
        request: Some(4_198_498_304),
        refused: Some(4_198_498_304),
        message_free: Some(4_024_565_760),
        split: Some(845_749_862),
        ..Inputs::default()
    };
    let a = arithmetic(&i);
    assert_eq!(a.shortfall, Some(4_198_498_304 - 4_024_565_760));
    assert_eq!(a.cause, Cause::Fragmentation);
    assert!(
        a.verdict()
            .starts_with("fragmentation decided it: 806.57 MiB"),
        "{}",
        a.verdict()
    );
}

#[test]
fn more_than_every_split_byte_and_no_other_process_is_capacity() {
    // The GPU check's provoked OOM: 139.62 GiB asked with 138.61 GiB free.
    let i = Inputs {
        request: Some(149_909_798_912),
        refused: Some(149_909_798_912),
        message_free: Some(148_836_057_088),
        split: Some(20 * MIB),
        ..Inputs::default()
    };
    assert_eq!(arithmetic(&i).cause, Cause::Capacity);
}

#[test]
fn no_free_figure_exceeds_what_the_device_refused() {
    // "Tried to allocate 1.46 GiB ... the device had 1.56 GiB free": the estimate is bounded
    // by the refusal, and the difference said as memory no traced call took.
    let refused = 1_568_669_696;
    let i = Inputs {
        refused: Some(refused),
        estimate: Some((1_675_000_000, 3_260_000_000)),
        split: Some(0),
        ..Inputs::default()
    };
    let a = arithmetic(&i);
    assert_eq!(a.source, FreeSource::Bound);
    assert_eq!(a.could_give, Some(refused - 1));
    assert!(a.could_give < a.refused);
    assert_eq!(a.not_taken, Some(1_675_000_000 - (refused - 1)));
    let said = a.figures();
    assert!(
        said.contains("at most 1.46 GiB free (it refused 1.46 GiB)"),
        "{said}"
    );
    assert!(said.contains("went where no traced call took it"), "{said}");
    // With only the bound, nothing covers all that was asked: not decided.
    assert!(matches!(a.cause, Cause::Unknown { .. }), "{:?}", a.cause);
    // An estimate under the bound is used as it is, with its age.
    let i = Inputs {
        estimate: Some((refused / 2, 3_260_000_000)),
        ..i
    };
    let a = arithmetic(&i);
    assert_eq!(
        a.source,
        FreeSource::Estimate {
            age_ns: 3_260_000_000
        }
    );
    assert_eq!(a.contradicted, None);
    assert_eq!(a.cause, Cause::Capacity);
}

#[test]
fn a_refused_page_of_an_expandable_segment_counts_the_pages_given_back() {
    // A 20 MiB page refused while the request had made 40 MiB of pages; PyTorch's message,
    // read after they went back, says 55 MiB free of a 100 MiB request.
    let i = Inputs {
        request: Some(100 * MIB),
        refused: Some(20 * MIB),
        page: true,
        given_back: 40 * MIB,
        message_free: Some(55 * MIB),
        split: Some(10 * MIB),
        others: 0,
        ..Inputs::default()
    };
    let a = arithmetic(&i);
    assert_eq!(a.asked, Some(100 * MIB));
    assert_eq!(a.bound, Some(20 * MIB - 1));
    assert_eq!(a.shortfall, Some(45 * MIB));
    assert_eq!(a.cause, Cause::Capacity);
    assert!(
        a.figures().contains("refused a 20.00 MiB page"),
        "{}",
        a.figures()
    );
}

#[test]
fn neither_alone_but_both_together_is_said_with_each_share() {
    let i = Inputs {
        request: Some(100 * MIB),
        refused: Some(100 * MIB),
        message_free: Some(40 * MIB),
        split: Some(30 * MIB),
        others: 35 * MIB,
        ..Inputs::default()
    };
    let a = arithmetic(&i);
    assert_eq!(a.cause, Cause::Both { each_enough: false });
    assert!(
        a.verdict()
            .contains("60.00 MiB short, the split bytes 30.00 MiB of it"),
        "{}",
        a.verdict()
    );
}

#[test]
fn a_memory_fraction_refusal_never_reached_the_device() {
    let message = "CUDA out of memory. Tried to allocate 192.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 136.10 GiB is free. Including non-PyTorch memory, this process has 3.12 GiB memory in use. 2.80 GiB allowed; Of the allocated memory 2.62 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.";
    assert_eq!(allowed_said(message), Some(2_800 * GIB / 1000));
    assert_eq!(free_said(message), Some(136_100 * GIB / 1000));
    let i = Inputs {
        request: Some(192 * MIB),
        message_free: free_said(message),
        allowed: allowed_said(message),
        ..Inputs::default()
    };
    let a = arithmetic(&i);
    assert_eq!(a.cause.name(), "memory_fraction");
    assert_eq!(a.shortfall, None);
    assert!(
        a.figures().contains("refused without asking the device"),
        "{}",
        a.figures()
    );
}

#[test]
fn figures_that_say_it_fit_decide_nothing() {
    let i = Inputs {
        request: Some(20 * MIB),
        refused: Some(20 * MIB),
        message_free: Some(30 * MIB),
        split: Some(0),
        ..Inputs::default()
    };
    assert!(matches!(arithmetic(&i).cause, Cause::Unknown { .. }));
}

#[test]
fn an_imported_snapshots_oom_entry_gives_the_free_bytes() {
    assert_eq!(
        free_said("CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has 10.00 MiB free (PyTorch's memory snapshot: the allocator's trace entry of the failure)."),
        Some(10 * MIB)
    );
    assert_eq!(
        free_said("CUDA out of memory. Tried to allocate 100.00 MiB."),
        None
    );
    // The import's message carries the entry's bytes exactly; PyTorch's own message does not.
    let imported = format!(
        "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has 57.56 MiB free {SNAPSHOT_OOM_SAYS}60358656 bytes free)."
    );
    assert_eq!(snapshot_free_said(&imported), Some(60_358_656));
    assert_eq!(free_said(&imported), Some(60_356_034));
    assert_eq!(
        snapshot_free_said("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which 10.50 MiB is free."),
        None
    );
}

/// Memory held by no one traced or named that covers the shortfall: not capacity.
#[test]
fn unattributed_memory_that_covers_the_shortfall_is_not_capacity() {
    let i = Inputs {
        request: Some(64 * MIB),
        refused: Some(64 * MIB),
        message_free: Some(0),
        split: Some(0),
        unattributed: Some(768 * MIB),
        ..Inputs::default()
    };
    assert!(matches!(arithmetic(&i).cause, Cause::Unknown { .. }));
}

/// PyTorch's message with CUDA graphs: the private pools' free blocks are "allocated in private
/// pools", apart from what is reserved but unallocated (a real message from a vLLM job).
#[test]
fn private_pools_are_read_apart_from_the_cache() {
    let m = "CUDA out of memory. Tried to allocate 304.00 MiB. GPU 0 has a total capacity of 94.97 GiB of which 218.81 MiB is free. Including non-PyTorch memory, this process has 93.84 GiB memory in use. Of the allocated memory 91.19 GiB is allocated by PyTorch, with 118.00 MiB allocated in private pools (e.g., CUDA Graphs), and 744.36 MiB is reserved by PyTorch but unallocated.";
    assert_eq!(pytorch_private(m), Some(118 * MIB));
    assert_eq!(pytorch_cached(m), pytorch_size("744.36 MiB"));
    assert_eq!(pytorch_private("Of the allocated memory 5.61 GiB is allocated by PyTorch, and 124.14 MiB is reserved by PyTorch but unallocated."), None);
    // Split bytes short of the 86 MiB shortfall, the private pools' 118 MiB beyond it: the
    // pools decided it; how much of it a flush could return is not known from the message.
    let i = Inputs {
        request: Some(304 * MIB),
        refused: Some(304 * MIB),
        after_free: Some(218 * MIB),
        split: Some(60 * MIB),
        private: Some(118 * MIB),
        ..Inputs::default()
    };
    let a = arithmetic(&i);
    assert_eq!(a.cause, Cause::PrivatePools { idle_enough: false });
    assert!(
        a.figures().contains("118.00 MiB free inside private pools"),
        "{}",
        a.figures()
    );
    assert!(
        a.verdict()
            .starts_with("private pools decided it: 118.00 MiB"),
        "{}",
        a.verdict()
    );
    // Pool segments with no live block that cover the shortfall: a flush returns them once the
    // pool is released.
    let a = arithmetic(&Inputs {
        private_idle: Some(100 * MIB),
        ..i.clone()
    });
    assert_eq!(a.cause, Cause::PrivatePools { idle_enough: true });
    // Private bytes short of the shortfall too: capacity, the pools said in the way.
    let a = arithmetic(&Inputs {
        private: Some(80 * MIB),
        ..i
    });
    assert_eq!(a.cause, Cause::Capacity);
    assert!(a.figures().contains("80.00 MiB free inside private pools"));
}
