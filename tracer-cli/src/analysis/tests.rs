//! Each rule on constructed event sets: where it must fire, and where it must not.
//!
//! Over 700 lines because every rule's fire and not-fire cases share the event builders here.

use std::collections::HashMap;

use tracer_common::Op;

use super::{rules::Severity, *};
use crate::model::{
    layout::{AllocConf, Pool, PoolStats},
    stack_id, HostRecord, OffSlice,
};

const MS: i64 = 1_000_000;
const MIB: u64 = 1 << 20;

fn ev(ts_ms: f64, op: Op, size: u64, ptr: u64, ret: i32, dur_us: u64) -> Event {
    Event {
        ts_ns: (ts_ms * 1e6) as i64,
        pid: 10,
        tid: 11,
        op,
        device: 0,
        size,
        ptr,
        ret,
        duration_ns: dur_us * 1000,
        aux0: 0,
        aux1: 0,
        stack: None,
    }
}

/// What explain's per-process tables show for `events`.
fn per_process(
    events: &[Event],
    window: Window,
    comms: &HashMap<u32, String>,
) -> Vec<ProcessReport> {
    analyze(
        1,
        events,
        &Host::default(),
        window,
        &Inputs::new(comms, &HashMap::new()),
    )
    .processes
}

fn window_of(events: &[Event]) -> Window {
    Window {
        from_ns: events.first().unwrap().ts_ns,
        to_ns: events.last().unwrap().end_ns(),
    }
}

fn chains(events: &[Event]) -> Vec<Chain> {
    analyze(
        1,
        events,
        &Host::default(),
        window_of(events),
        &Inputs::new(&HashMap::new(), &HashMap::new()),
    )
    .chains
}

fn rules_fired(events: &[Event]) -> Vec<&'static str> {
    let mut r: Vec<&str> = chains(events).iter().map(|c| c.rule.name()).collect();
    r.sort_unstable();
    r
}

/// Allocations whose latency grows over time, each kept (held bytes grow too).
fn growing(latency_growth: bool, free_each: bool) -> Vec<Event> {
    let mut v = Vec::new();
    for i in 0..120u64 {
        let dur = if latency_growth {
            50 + i * 10
        } else {
            50 + (i % 3)
        };
        let ptr = 0x1000_0000 + i * 0x10_0000;
        v.push(ev(i as f64 * 100.0, Op::CudaMalloc, MIB, ptr, 0, dur));
        if free_each {
            v.push(ev(i as f64 * 100.0 + 50.0, Op::CudaFree, MIB, ptr, 0, 5));
        }
    }
    v
}

/// Growth with holes: each step allocates two buffers and frees one of them, so held memory
/// grows with frees between the live allocations.
fn growing_with_holes() -> Vec<Event> {
    let mut v = Vec::new();
    for i in 0..120u64 {
        let ptr = 0x1000_0000 + i * 0x20_0000;
        let t = i as f64 * 100.0;
        v.push(ev(t, Op::CudaMalloc, MIB, ptr, 0, 50 + i * 10));
        v.push(ev(
            t + 10.0,
            Op::CudaMalloc,
            MIB,
            ptr + 0x10_0000,
            0,
            50 + i * 10,
        ));
        v.push(ev(t + 50.0, Op::CudaFree, MIB, ptr + 0x10_0000, 0, 5));
    }
    v
}

#[test]
fn latency_growing_with_memory_held_is_named_so_never_fragmentation() {
    let c = chains(&growing_with_holes());
    let growth = c
        .iter()
        .find(|c| c.rule == "latency_growth")
        .expect("fires");
    assert_eq!(growth.severity, Severity::High);
    assert!(growth.effect.contains("climbed from"), "{}", growth.effect);
    assert!(growth.root.contains("240 allocations"), "{}", growth.root);
    // Flat latency: no chain. Rising latency but nothing held (each freed): no chain either.
    assert!(!rules_fired(&growing(false, false)).contains(&"latency_growth"));
    assert!(!rules_fired(&growing(true, true)).contains(&"latency_growth"));
    // Memory that only grows (nothing freed, latency rising with the live allocations): named
    // as growth, a leak if it goes on; without the allocator's probes, no chain says
    // fragmentation, holes between live allocations or not.
    let only_grows = chains(&growing(true, false));
    let growth = only_grows
        .iter()
        .find(|c| c.rule == "latency_growth")
        .expect("fires");
    assert!(growth.effect.contains("only grew"), "{}", growth.effect);
    for c in &only_grows {
        let text = format!("{} {} {}", c.title, c.root, c.effect);
        assert!(!text.contains("fragment"), "{text}");
    }
    for c in &c {
        assert!(!c.title.contains("fragment"), "{}", c.title);
    }
}

#[test]
fn one_outlier_is_not_a_trend() {
    let mut v = growing(false, false);
    v[100].duration_ns = 50_000_000;
    assert!(!rules_fired(&v).contains(&"latency_growth"));
}

#[test]
fn allocator_retry_is_failure_frees_then_success_of_the_same_size() {
    let v = vec![
        ev(0.0, Op::CudaMalloc, 64 * MIB, 0xa000, 0, 50),
        ev(1.0, Op::CudaMalloc, 64 * MIB, 0xb000, 0, 50),
        ev(10.0, Op::CudaMalloc, 256 * MIB, 0, 2, 300),
        ev(11.0, Op::CudaFree, 64 * MIB, 0xa000, 0, 100),
        ev(12.0, Op::CudaFree, 64 * MIB, 0xb000, 0, 100),
        ev(13.0, Op::CudaMalloc, 256 * MIB, 0xc000, 0, 80),
    ];
    let c = chains(&v);
    let retry = c
        .iter()
        .find(|c| c.rule == "allocator_retry")
        .expect("fires");
    assert!(
        retry.root.contains("2 frees released 128.0 MiB"),
        "{}",
        retry.root
    );
    assert!(
        !c.iter().any(|c| c.rule == "oom"),
        "a recovered failure is not an OOM"
    );
    // Without the frees in between, the success is not a cache flush retry.
    let no_frees: Vec<Event> = v.iter().filter(|e| e.op != Op::CudaFree).cloned().collect();
    assert!(!rules_fired(&no_frees).contains(&"allocator_retry"));
}

#[test]
fn oom_reports_request_holdings_and_what_meminfo_said() {
    let mut info = ev(5.0, Op::CudaMemGetInfo, 0, 0, 0, 3);
    info.size = 0;
    info.aux0 = 6 << 30;
    info.aux1 = 16 << 30;
    let v = vec![
        ev(0.0, Op::CudaMalloc, 2 << 30, 0xa000, 0, 50),
        ev(1.0, Op::CudaMalloc, 2 << 30, 0xb000_0000, 0, 50),
        info,
        ev(10.0, Op::CudaMalloc, 3 << 30, 0, 2, 400),
    ];
    let c = chains(&v);
    let oom = c.iter().find(|c| c.rule == "oom").expect("fires");
    assert!(oom.title.contains("3.0 GiB"), "{}", oom.title);
    assert!(
        oom.effect.contains("held 4.0 GiB on device 0"),
        "{}",
        oom.effect
    );
    assert!(
        oom.effect.contains("6.0 GiB free of 16.0 GiB"),
        "{}",
        oom.effect
    );
    assert!(oom.effect.contains("contiguous"), "{}", oom.effect);
    assert_eq!(c[0].rule, "oom", "the most severe chain comes first");
    // Other errors (an invalid free, error 1) are not out-of-memory.
    let v = vec![
        ev(0.0, Op::CudaFree, 0, 0xdead, 1, 5),
        ev(1.0, Op::CudaMalloc, MIB, 0x1, 0, 5),
    ];
    assert!(!rules_fired(&v).contains(&"oom"));
}

#[test]
fn leak_needs_steady_growth() {
    let v = growing(false, false);
    let c = chains(&v);
    let leak = c.iter().find(|c| c.rule == "leak").expect("fires");
    assert!(leak.effect.contains("cudaMalloc: "), "{}", leak.effect);
    assert!(!rules_fired(&growing(false, true)).contains(&"leak"));
    // Growth then release: not steady.
    let mut v = growing(false, false);
    for (i, e) in v.clone().iter().enumerate().take(100) {
        v.push(ev(12_000.0 + i as f64, Op::CudaFree, MIB, e.ptr, 0, 5));
    }
    assert!(!rules_fired(&v).contains(&"leak"));
}

#[test]
fn churn_is_many_short_cycles_of_one_size() {
    let mut v = Vec::new();
    for i in 0..200 {
        v.push(ev(i as f64 * 2.0, Op::CudaMalloc, 4 * MIB, 0x5000, 0, 20));
        v.push(ev(
            i as f64 * 2.0 + 1.0,
            Op::CudaFree,
            4 * MIB,
            0x5000,
            0,
            5,
        ));
    }
    let c = chains(&v);
    let churn = c.iter().find(|c| c.rule == "churn").expect("fires");
    assert!(
        churn
            .root
            .contains("200 cycles of cudaMalloc + free of 4.0 MiB"),
        "{}",
        churn.root
    );
    // The same cycles spread over a long window are not churn (rate < 10/s).
    let slow: Vec<Event> = v
        .iter()
        .map(|e| Event {
            ts_ns: e.ts_ns * 100,
            ..*e
        })
        .collect();
    assert!(!rules_fired(&slow).contains(&"churn"));
}

#[test]
fn empty_cache_bursts_release_and_take_back_the_same_sizes() {
    let mut v = Vec::new();
    for round in 0..3 {
        let base = round as f64 * 1000.0;
        for k in 0..5u64 {
            v.push(ev(
                base + k as f64,
                Op::CudaMalloc,
                (k + 1) * MIB,
                0x10_0000 * (k + 1),
                0,
                50,
            ));
        }
        for k in 0..5u64 {
            v.push(ev(
                base + 100.0 + k as f64,
                Op::CudaFree,
                (k + 1) * MIB,
                0x10_0000 * (k + 1),
                0,
                50,
            ));
        }
    }
    v.sort_by_key(|e| e.ts_ns);
    let c = chains(&v);
    let burst = c
        .iter()
        .find(|c| c.rule == "empty_cache_churn")
        .expect("fires");
    assert!(burst.root.starts_with("2 bursts"), "{}", burst.root);
    // One burst only (no re-allocation after the last): no chain.
    let one: Vec<Event> = v.iter().filter(|e| e.ts_ns < 1000 * MS).cloned().collect();
    assert!(!rules_fired(&one).contains(&"empty_cache_churn"));
}

#[test]
fn driver_bypass_ignores_driver_calls_nested_in_runtime_calls() {
    let mut nested = ev(0.0, Op::CuMemAlloc, MIB, 0x1, 0, 10);
    nested.ts_ns += 5_000;
    let v = vec![ev(0.0, Op::CudaMalloc, MIB, 0x1, 0, 50), nested];
    assert!(!rules_fired(&v).contains(&"driver_bypass"));
    let mut alone = nested;
    alone.ts_ns = 10 * MS;
    alone.ptr = 0x2;
    let v = vec![ev(0.0, Op::CudaMalloc, MIB, 0x1, 0, 50), alone];
    let c = chains(&v);
    let bypass = c.iter().find(|c| c.rule == "driver_bypass").expect("fires");
    assert!(bypass.root.contains("cuMemAlloc_v2 x1"), "{}", bypass.root);
}

#[test]
fn sync_stalls_need_a_real_share_of_the_time() {
    let stalls: Vec<Event> = (0..10)
        .map(|i| ev(i as f64 * 100.0, Op::CudaStreamSynchronize, 0, 0, 0, 40_000))
        .collect();
    let c = chains(&stalls);
    let s = c.iter().find(|c| c.rule == "sync_stall").expect("fires");
    assert!(
        s.root.contains("10 synchronisation calls took 400ms"),
        "{}",
        s.root
    );
    let short: Vec<Event> = (0..10)
        .map(|i| ev(i as f64 * 100.0, Op::CudaStreamSynchronize, 0, 0, 0, 50))
        .collect();
    assert!(!rules_fired(&short).contains(&"sync_stall"));
}

#[test]
fn periodic_spikes_have_a_period() {
    let mut v = Vec::new();
    for i in 0..100u64 {
        let spike = i % 20 == 0;
        let ptr = 0x1000 + i * 0x1000;
        v.push(ev(
            i as f64 * 50.0,
            Op::CudaMalloc,
            MIB,
            ptr,
            0,
            if spike { 2_000 } else { 40 },
        ));
        v.push(ev(i as f64 * 50.0 + 10.0, Op::CudaFree, MIB, ptr, 0, 5));
    }
    let c = chains(&v);
    let p = c
        .iter()
        .find(|c| c.rule == "periodic_spike")
        .expect("fires");
    assert!(p.title.contains("every 1.0s"), "{}", p.title);
    // The same number of spikes at irregular times: no period.
    let irregular = [0u64, 3, 4, 40, 41, 90];
    for e in v.iter_mut().filter(|e| e.op == Op::CudaMalloc) {
        let i = (e.ts_ns / (50 * MS)) as u64;
        e.duration_ns = if irregular.contains(&i) {
            2_000_000
        } else {
            40_000
        };
    }
    assert!(!rules_fired(&v).contains(&"periodic_spike"));
}

#[test]
fn per_process_table_and_outstanding() {
    let mut v = growing(false, false);
    v.push(ev(20_000.0, Op::CudaFree, MIB, 0x1000_0000, 0, 5));
    let p = per_process(
        &v,
        window_of(&v),
        &HashMap::from([(10, "train".to_string())]),
    );
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].comm.as_deref(), Some("train"));
    let malloc = p[0].ops.iter().find(|o| o.op == "cudaMalloc").unwrap();
    assert_eq!((malloc.calls, malloc.bytes), (120, 120 * MIB));
    assert_eq!(p[0].outstanding[0].op, "cudaMalloc");
    assert_eq!(
        (p[0].outstanding[0].count, p[0].outstanding[0].bytes),
        (119, 119 * MIB)
    );
    assert!(
        p[0].warnings
            .iter()
            .any(|w| w.contains("119 allocations without a matching free")),
        "{:?}",
        p[0].warnings
    );
}

#[test]
fn tail_latency_warning() {
    let mut v: Vec<Event> = (0..100u64)
        .map(|i| ev(i as f64, Op::CudaMalloc, MIB, 0x100 + i, 0, 65))
        .collect();
    v[99].duration_ns = 2_100_000;
    v[98].duration_ns = 2_100_000;
    let p = per_process(&v, window_of(&v), &HashMap::new());
    assert!(
        p[0].warnings
            .iter()
            .any(|w| w.contains("cudaMalloc p99 (2.1ms) is 32x p50 (65us) - a slow tail")),
        "{:?}",
        p[0].warnings
    );
}

#[test]
fn the_window_limits_the_statistics_but_not_the_live_set() {
    let v = growing(false, false);
    let w = Window {
        from_ns: 6_000 * MS,
        to_ns: v.last().unwrap().end_ns(),
    };
    let p = per_process(&v, w, &HashMap::new());
    assert_eq!(p[0].ops[0].calls, 60);
    assert_eq!(
        p[0].outstanding[0].count, 120,
        "allocations before the window are still held"
    );
}

fn slow_syncs() -> Vec<Event> {
    (0..30)
        .map(|i| ev(i as f64 * 100.0, Op::CudaStreamSynchronize, 0, 0, 0, 12_000))
        .collect()
}

/// Each call's thread preempted from 1 ms to 8 ms into it.
fn preempted_inside(calls: &[Event]) -> Vec<OffSlice> {
    calls
        .iter()
        .map(|e| OffSlice {
            pid: e.pid,
            tid: e.tid,
            off_ns: e.ts_ns + MS,
            on_ns: e.ts_ns + 8 * MS,
            wakeup_ns: None,
            preempted: true,
        })
        .collect()
}

fn host_with(slices: Vec<OffSlice>) -> Host {
    Host::new(HostRecord {
        slices,
        recorded: true,
        cpus: Some(2),
        while_armed: false,
    })
}

/// `--allocator auto`: the scheduler followed the process only while armed (the first 10 of
/// 30 slow syncs), so only those calls are assessed: their 58% waiting for a CPU is found,
/// not diluted by 20 calls of which nothing is known; never armed, nothing is said.
#[test]
fn cpu_contention_in_auto_reads_only_the_calls_made_while_followed() {
    use crate::model::arming::ArmingRow;
    let v = slow_syncs();
    let w = window_of(&v);
    let followed = preempted_inside(&v[..10]);
    let row = |ts_ms: i64, armed| ArmingRow {
        pid: 10,
        ts_ns: ts_ms * MS,
        armed,
        reason: None,
        held: 0,
        total: 0,
    };
    let contention = |host: &Host| {
        analyze(
            1,
            &v,
            host,
            w,
            &Inputs::new(&HashMap::new(), &HashMap::new()),
        )
        .chains
        .into_iter()
        .find(|c| c.rule == "cpu_contention")
    };
    // Read as if followed throughout: 70 ms of 360 ms waiting, under the rule's fifth.
    assert!(contention(&host_with(followed.clone())).is_none());
    let record = |slices| HostRecord {
        slices,
        recorded: true,
        cpus: Some(2),
        while_armed: true,
    };
    let mut host = Host::new(record(followed.clone()));
    host.follow_while_armed(&[], &[row(-1, true), row(950, false)]);
    assert_eq!(host.during(&v.iter().collect::<Vec<_>>()).calls, 10);
    let chain = contention(&host).expect("contention in the followed calls");
    assert!(
        chain
            .root
            .contains("during the 10 (of 30: those while the scheduler followed"),
        "{}",
        chain.root
    );
    // Armed where the walk began, disarmed after the fifth call: five calls, too few.
    let mut host = Host::new(record(followed.clone()));
    host.follow_while_armed(&[10], &[row(450, false)]);
    assert_eq!(host.during(&v.iter().collect::<Vec<_>>()).calls, 5);
    assert!(contention(&host).is_none());
    // Never armed: no call was followed.
    let mut host = Host::new(record(followed));
    host.follow_while_armed(&[], &[row(0, false)]);
    assert_eq!(host.during(&v.iter().collect::<Vec<_>>()).calls, 0);
    assert!(contention(&host).is_none());
}

#[test]
fn cpu_contention_counts_only_waits_inside_the_slow_calls() {
    let v = slow_syncs();
    let w = window_of(&v);
    // Preempted for 7 ms inside each 12 ms call: 58% of the calls' time waiting for a CPU.
    let inside = preempted_inside(&v);
    let c = analyze(
        1,
        &v,
        &host_with(inside.clone()),
        w,
        &Inputs::new(&HashMap::new(), &HashMap::new()),
    )
    .chains;
    let cpu = c
        .iter()
        .find(|c| c.rule == "cpu_contention")
        .expect("fires");
    assert_eq!(cpu.severity, Severity::High);
    assert!(
        cpu.root
            .contains("waited 210ms for a CPU during the 30 slowest calls"),
        "{}",
        cpu.root
    );
    let stall = c
        .iter()
        .find(|c| c.rule == "sync_stall")
        .expect("sync stall");
    assert!(
        stall.compounding[0].starts_with("CPU contention"),
        "{:?}",
        stall.compounding
    );
    // The caller alone was runnable: from its preemption 1 ms into a call until it next left
    // the CPU, 1 ms into the next call; the first call from 1 ms, the last until 8 ms:
    // (28 x 12 + 11 + 8) / (30 x 12) = 0.99.
    assert_eq!(
        cpu.compounding,
        ["competing for the cores during those calls: 1.0 threads of the process and its children runnable on average (peak 1) on 2 CPUs"]
    );
    // The same waits between the calls (same window, no overlap): no chain, no compounding.
    let between: Vec<OffSlice> = inside
        .iter()
        .map(|s| OffSlice {
            off_ns: s.off_ns + 20 * MS,
            on_ns: s.on_ns + 20 * MS,
            ..s.clone()
        })
        .collect();
    let c = analyze(
        1,
        &v,
        &host_with(between),
        w,
        &Inputs::new(&HashMap::new(), &HashMap::new()),
    )
    .chains;
    assert!(!c.iter().any(|c| c.rule == "cpu_contention"));
    assert!(c
        .iter()
        .find(|c| c.rule == "sync_stall")
        .unwrap()
        .compounding
        .is_empty());
    // Blocked (not runnable) inside the calls, woken only at the end: off the CPU but not waiting
    // for one.
    let blocked: Vec<OffSlice> = inside
        .iter()
        .map(|s| OffSlice {
            preempted: false,
            wakeup_ns: Some(s.on_ns - 100_000),
            ..s.clone()
        })
        .collect();
    let c = analyze(
        1,
        &v,
        &host_with(blocked),
        w,
        &Inputs::new(&HashMap::new(), &HashMap::new()),
    )
    .chains;
    assert!(!c.iter().any(|c| c.rule == "cpu_contention"));
    // Without a scheduler record there is nothing to say.
    let c = analyze(
        1,
        &v,
        &Host::default(),
        w,
        &Inputs::new(&HashMap::new(), &HashMap::new()),
    )
    .chains;
    assert!(!c.iter().any(|c| c.rule == "cpu_contention"));
}

#[test]
fn select_quantile_equals_sorted_quantile() {
    // A deterministic scramble with many repeats.
    let values: Vec<u64> = (0..1001u64).map(|i| (i * 7919) % 503).collect();
    let mut sorted = values.clone();
    sorted.sort_unstable();
    for q in [0.0, 0.01, 0.5, 0.9, 0.95, 0.99, 1.0] {
        let mut scratch = values.clone();
        assert_eq!(
            super::select_quantile(&mut scratch, q),
            super::quantile(&sorted, q),
            "q={q}"
        );
    }
    assert_eq!(super::select_quantile(&mut [], 0.5), 0);
}

/// Runnable threads of the process tree during a call: the caller and two other threads, each
/// runnable for a known part of the call, and a thread of another process that must not count.
#[test]
fn crowding_counts_the_process_trees_runnable_threads_during_the_calls() {
    let call = ev(0.0, Op::CudaMalloc, 1, 1, 0, 10_000); // 0..10 ms, pid 10, tid 11
    let slice = |pid, tid, off: i64, on: i64, wakeup: Option<i64>, preempted| OffSlice {
        pid,
        tid,
        off_ns: off * MS,
        on_ns: on * MS,
        wakeup_ns: wakeup.map(|w| w * MS),
        preempted,
    };
    let host = host_with(vec![
        // The caller: preempted at 1 ms, back at 8 ms, nothing recorded after: runnable
        // from 1 to 8 ms (0.7 of the call).
        slice(10, 11, 1, 8, None, true),
        // A worker runnable throughout: preempted before the call, next off after it.
        slice(10, 500, -5, -4, None, true),
        slice(10, 500, 20, 21, None, true),
        // A worker asleep until woken at 4 ms, on at 6, off again at 8: 0.4 of the call.
        slice(10, 501, 2, 6, Some(4), false),
        slice(10, 501, 8, 30, Some(29), false),
        // Another traced process's busy thread.
        slice(99, 990, -5, -4, None, true),
        slice(99, 990, 20, 21, None, true),
    ]);
    let c = host.crowding(10, &[&call]).expect("recorded");
    assert!((c.mean - 2.1).abs() < 1e-9, "{c:?}");
    assert_eq!(c.peak, 3);
    assert_eq!(
        host.crowding_text(10, &[&call]).unwrap(),
        "2.1 threads of the process and its children runnable on average (peak 3) on 2 CPUs"
    );
    // Before any slice of the tree: nothing known to be runnable.
    let early = ev(-100.0, Op::CudaMalloc, 1, 1, 0, 10_000);
    assert_eq!(host.crowding(10, &[&early]).unwrap().mean, 0.0);
    assert!(host.crowding(42, &[&call]).is_none());
}

/// With call sites, the leak chain names where the unfreed memory was allocated, and explain's
/// top call sites count each site's calls, bytes and latency.
#[test]
fn call_sites_name_the_leak_and_rank_the_callers() {
    let mut v = growing(false, false);
    // Two call sites: every third allocation from the data loader, the rest from the model.
    for (i, e) in v.iter_mut().enumerate() {
        e.stack = stack_id(if i % 3 == 0 { 2 } else { 1 });
    }
    let labels: SiteLabels = [
        (1, "train.py:74 (train_step)".to_string()),
        (2, "data.py:12 (load)".to_string()),
    ]
    .into_iter()
    .map(|(id, label)| (stack_id(id).unwrap(), label))
    .collect();
    let w = window_of(&v);
    let report = analyze(
        1,
        &v,
        &Host::default(),
        w,
        &Inputs::new(&HashMap::new(), &labels),
    );
    let leak = report
        .chains
        .iter()
        .find(|c| c.rule == "leak")
        .expect("fires");
    let from_model = v.iter().filter(|e| e.stack == stack_id(1)).count();
    let from_loader = v.len() - from_model;
    assert!(
        leak.effect.contains(&format!(
            "from train.py:74 (train_step) ({from_model} allocations, {}), data.py:12 (load) ({from_loader} allocations",
            crate::units::format_bytes(from_model as u64 * MIB)
        )),
        "{}",
        leak.effect
    );
    let rows = &report.call_sites;
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0].site.as_str(), rows[0].calls, rows[0].bytes),
        (
            "train.py:74 (train_step)",
            from_model as u64,
            from_model as u64 * MIB
        )
    );
    assert_eq!(
        (rows[1].site.as_str(), rows[1].calls),
        ("data.py:12 (load)", from_loader as u64)
    );
    // Without labels (no --stack) there is no call-site table.
    assert!(analyze(
        1,
        &v,
        &Host::default(),
        w,
        &Inputs::new(&HashMap::new(), &HashMap::new())
    )
    .call_sites
    .is_empty());
}

/// Grouping by process is a stable sort by pid (each process's calls keep their time order),
/// with each process's range; one process is borrowed, not copied.
#[test]
fn calls_are_grouped_by_process_stably() {
    let mut v = Vec::new();
    for i in 0..10_001u64 {
        // Three processes, unevenly interleaved; equal times across processes.
        let mut e = ev((i / 2) as f64, Op::CudaMalloc, i, 0x1000 + i, 0, 1);
        e.pid = [30, 10, 20, 10, 10][(i % 5) as usize] + (i > 7000) as u32;
        v.push(e);
    }
    let (grouped, ranges) = group_by_pid(&v);
    let mut want = v.clone();
    want.sort_by_key(|e| e.pid);
    assert_eq!(&grouped[..], &want[..]);
    let pids: Vec<u32> = ranges.iter().map(|(pid, _)| *pid).collect();
    assert_eq!(pids, vec![10, 11, 20, 21, 30, 31]);
    for (pid, range) in &ranges {
        assert!(grouped[range.clone()].iter().all(|e| e.pid == *pid));
    }
    assert_eq!(ranges.last().unwrap().1.end, v.len());
    let one: Vec<Event> = v.iter().map(|e| Event { pid: 7, ..*e }).collect();
    let (grouped, ranges) = group_by_pid(&one);
    assert!(matches!(grouped, std::borrow::Cow::Borrowed(_)));
    assert_eq!(ranges, vec![(7, 0..one.len())]);
}

/// A training-like run on the allocator's probes: weights held, then steps of activations that
/// vary in size, a cudaMemGetInfo now and then, and a cudaMalloc that fails at the end.
fn allocator_run() -> Vec<Event> {
    let seg = |i: u64| 0x7f00_0000_0000 + i * 32 * MIB;
    let mut evs = Vec::new();
    let mut t = 0.0;
    let mut tick = |evs: &mut Vec<Event>, op: Op, size: u64, ptr: u64, ret: i32| {
        t += 0.5;
        evs.push(ev(
            t,
            op,
            size,
            ptr,
            ret,
            if op == Op::TorchMalloc || op == Op::TorchFree {
                0
            } else {
                5
            },
        ));
    };
    for i in 0..4 {
        tick(&mut evs, Op::CudaMalloc, 20 * MIB, seg(i), 0);
    }
    // Weights: a block at the start of each segment, held.
    for i in 0..4 {
        tick(&mut evs, Op::TorchMalloc, 6 * MIB, seg(i), 0);
    }
    for step in 0..200u64 {
        let i = step % 4;
        let size = (2 + step % 5) * MIB;
        tick(&mut evs, Op::TorchMalloc, size, seg(i) + 6 * MIB, 0);
        tick(&mut evs, Op::TorchMalloc, MIB, seg(i) + 6 * MIB + size, 0);
        tick(&mut evs, Op::TorchFree, 0, seg(i) + 6 * MIB, 0);
        tick(&mut evs, Op::TorchFree, 0, seg(i) + 6 * MIB + size, 0);
        if step % 20 == 0 {
            tick(&mut evs, Op::CudaMemGetInfo, 0, 0, 0);
            let info = evs.last_mut().unwrap();
            info.aux0 = 30 * MIB;
            info.aux1 = 128 * MIB;
        }
    }
    tick(&mut evs, Op::CudaMalloc, 40 * MIB, 0, 2);
    evs
}

/// The state a keyframe would hold after `evs`.
fn state_after(evs: &[Event]) -> crate::model::state::ProcessState {
    let mut s = crate::model::state::ProcessState {
        pid: 10,
        ..Default::default()
    };
    for e in evs {
        s.apply_memory(e);
        s.apply_join(e);
    }
    s
}

#[test]
fn a_report_started_from_a_keyframe_equals_one_from_the_first_call() {
    let evs = allocator_run();
    let window = Window {
        from_ns: evs[evs.len() / 2].ts_ns,
        to_ns: evs.last().unwrap().end_ns(),
    };
    let (comms, sites) = (HashMap::new(), HashMap::new());
    let inputs = Inputs::new(&comms, &sites);
    let whole = analyze(1, &evs, &Host::default(), window, &inputs);
    // A keyframe at a third of the run (before the window), encoded and decoded as stored.
    let cut = evs.len() / 3;
    let state = state_after(&evs[..cut]);
    let state = crate::model::state::ProcessState::decode(
        &state.encode().unwrap(),
        crate::model::state::KEYFRAME_FORMAT,
    )
    .unwrap();
    let mut c = Collector::new(window, &inputs, vec![state]);
    for e in &evs[cut..] {
        c.feed(e);
    }
    let from_keyframe = analyze_collected(1, c.finish(), &Host::default(), window, &inputs);
    let json = |r: &Explanation| serde_json::to_value(r).unwrap();
    assert_eq!(json(&from_keyframe), json(&whole));
    assert!(
        whole.chains.iter().any(|c| c.rule == "oom"),
        "{:?}",
        whole.chains
    );
}

#[test]
fn nothing_is_concluded_from_a_layout_tracer_did_not_see_whole() {
    let evs = allocator_run();
    // Started late: the first segments and the weights were never seen.
    let late: Vec<Event> = evs.iter().skip(8).copied().collect();
    let rules = rules_fired(&late);
    assert!(rules.contains(&"unknown_state"), "{rules:?}");
    for verdict in ["fragmentation", "early_warning", "leak", "rank_outlier"] {
        assert!(
            !rules.contains(&verdict),
            "{verdict} from unknown state: {rules:?}"
        );
    }
    let oom = chains(&late).into_iter().find(|c| c.rule == "oom").unwrap();
    assert!(oom.effect.contains("is unknown"), "{}", oom.effect);
    assert!(
        oom.effect.contains("what would settle it") || oom.effect.contains("would settle it"),
        "{}",
        oom.effect
    );
}

#[test]
fn select_quantile_with_zeros_equals_the_quantile_of_all() {
    let values: Vec<u64> = (0..50).map(|i| (i * 37 % 23) as u64).collect();
    for zeros in [0, 1, 10, 49, 500] {
        let mut all = values.clone();
        all.extend(std::iter::repeat_n(0, zeros));
        all.sort_unstable();
        for q in [0.0, 0.5, 0.9, 0.99, 1.0] {
            let mut v = values.clone();
            assert_eq!(
                select_quantile_with_zeros(&mut v, zeros as u64, q),
                quantile(&all, q),
                "{zeros} {q}"
            );
        }
    }
}

/// PyTorch's expandable segments at work: one reserved range, 20 MiB chunks created and
/// mapped into it as it grows, and pages unmapped and mapped again (a release to retry, then
/// growth), 1 ms apart; with `blocks`, PyTorch's blocks land in the range.
fn expandable_segment(blocks: bool) -> Vec<Event> {
    const RANGE: u64 = 0x7f00_0000_0000;
    const CHUNK: u64 = 20 * MIB;
    let mut v = vec![ev(0.0, Op::CuMemAddressReserve, 64 << 30, RANGE, 0, 10)];
    let mut t = 1.0;
    for i in 0..150u64 {
        let at = RANGE + (i % 30) * CHUNK;
        v.push(ev(t, Op::CuMemCreate, CHUNK, 0, 0, 20));
        v.push(ev(t + 0.1, Op::CuMemMap, CHUNK, at, 0, 5));
        if blocks {
            v.push(ev(t + 0.2, Op::TorchMalloc, CHUNK, at, 0, 1));
            v.push(ev(t + 0.3, Op::TorchFree, 0, at, 0, 1));
        }
        if i >= 30 {
            v.push(ev(t + 0.4, Op::CuMemUnmap, CHUNK, at, 0, 5));
            v.push(ev(t + 0.5, Op::CuMemRelease, CHUNK, 0, 0, 5));
        }
        t += 1.0;
    }
    v
}

#[test]
fn expandable_segments_are_the_allocator_not_a_bypass_nor_churn() {
    // Unrecognised (no setting, no blocks): the driver allocations are a bypass, their bytes
    // counted once (the chunks created, not the range reserved nor the mappings).
    let plain = chains(&expandable_segment(false));
    let bypass = plain
        .iter()
        .find(|c| c.rule == "driver_bypass")
        .unwrap_or_else(|| panic!("fires: {plain:#?}"));
    assert!(
        bypass.root.contains("2.9 GiB of device memory"),
        "{}",
        bypass.root
    );
    // By the pattern: PyTorch's blocks in the range.
    let fired = rules_fired(&expandable_segment(true));
    assert!(!fired.contains(&"driver_bypass"), "{fired:?}");
    assert!(!fired.contains(&"churn"), "{fired:?}");
    // By the settings.
    let events = expandable_segment(false);
    let expandable = std::collections::HashSet::from([10]);
    let (comms, sites) = (HashMap::new(), HashMap::new());
    let with_setting = analyze(
        1,
        &events,
        &Host::default(),
        window_of(&events),
        &Inputs {
            expandable: &expandable,
            ..Inputs::new(&comms, &sites)
        },
    );
    let fired: Vec<&str> = with_setting.chains.iter().map(|c| c.rule.name()).collect();
    assert!(!fired.contains(&"driver_bypass"), "{fired:?}");
    assert!(!fired.contains(&"churn"), "{fired:?}");
}

fn pool(reserved: u64, allocated: u64, free_blocks: u64, largest_free: u64) -> PoolStats {
    PoolStats {
        reserved,
        allocated,
        free_blocks,
        largest_free,
    }
}

fn failure(requested: u64, whole_segment: bool, large: PoolStats) -> allocator::Forensics {
    allocator::Forensics {
        ts_ns: 0,
        tid: 1,
        retry: false,
        raised: true,
        device_free_reported_ns: None,
        pages_unmapped: 0,
        device: 0,
        requested,
        total: large,
        outside: 0,
        unseen: 0,
        device_free: None,
        pools: vec![(Pool::Large, large)],
        private_free: 0,
        private_idle: 0,
        capture_underway: false,
        use_on_oom: false,
        mem_pool_free: 0,
        mem_pool_largest: 0,
        default_idle: 0,
        whole_segment,
    }
}

/// The expandable-segments OOM of a real 80 GB run: 78.4 GiB reserved, 132 MiB free in 13
/// blocks (largest 16.5 MiB). PyTorch asked for 4.94 GiB: capacity, and its cache's 0.2 % of
/// the memory held is not High fragmentation.
#[test]
fn a_tiny_cache_is_not_high_fragmentation_and_a_capacity_oom_is_not_fragmentation() {
    const GIB: u64 = 1 << 30;
    let reserved = 78 * GIB + 410 * MIB;
    let tiny = pool(reserved, reserved - 132 * MIB, 13, 33 * MIB / 2);
    let forced = allocator::Forced {
        count: 1,
        bytes: 20 * MIB,
        ..Default::default()
    };
    assert_eq!(
        rules::measured::fragmentation_severity(&forced, &tiny, reserved, true),
        Severity::Low
    );
    // The demo's: 296 MiB scattered in 64 blocks of 2.8 GiB, 142 segments (4 GiB) forced.
    let demo = pool(2867 * MIB, 2571 * MIB, 64, 16 * MIB);
    let forced = allocator::Forced {
        count: 142,
        bytes: 4 * GIB,
        ..Default::default()
    };
    assert_eq!(
        rules::measured::fragmentation_severity(&forced, &demo, 2867 * MIB, true),
        Severity::High
    );
    // The same cost on a device that never ran short (H200: 16 GiB forced over a run that
    // peaked at 4 GiB with 139 GiB free) cost memory, not a failure.
    assert_eq!(
        rules::measured::fragmentation_severity(&forced, &demo, 2867 * MIB, false),
        Severity::Medium
    );
    // PyTorch's request decides, not the 20 MiB chunk whose mapping failed.
    let chunk = failure(20 * MIB, false, tiny);
    assert_eq!(
        chunk.verdict(Some(4 * GIB + 962 * MIB)),
        allocator::OomVerdict::Capacity
    );
    assert_eq!(
        chunk.verdict(Some(30 * MIB)),
        allocator::OomVerdict::Fragmentation
    );
    // Without the message a chunk says nothing of the request: unknown, and said so.
    let allocator::OomVerdict::Unknown(why) = chunk.verdict(None) else {
        panic!("{:?}", chunk.verdict(None));
    };
    assert!(why.contains("message"), "{why}");
    // A failed cudaMalloc bounds the request: a cache that held the whole segment had the
    // bytes; one whose free bytes are all one block (which did not fit) did not.
    let scattered = pool(GIB, GIB - 30 * MIB, 4, 10 * MIB);
    assert_eq!(
        failure(20 * MIB, true, scattered).verdict(None),
        allocator::OomVerdict::Fragmentation
    );
    let whole = pool(GIB, GIB - 10 * MIB, 1, 10 * MIB);
    assert_eq!(
        failure(20 * MIB, true, whole).verdict(None),
        allocator::OomVerdict::Capacity
    );
}

/// Segments cycled while PyTorch's probes show its allocator at work are its cache being
/// released and refilled, not the program's churn (the real cs336 full-step snapshots: 20 MiB
/// segments freed and reserved again within 5 ms).
#[test]
fn segment_cycles_under_pytorchs_allocator_are_its_cache_released_and_refilled() {
    let mut v = Vec::new();
    for i in 0..200 {
        let t = i as f64 * 2.0;
        v.push(ev(t, Op::CudaMalloc, 20 * MIB, 0x7000_0000, 0, 20));
        v.push(ev(t + 0.5, Op::TorchMalloc, 12 * MIB, 0x7000_0000, 0, 0));
        v.push(ev(t + 0.7, Op::TorchFree, 0, 0x7000_0000, 0, 0));
        v.push(ev(t + 1.0, Op::CudaFree, 20 * MIB, 0x7000_0000, 0, 5));
    }
    let c = chains(&v);
    let churn = c.iter().find(|c| c.rule == "churn").expect("fires");
    assert!(
        churn.title.contains("cache released and refilled"),
        "{}",
        churn.title
    );
    assert!(
        !churn.fix.iter().any(|f| f.text.contains("keep the buffer")),
        "{:?}",
        churn.fix
    );
}

/// The calls of one process for the fragmentation-kind tests: (op, size, ptr, stream), 1 ms
/// apart; block events carry the stream in aux0.
fn calls(script: &[(Op, u64, u64, u64)]) -> Vec<Event> {
    script
        .iter()
        .enumerate()
        .map(|(i, &(op, size, ptr, stream))| {
            let mut e = ev(i as f64, op, size, ptr, 0, 1);
            e.aux0 = stream;
            e
        })
        .collect()
}

/// The forced segments' fragmentation kinds of a script.
fn kinds_of(script: &[(Op, u64, u64, u64)]) -> allocator::Forced {
    let evs = calls(script);
    let window = Window {
        from_ns: 0,
        to_ns: evs.last().unwrap().end_ns(),
    };
    let f = allocator::measure(&evs, window, AllocConf::default(), &HashMap::new());
    f.forced
}

const SEG_A: u64 = 0x7f00_0000_0000;
const SEG_B: u64 = 0x7f00_1000_0000;
const SEG_C: u64 = 0x7f00_2000_0000;

#[test]
fn split_remainders_between_live_blocks_are_one_kind() {
    use Op::{CudaMalloc as Seg, TorchFree as Free, TorchMalloc as Malloc};
    // Three 4 MiB blocks in a 20 MiB segment, the middle one freed: 4 MiB between live blocks
    // and the 8 MiB tail; a 10 MiB request fits neither.
    let forced = kinds_of(&[
        (Seg, 20 * MIB, SEG_A, 0),
        (Malloc, 4 * MIB, SEG_A, 0),
        (Malloc, 4 * MIB, SEG_A + 4 * MIB, 0),
        (Malloc, 4 * MIB, SEG_A + 8 * MIB, 0),
        (Free, 0, SEG_A + 4 * MIB, 0),
        (Seg, 10 * MIB, SEG_B, 0),
        (Malloc, 10 * MIB, SEG_B, 0),
    ]);
    assert_eq!(forced.count, 1);
    assert_eq!(
        forced.kinds,
        allocator::FragKinds {
            split: 12 * MIB,
            ..Default::default()
        }
    );
}

#[test]
fn whole_free_segments_too_small_are_another_kind() {
    use Op::{CudaMalloc as Seg, TorchFree as Free, TorchMalloc as Malloc};
    // Two wholly free 20 MiB segments hold 40 MiB; a 30 MiB request fits in neither.
    let forced = kinds_of(&[
        (Seg, 20 * MIB, SEG_A, 0),
        (Malloc, 20 * MIB, SEG_A, 0),
        (Seg, 20 * MIB, SEG_B, 0),
        (Malloc, 20 * MIB, SEG_B, 0),
        (Free, 0, SEG_A, 0),
        (Free, 0, SEG_B, 0),
        (Seg, 30 * MIB, SEG_C, 0),
        (Malloc, 30 * MIB, SEG_C, 0),
    ]);
    assert_eq!(forced.count, 1);
    assert_eq!(
        forced.kinds,
        allocator::FragKinds {
            spread: 40 * MIB,
            ..Default::default()
        }
    );
}

#[test]
fn free_blocks_of_another_stream_are_another_kind() {
    use Op::{CudaMalloc as Seg, TorchFree as Free, TorchMalloc as Malloc};
    // A free 20 MiB segment of stream 1; a 20 MiB request on stream 2 may not take it.
    let forced = kinds_of(&[
        (Seg, 20 * MIB, SEG_A, 1),
        (Malloc, 20 * MIB, SEG_A, 1),
        (Free, 0, SEG_A, 0),
        (Seg, 20 * MIB, SEG_B, 2),
        (Malloc, 20 * MIB, SEG_B, 2),
    ]);
    assert_eq!(forced.count, 1);
    assert_eq!(
        forced.kinds,
        allocator::FragKinds {
            other_stream: 20 * MIB,
            ..Default::default()
        }
    );
}

#[test]
fn blocks_held_for_another_streams_work_are_another_kind() {
    use Op::{CudaMalloc as Seg, TorchFree as Free, TorchMalloc as Malloc};
    // A 20 MiB block used on another stream (record_stream) and freed: the allocator records
    // an event and keeps the block until it completes; a 20 MiB request meanwhile gets a new
    // segment.
    let mut evs = calls(&[
        (Seg, 20 * MIB, SEG_A, 0),
        (Malloc, 20 * MIB, SEG_A, 0),
        (Free, 0, SEG_A, 0),
    ]);
    let mut record = ev(3.0, Op::CudaEventRecord, 0, 0x5555_0000, 0, 1);
    record.aux1 = 1;
    evs.push(record);
    for (i, (op, size, ptr)) in [(Seg, 20 * MIB, SEG_B), (Malloc, 20 * MIB, SEG_B)]
        .into_iter()
        .enumerate()
    {
        evs.push(ev(4.0 + i as f64, op, size, ptr, 0, 1));
    }
    let window = Window {
        from_ns: 0,
        to_ns: evs.last().unwrap().end_ns(),
    };
    let f = allocator::measure(&evs, window, AllocConf::default(), &HashMap::new());
    assert_eq!(f.forced.count, 1);
    assert_eq!(
        f.forced.kinds,
        allocator::FragKinds {
            pending: 20 * MIB,
            ..Default::default()
        }
    );
}
