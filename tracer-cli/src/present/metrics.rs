//! The Prometheus text exposition of a recording (`tracer trace --metrics`): per process (pid,
//! comm, rank, and pod when known) its calls, errors, bytes and latency histogram per op, its
//! device memory and the allocator's figures per device, its OOMs, failed allocations, retries
//! and early warnings; per physical GPU who holds it; then tracer's own health. Labels stay
//! bounded: never pointers, sizes or stacks, at most [`MAX_PROCESSES`] processes and
//! [`MAX_GPUS`] GPUs.
//!
//! Over 700 lines because the page is one encoder whose families share their labels and
//! bounds, and its test (about 170 lines) renders a whole page at once.

use prometheus::{
    proto::{Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType},
    Encoder as _, TextEncoder,
};

use tracer_common::OpClass;

use crate::{
    model::{
        figures::{ProcessFigures, LATENCY_BOUNDS_NS},
        live::AllocatorRow,
    },
    record::RecordingStatus,
    traced::pods::PodName,
};

/// Processes exported at most (the most recently seen pids beyond are counted, not shown).
pub const MAX_PROCESSES: usize = 512;

/// The text format's content type.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

/// Whether tracer is recording, and why not.
#[derive(Clone, Debug, Default)]
pub struct Health {
    /// Probes are attached and calls are being recorded.
    pub tracing: bool,
    /// Why not, when not (one series carries it).
    pub reason: String,
    pub session: Option<i64>,
    /// Connections the endpoint refused (over its limit).
    pub refused: u64,
    /// What the OTLP sender did, when metrics are pushed.
    pub otlp: Option<super::otlp::OtlpCounts>,
}

/// The exposition: every family with at least one series.
pub fn render(
    snapshot: Option<&RecordingStatus>,
    health: &Health,
    pod_name: &dyn Fn(&str) -> Option<PodName>,
) -> String {
    text(&families(snapshot, health, pod_name))
}

/// Every family with at least one series: what the page shows and OTLP pushes.
pub fn families(
    snapshot: Option<&RecordingStatus>,
    health: &Health,
    pod_name: &dyn Fn(&str) -> Option<PodName>,
) -> Vec<MetricFamily> {
    let mut families = Families::default();
    if let Some(s) = snapshot {
        process_families(&mut families, s, pod_name);
        gpu_families(&mut families, s);
    }
    health_families(&mut families, snapshot, health);
    families.done()
}

/// The text format of `families`.
pub fn text(families: &[MetricFamily]) -> String {
    let mut out = Vec::new();
    // Families are checked non-empty as they are made; an encoding error can then only be a
    // write to a Vec, which does not fail.
    let _ = TextEncoder::new().encode(families, &mut out);
    String::from_utf8(out).unwrap_or_default()
}

/// Families by name, in the order first made.
#[derive(Default)]
struct Families {
    list: Vec<MetricFamily>,
}

impl Families {
    fn add(
        &mut self,
        name: &str,
        help: &str,
        kind: MetricType,
        labels: &[(&str, String)],
        value: Value,
    ) {
        let i = match self.list.iter().position(|f| f.name() == name) {
            Some(i) => i,
            None => {
                let mut f = MetricFamily::default();
                f.set_name(name.into());
                f.set_help(help.into());
                f.set_field_type(kind);
                self.list.push(f);
                self.list.len() - 1
            }
        };
        let mut m = Metric::default();
        m.set_label(
            labels
                .iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(k, v)| {
                    let mut l = LabelPair::default();
                    l.set_name((*k).into());
                    l.set_value(v.clone());
                    l
                })
                .collect(),
        );
        match value {
            Value::Counter(v) => {
                let mut c = Counter::default();
                c.set_value(v);
                m.set_counter(c);
            }
            Value::Gauge(v) => {
                let mut g = Gauge::default();
                g.set_value(v);
                m.set_gauge(g);
            }
            Value::Histogram(h) => m.set_histogram(h),
        }
        let mut metrics = self.list[i].take_metric();
        metrics.push(m);
        self.list[i].set_metric(metrics);
    }

    fn counter(&mut self, name: &str, help: &str, labels: &[(&str, String)], v: u64) {
        self.add(
            name,
            help,
            MetricType::COUNTER,
            labels,
            Value::Counter(v as f64),
        );
    }

    fn gauge(&mut self, name: &str, help: &str, labels: &[(&str, String)], v: f64) {
        self.add(name, help, MetricType::GAUGE, labels, Value::Gauge(v));
    }

    fn done(self) -> Vec<MetricFamily> {
        self.list
    }
}

enum Value {
    Counter(f64),
    Gauge(f64),
    Histogram(Histogram),
}

/// A process's identifying labels. The pod's are not `namespace`, `pod` and `container`: a
/// Prometheus scraping tracer in Kubernetes gives those of tracer's own pod to every series.
fn process_labels(
    p: &ProcessFigures,
    pod_name: &dyn Fn(&str) -> Option<PodName>,
) -> Vec<(&'static str, String)> {
    let mut labels = vec![
        ("pid", p.pid.to_string()),
        ("comm", p.comm.clone()),
        ("rank", p.rank.clone().unwrap_or_default()),
    ];
    if let Some(pod) = &p.pod {
        labels.push(("pod_uid", pod.pod_uid.clone()));
        if let Some(name) = pod_name(&pod.pod_uid) {
            let container = pod
                .container_id
                .as_ref()
                .and_then(|id| name.containers.get(id).cloned())
                .unwrap_or_default();
            labels.push(("pod_namespace", name.namespace));
            labels.push(("pod_name", name.name));
            labels.push(("container_name", container));
        }
    }
    labels
}

fn process_families(
    f: &mut Families,
    s: &RecordingStatus,
    pod_name: &dyn Fn(&str) -> Option<PodName>,
) {
    let shown: Vec<&ProcessFigures> = {
        let mut all: Vec<&ProcessFigures> = s.figures.processes().collect();
        // The living first, then the most recently ended; the highest pids among equals.
        all.sort_by_key(|p| {
            (
                p.ended.is_some(),
                std::cmp::Reverse(p.ended),
                std::cmp::Reverse(p.pid),
            )
        });
        all.truncate(MAX_PROCESSES);
        all
    };
    for p in &shown {
        let base = process_labels(p, pod_name);
        for (op, o) in &p.ops {
            let mut l = base.clone();
            l.push(("op", op.name().to_owned()));
            f.counter(
                "tracer_calls_total",
                "CUDA runtime, driver and allocator calls traced, per op.",
                &l,
                o.calls,
            );
            f.counter(
                "tracer_call_errors_total",
                "Calls that returned an error, per op.",
                &l,
                o.errors,
            );
            f.counter(
                "tracer_call_bytes_total",
                "Bytes of the successful allocations and frees, per op.",
                &l,
                o.bytes,
            );
            if matches!(op.spec().class, OpClass::BlockAlloc | OpClass::BlockFree) {
                // The allocator's probes mark a moment: they have no duration.
                continue;
            }
            f.add(
                "tracer_call_duration_seconds",
                "How long each call took, from entry to return.",
                MetricType::HISTOGRAM,
                &l,
                Value::Histogram(histogram(&o.buckets, o.duration_sum_ns)),
            );
        }
        for (&device, d) in &p.devices {
            let mut l = base.clone();
            l.push(("device", device.to_string()));
            l.push(("gpu", gpu_of(p, device)));
            f.counter(
                "tracer_oom_total",
                "Times PyTorch raised OutOfMemoryError.",
                &l,
                d.ooms,
            );
            for (verdict, n) in &d.verdicts {
                let mut l = l.clone();
                l.push(("verdict", verdict.clone()));
                f.counter(
                    "tracer_oom_verdicts_total",
                    "OOMs explain judged (with --dump-on-oom), by its verdict: what held the memory the request needed (fragmentation, other_processes, private_pools, this_process, ...).",
                    &l,
                    *n,
                );
            }
            f.counter(
                "tracer_allocation_failures_total",
                "Device allocations refused for want of memory, each attempt once (cudaMalloc and the cuMemAlloc_v2 inside it are one).",
                &l,
                d.alloc_failures,
            );
            f.counter(
                "tracer_allocation_retries_total",
                "Failed device allocations the allocator retried after releasing its cache (PyTorch's num_alloc_retries).",
                &l,
                d.retries,
            );
            f.counter(
                "tracer_early_warnings_total",
                "Times the allocator reached the state in which its next request fails (largest free block below the requests being made, device too full for a new segment).",
                &l,
                d.warnings,
            );
        }
        // A pid reused while the ended process's last figures are kept has both: the series
        // are the process's these figures are (one row per device).
        let mut devices = std::collections::BTreeSet::new();
        for row in s
            .allocators
            .iter()
            .filter(|r| r.pid == p.pid && r.exited == p.ended.is_some())
        {
            if devices.insert(row.device) {
                allocator_families(f, &base, row, gpu_of(p, row.device));
            }
        }
    }
    let omitted = s.figures.len().saturating_sub(shown.len());
    f.gauge(
        "tracer_processes",
        "Processes with series (living, and ended within the grace period).",
        &[],
        shown.len() as f64,
    );
    f.gauge(
        "tracer_processes_omitted",
        "Processes left out of the series to keep them bounded.",
        &[],
        omitted as f64,
    );
}

/// The physical GPU behind a process's device number, as a label: "GPU 3", a UUID, or, where
/// the process's root names no NVIDIA device, its number and mount namespace.
fn gpu_of(p: &ProcessFigures, device: i32) -> String {
    p.placement
        .as_ref()
        .map_or_else(|| format!("GPU {device}"), |place| place.gpu(device).key)
}

/// At most this many GPUs get per-GPU series (a node has 8 or 16).
const MAX_GPUS: usize = 64;

/// Per physical GPU: the traced processes and jobs holding memory on it, their bytes, and the
/// bytes in use that none of them held, so a co-tenant shows beside the job it crowds.
fn gpu_families(f: &mut Families, s: &RecordingStatus) {
    #[derive(Default)]
    struct Gpu {
        pids: std::collections::BTreeSet<u32>,
        jobs: std::collections::BTreeSet<String>,
        held: u64,
        /// The freshest reading: (when, capacity, free).
        said: Option<(i64, u64, i64)>,
    }
    let mut gpus: std::collections::BTreeMap<String, Gpu> = std::collections::BTreeMap::new();
    // Every GPU a process was seen on keeps its series (zero once its processes end).
    for row in &s.allocators {
        let Some(p) = s.figures.get(row.pid) else {
            continue;
        };
        let held = row.stats.reserved + row.outside;
        let key = gpu_of(p, row.device);
        if !gpus.contains_key(&key) && gpus.len() >= MAX_GPUS {
            continue;
        }
        let g = gpus.entry(key).or_default();
        if row.exited {
            continue;
        }
        if held > 0 {
            g.pids.insert(row.pid);
            g.jobs.insert(
                p.placement
                    .as_ref()
                    .map_or_else(|| format!("pid {}", p.pid), |place| place.job.clone()),
            );
            g.held += held;
        }
        if let (Some(d), Some(total)) = (row.device_said, row.device_total) {
            if g.said.is_none_or(|(at, _, _)| d.reported_ns > at) {
                g.said = Some((d.reported_ns, total, d.free));
            }
        }
    }
    for (gpu, g) in &gpus {
        let l = [("gpu", gpu.clone())];
        f.gauge(
            "tracer_gpu_processes",
            "Traced processes holding device memory on the GPU.",
            &l,
            g.pids.len() as f64,
        );
        f.gauge(
            "tracer_gpu_jobs",
            "Jobs holding device memory on the GPU (a job: its torchelastic run, its MASTER_ADDR:MASTER_PORT, else the process alone); more than one: co-tenants.",
            &l,
            g.jobs.len() as f64,
        );
        f.gauge(
            "tracer_gpu_traced_bytes",
            "Device memory traced processes hold on the GPU through the traced calls.",
            &l,
            g.held as f64,
        );
        if let Some((at, total, free)) = g.said {
            let in_use = total.saturating_sub(free.max(0) as u64);
            f.gauge(
                "tracer_gpu_untraced_bytes",
                "Device memory in use that no traced process holds (CUDA contexts, processes that allocated before the trace, libraries not traced), by the freshest cudaMemGetInfo of a traced process on the GPU, its own calls since counted.",
                &l,
                in_use.saturating_sub(g.held) as f64,
            );
            f.gauge(
                "tracer_gpu_memory_said_timestamp_seconds",
                "When that cudaMemGetInfo was made.",
                &l,
                at as f64 / 1e9,
            );
        }
    }
}

fn allocator_families(
    f: &mut Families,
    base: &[(&'static str, String)],
    row: &AllocatorRow,
    gpu: String,
) {
    let mut l = base.to_vec();
    l.push(("device", row.device.to_string()));
    l.push(("gpu", gpu));
    let held = row.stats.reserved + row.outside;
    f.gauge(
        "tracer_device_memory_bytes",
        "Device memory the process holds through the traced calls (allocated and not yet freed).",
        &l,
        held as f64,
    );
    if row.view != "blocks" {
        // Without the allocator's own probes only the segments are known.
        return;
    }
    let s = &row.stats;
    f.gauge(
        "tracer_allocator_allocated_bytes",
        "Bytes in blocks the caching allocator handed out (torch.cuda.memory_allocated).",
        &l,
        s.allocated as f64,
    );
    f.gauge(
        "tracer_allocator_reserved_bytes",
        "Device memory the caching allocator holds in segments (torch.cuda.memory_reserved).",
        &l,
        s.reserved as f64,
    );
    f.gauge(
        "tracer_allocator_unseen_bytes",
        "Segments whose contents tracer did not see (--allocator auto armed after they were made): not in allocated or reserved, their free room unknown, so the largest free block is a lower bound while this is above 0.",
        &l,
        row.unseen as f64,
    );
    f.gauge(
        "tracer_allocator_free_blocks",
        "Free blocks inside the allocator's segments.",
        &l,
        s.free_blocks as f64,
    );
    f.gauge(
        "tracer_allocator_largest_free_block_bytes",
        "The largest free block in the allocator's default pools: the largest request served without a new segment.",
        &l,
        s.largest_free as f64,
    );
    f.gauge(
        "tracer_allocator_fragmentation_ratio",
        "1 - largest free block / cached bytes, in the device's worst pool (0: one free piece; near 1: scattered).",
        &l,
        row.fragmentation,
    );
    f.gauge(
        "tracer_allocator_private_pool_reserved_bytes",
        "Of the reserved bytes, those in private pools (CUDA graphs', MemPools'), whose free blocks serve only requests routed to their pool.",
        &l,
        row.private.reserved as f64,
    );
    f.gauge(
        "tracer_allocator_private_pool_free_bytes",
        "Free bytes inside private pools: PyTorch's out-of-memory message counts them \"allocated in private pools\"; no eager request may use them.",
        &l,
        row.private.cached() as f64,
    );
    f.gauge(
        "tracer_allocator_largest_request_bytes",
        "The largest block requested since the previous update (about a second).",
        &l,
        row.largest_request as f64,
    );
    f.gauge(
        "tracer_allocator_outside_bytes",
        "Device memory the process holds outside the allocator's segments.",
        &l,
        row.outside as f64,
    );
}

/// A histogram from per-bucket counts (the last above every bound) and a sum in ns.
fn histogram(buckets: &[u64], sum_ns: u64) -> Histogram {
    let mut h = Histogram::default();
    let mut cumulative = 0;
    let mut out = Vec::with_capacity(LATENCY_BOUNDS_NS.len());
    for (i, &bound) in LATENCY_BOUNDS_NS.iter().enumerate() {
        cumulative += buckets[i];
        let mut b = Bucket::default();
        b.set_upper_bound(bound as f64 / 1e9);
        b.set_cumulative_count(cumulative);
        out.push(b);
    }
    h.set_bucket(out);
    h.set_sample_count(buckets.iter().sum());
    h.set_sample_sum(sum_ns as f64 / 1e9);
    h
}

fn health_families(f: &mut Families, s: Option<&RecordingStatus>, health: &Health) {
    f.gauge(
        "tracer_tracing",
        "1 while probes are attached and calls are recorded; 0 when tracer cannot trace (see tracer_not_tracing_info).",
        &[],
        if health.tracing { 1.0 } else { 0.0 },
    );
    if !health.tracing {
        f.gauge(
            "tracer_not_tracing_info",
            "Why tracer is not tracing.",
            &[("reason", health.reason.clone())],
            1.0,
        );
    }
    f.counter(
        "tracer_metrics_connections_refused_total",
        "Connections to this endpoint refused because it was at its connection limit.",
        &[],
        health.refused,
    );
    if let Some(o) = &health.otlp {
        f.counter(
            "tracer_otlp_batches_sent_total",
            "Metric batches the OTLP collector took.",
            &[],
            o.sent,
        );
        f.counter(
            "tracer_otlp_batches_dropped_total",
            "Metric batches dropped: past the queue's bound while the collector was down or slow, or refused by it.",
            &[],
            o.dropped,
        );
        f.counter(
            "tracer_otlp_export_failures_total",
            "OTLP export attempts that failed (retried with backoff unless refused for good).",
            &[],
            o.failed,
        );
    }
    let Some(s) = s else { return };
    if let Some(session) = health.session {
        f.gauge(
            "tracer_session",
            "The session being recorded (its id in the database).",
            &[],
            session as f64,
        );
    }
    f.gauge("tracer_probes", "Probes attached.", &[], s.probes as f64);
    f.gauge(
        "tracer_libraries",
        "Libraries probed.",
        &[],
        s.libraries as f64,
    );
    let c = &s.counters;
    f.counter(
        "tracer_calls_entered_total",
        "Traced calls entered (kernel count).",
        &[],
        c.entries,
    );
    f.counter(
        "tracer_events_read_total",
        "Events read from the kernel's ring buffer.",
        &[],
        c.events_read,
    );
    f.counter(
        "tracer_events_stored_total",
        "Events committed to the database.",
        &[],
        c.events_stored,
    );
    for (counter, v) in c.losses() {
        f.counter(
            "tracer_lost_total",
            "What tracer could not keep, by the session counter that counts it (dropped_ring_full: events lost to a full ring buffer).",
            &[("counter", counter.into())],
            v,
        );
    }
    f.counter(
        "tracer_events_late_total",
        "Events stored after events made later than them (their program was held off its CPU).",
        &[],
        c.events_late,
    );
    f.counter(
        "tracer_calls_before_interpreter_total",
        "Calls of Python processes made before tracer registered their interpreter (no Python frames).",
        &[],
        c.calls_before_interpreter,
    );
    f.gauge(
        "tracer_db_bytes",
        "Bytes the database uses (what --max-db bounds).",
        &[],
        s.db_bytes as f64,
    );
    f.counter(
        "tracer_sessions_evicted_total",
        "Older sessions deleted to keep the database under --max-db.",
        &[],
        s.sessions_evicted,
    );
    let mode = [("mode", s.allocator_mode.to_owned())];
    f.gauge(
        "tracer_allocator_probes_armed",
        "Processes whose PyTorch allocator probes are armed now (--allocator auto; the others' allocator series carry only the device bytes held, view=\"segments\").",
        &mode,
        s.armed_now as f64,
    );
    f.counter(
        "tracer_allocator_armings_total",
        "Times --allocator auto armed a process's PyTorch allocator probes.",
        &mode,
        s.armings,
    );
    f.counter(
        "tracer_allocator_disarmings_total",
        "Times --allocator auto disarmed them (quiet, on demand, or the process ended).",
        &mode,
        s.disarmings,
    );
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tracer_common::Op;

    use super::*;
    use crate::model::{
        figures::{Figures, PodRef},
        layout::PoolStats,
        Event,
    };

    fn call(pid: u32, op: Op, duration_ns: u64) -> Event {
        Event {
            ts_ns: 0,
            duration_ns,
            size: 4096,
            ptr: 0x10,
            aux0: 0,
            aux1: 0,
            pid,
            tid: pid,
            ret: 0,
            device: 0,
            stack: None,
            op,
        }
    }

    fn row(pid: u32, reserved: u64, exited: bool) -> AllocatorRow {
        AllocatorRow {
            pid,
            device: 0,
            rank: None,
            view: "blocks",
            stats: PoolStats {
                allocated: 1,
                reserved,
                free_blocks: 1,
                largest_free: 1,
            },
            fragmentation: 0.25,
            private: PoolStats::default(),
            outside: 0,
            unseen: 0,
            largest_request: 0,
            device_said: None,
            device_total: None,
            exited,
        }
    }

    /// A process in a job of its own (or of `job`'s rendezvous) on host GPU 3.
    fn on_gpu3(pid: u32, job: Option<&str>) -> crate::model::Placement {
        let env = match job {
            Some(port) => [
                ("MASTER_ADDR".to_owned(), "10.0.0.1".to_owned()),
                ("MASTER_PORT".to_owned(), port.to_owned()),
            ]
            .into(),
            None => Default::default(),
        };
        crate::model::Placement::new(pid, &env, Some(r#"{"minors":[3],"mount_ns":1}"#))
    }

    #[test]
    fn series_per_process_with_pods_histograms_and_no_duplicates() {
        let mut figures = Figures::default();
        let pod = PodRef {
            pod_uid: "u-1".into(),
            container_id: Some("c1".into()),
        };
        figures.describe(
            7,
            "python3",
            Some("rank 0/2".into()),
            Some(pod),
            on_gpu3(7, Some("29500")),
        );
        figures.apply(&call(7, Op::CudaMalloc, 3_000));
        figures.apply(&call(7, Op::CudaMalloc, 2_000_000));
        figures.apply(&call(7, Op::TorchMalloc, 0));
        figures.describe(8, "bash", None, None, on_gpu3(8, Some("29500")));
        figures.apply(&call(8, Op::CudaMalloc, 1));
        figures.exited(8, Instant::now());
        // Another job on the same GPU, which asked the device what it had free.
        figures.describe(9, "python3", None, None, on_gpu3(9, None));
        figures.apply(&call(9, Op::CudaMalloc, 1));
        let mut tenant = row(9, 200, false);
        tenant.device_said = Some(crate::model::pressure::DeviceFree {
            free: 600,
            reported_ns: 5_000_000_000,
        });
        tenant.device_total = Some(1000);
        let snapshot = RecordingStatus {
            elapsed: Duration::from_secs(1),
            libraries: 1,
            probes: 2,
            stats: Default::default(),
            counters: Default::default(),
            // pid 7 lives; an earlier process with its pid ended: only the living one's figures.
            allocators: vec![
                row(7, 100, false),
                row(7, 50, true),
                row(8, 30, true),
                tenant,
            ],
            figures,
            db_bytes: 4096,
            sessions_evicted: 0,
            allocator_mode: "always",
            armed_now: 0,
            armings: 0,
            disarmings: 0,
        };
        let names = |uid: &str| {
            (uid == "u-1").then(|| PodName {
                namespace: "ml".into(),
                name: "trainer-0".into(),
                containers: [("c1".to_owned(), "trainer".to_owned())].into(),
                job: None,
            })
        };
        let health = Health {
            tracing: true,
            session: Some(3),
            ..Health::default()
        };
        let page = render(Some(&snapshot), &health, &names);
        let who = r#"pid="7",comm="python3",rank="rank 0/2",pod_uid="u-1",pod_namespace="ml",pod_name="trainer-0",container_name="trainer""#;
        assert!(
            page.contains(&format!(
                "tracer_calls_total{{{who},op=\"cudaMalloc\"}} 2\n"
            )),
            "{page}"
        );
        // Cumulative buckets: 3 us in le=5e-6 and above; 2 ms from le=2.5e-3.
        assert!(page.contains(&format!("tracer_call_duration_seconds_bucket{{{who},op=\"cudaMalloc\",le=\"0.000005\"}} 1\n")), "{page}");
        assert!(
            page.contains(&format!(
                "tracer_call_duration_seconds_bucket{{{who},op=\"cudaMalloc\",le=\"0.0025\"}} 2\n"
            )),
            "{page}"
        );
        assert!(page.contains(&format!(
            "tracer_call_duration_seconds_count{{{who},op=\"cudaMalloc\"}} 2\n"
        )));
        // The allocator's probes have no duration: no histogram for them.
        assert!(!page.contains("tracer_call_duration_seconds_count{pid=\"7\",comm=\"python3\",rank=\"rank 0/2\",pod_uid=\"u-1\",pod_namespace=\"ml\",pod_name=\"trainer-0\",container_name=\"trainer\",op=\"pytorch:malloc\"}"));
        assert_eq!(
            page.matches(&format!(
                "tracer_allocator_reserved_bytes{{{who},device=\"0\",gpu=\"GPU 3\"}}"
            ))
            .count(),
            1
        );
        assert!(page.contains(&format!(
            "tracer_allocator_reserved_bytes{{{who},device=\"0\",gpu=\"GPU 3\"}} 100\n"
        )));
        // The ended process keeps its last figures, without pod labels it never had.
        assert!(
            page.contains(
                "tracer_allocator_reserved_bytes{pid=\"8\",comm=\"bash\",device=\"0\",gpu=\"GPU 3\"} 30\n"
            ),
            "{page}"
        );
        // GPU 3: the living processes of two jobs, what they hold, and the 100 bytes in use
        // that neither held when pid 9's cudaMemGetInfo said.
        for line in [
            "tracer_gpu_processes{gpu=\"GPU 3\"} 2\n",
            "tracer_gpu_jobs{gpu=\"GPU 3\"} 2\n",
            "tracer_gpu_traced_bytes{gpu=\"GPU 3\"} 300\n",
            "tracer_gpu_untraced_bytes{gpu=\"GPU 3\"} 100\n",
            "tracer_gpu_memory_said_timestamp_seconds{gpu=\"GPU 3\"} 5\n",
        ] {
            assert!(page.contains(line), "{line} not in {page}");
        }
        assert!(page.contains("tracer_processes 3\n") && page.contains("tracer_session 3\n"));
        assert!(page.contains("tracer_tracing 1\n") && !page.contains("tracer_not_tracing_info{"));
    }
}
