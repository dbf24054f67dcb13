//! `tracer trace`'s options, grouped by what they govern.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::Args;
use tracer_cli::{
    serve::metrics as endpoint,
    units::{parse_duration, parse_size},
};
use tracer_common::maps::DEFAULT_RING_BYTES;

use super::{parse_share, AllocatorMode};

/// What is recorded, from which processes, and where.
#[derive(Debug, Args)]
pub struct RecordingArgs {
    /// Trace only this process (repeatable). Default: every process using a CUDA library.
    #[arg(long = "pid", value_name = "PID")]
    pub pids: Vec<u32>,
    /// Probe this library or executable (repeatable); replaces discovery.
    #[arg(long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,
    /// Stop after this long (e.g. 300s, 5m). Default: until Ctrl-C or SIGTERM.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    #[command(flatten)]
    pub db: crate::cmd::db::DbArgs,
    /// Bound the database size (e.g. 2GiB): the oldest sessions are deleted first.
    #[arg(long, value_parser = parse_size)]
    pub max_db: Option<u64>,
    /// Ring buffer size (a power of two, at least 4KiB).
    #[arg(long, value_parser = parse_size, default_value_t = DEFAULT_RING_BYTES as u64)]
    pub ring_size: u64,
    /// No live table on stderr (the summary is still printed).
    #[arg(long)]
    pub quiet: bool,
    /// Record each call's call site: the native user stack and, in CPython 3.10-3.13
    /// processes, the Python frames of the calling thread (see `tracer stacks`).
    #[arg(long)]
    pub stack: bool,
    /// Machine-readable stdout: one JSON line when recording starts (`"event":"started"`, with
    /// the session id) and one at the end (`"event":"summary"`) instead of the text summary.
    #[arg(long)]
    pub json: bool,
    /// Also measure tracer's own programs (kernel BPF statistics, a few tens of ns a call more
    /// while on): their runs and run time go into the summary.
    #[arg(long)]
    pub program_stats: bool,
    /// Never stop a process that opens a CUDA library tracer has not probed yet. By default
    /// the kernel stops it for the milliseconds attaching takes, so its first call is traced
    /// (not when its parent is a shell or sudo, or a debugger traces it); without, such a
    /// process may be found late, and is marked so in the session and in explain.
    #[arg(long)]
    pub no_hold: bool,
    /// NVIDIA's management library, asked at the start and at each out-of-memory which
    /// processes hold each GPU (those that allocated before the trace too): `off`, or a file
    /// (then required). Default: the system's libnvidia-ml.so.1 where the loader finds it.
    #[arg(long, value_name = "PATH|off")]
    pub nvml: Option<String>,
    /// Benchmark floor: the same probes with empty programs; counts calls, stores nothing.
    #[arg(long, hide = true)]
    pub floor: bool,
    /// Benchmark floor that also reads the clock at entry and return, as timing a call needs.
    #[arg(long, hide = true, conflicts_with = "floor")]
    pub floor_clock: bool,
    /// Benchmark: the USDT program does only its first N parts (1: the site's plan; 2: the
    /// thread and the stage; 3: the clock; 4: the arguments) and sends nothing; the runtime
    /// calls' programs are the floor's. What each part costs is the step between two.
    #[arg(long, hide = true, value_parser = clap::value_parser!(u32).range(1..=4),
          conflicts_with_all = ["floor", "floor_clock"])]
    pub usdt_parts: Option<u32>,
    /// Benchmark: no keyframes (what they cost is measured against this; --max-db then cannot
    /// evict the current session's calls).
    #[arg(long, hide = true, conflicts_with = "max_db")]
    pub no_keyframes: bool,
    /// Benchmark: no scheduler programs (what host context costs is measured against this).
    #[arg(long, hide = true)]
    pub no_host_context: bool,
    /// Tests and benchmarks: no discovery in the kernel (the once-a-second scan alone finds
    /// libraries, as on a kernel without the openat tracepoints).
    #[arg(long, hide = true)]
    pub no_open_watch: bool,
}

/// What is served while recording: Prometheus metrics, the OTLP push, pod names.
#[derive(Debug, Args)]
pub struct ServingArgs {
    /// Serve Prometheus metrics on this address: PORT (127.0.0.1:PORT), IP:PORT or
    /// [IPv6]:PORT. Read-only, no authentication: anything but loopback needs a firewall or a
    /// NetworkPolicy. Paths: /metrics, /healthz, /readyz.
    #[arg(long, value_name = "ADDR", value_parser = endpoint::parse_addr)]
    pub metrics: Option<SocketAddr>,
    /// Push the same metrics to an OpenTelemetry collector over OTLP/HTTP (protobuf), e.g.
    /// http://otel-collector:4318 (`/v1/metrics` is added to a URL without a path); https
    /// with the system's CA certificates. Default: the standard OTEL_EXPORTER_OTLP_ENDPOINT or
    /// OTEL_EXPORTER_OTLP_METRICS_ENDPOINT when set (`off`: not even then); their HEADERS,
    /// TIMEOUT, PROTOCOL and CERTIFICATE variables and OTEL_RESOURCE_ATTRIBUTES apply.
    #[arg(long, value_name = "URL|off")]
    pub otlp_endpoint: Option<String>,
    /// How often metrics are pushed over OTLP (default: OTEL_METRIC_EXPORT_INTERVAL, else 60s).
    #[arg(long, value_parser = parse_duration)]
    pub otlp_interval: Option<Duration>,
    /// Connections the metrics endpoint serves at once; more are closed at once, unread.
    #[arg(long, value_name = "N", default_value_t = endpoint::DEFAULT_MAX_CONNECTIONS, requires = "metrics")]
    pub metrics_max_connections: usize,
    /// How long an ended process's series stay (so its last figures are scraped or pushed).
    #[arg(long, value_parser = parse_duration, default_value = "5m", requires = "exported")]
    pub metrics_grace: Duration,
    /// Pod names for the series: `auto` (from the Kubernetes API with the pod's service
    /// account, when running in a cluster), `off`, or a kubeconfig file's path.
    #[arg(
        long,
        value_name = "auto|off|KUBECONFIG",
        default_value = "auto",
        requires = "exported"
    )]
    pub kubernetes: String,
    /// If tracing cannot start (no BPF, no uprobes), keep serving --metrics, unready, saying
    /// why, until stopped, instead of exiting (a DaemonSet's pod then stays up, not
    /// crash-looping). The exit status is still the error's.
    #[arg(long, requires = "metrics")]
    pub keep_serving: bool,
}

/// When PyTorch's allocator probes are armed.
#[derive(Debug, Args)]
pub struct ArmingArgs {
    /// PyTorch's allocator probes (a trap at each tensor allocation and free): `always`, in
    /// every process from the start; `auto`, armed per process while memory is tight (its
    /// device memory past --arm-share of the GPU, a device allocation after --arm-warmup, a
    /// failed allocation, PyTorch's out-of-memory error, or SIGUSR1 to tracer) and disarmed
    /// after --arm-quiet without one (SIGUSR2 ends SIGUSR1's asking); `off`, never. The CUDA
    /// calls and PyTorch's out-of-memory message are traced in every mode.
    #[arg(long, value_enum, default_value = "always")]
    pub allocator: AllocatorMode,
    /// `--allocator auto`: arm when a process holds this share of a GPU (0-1); the pressure
    /// lasts until it holds 0.1 less.
    #[arg(long, value_name = "SHARE", default_value_t = 0.85, value_parser = parse_share)]
    pub arm_share: f64,
    /// `--allocator auto`: device allocations this long after a process's first are cache
    /// misses, which arm.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub arm_warmup: Duration,
    /// `--allocator auto`: disarm after this long without a trigger...
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub arm_quiet: Duration,
    /// ...and never before this long armed.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub arm_min: Duration,
}

/// What tracer does at an early warning and at an out-of-memory: commands and evidence.
#[derive(Debug, Args)]
pub struct EvidenceArgs {
    /// Run this shell command when a traced process's allocator reaches the state in which its
    /// next request fails (the early warning), e.g. to checkpoint. It runs as the user who ran
    /// sudo (never as root), with TRACER_PID, TRACER_DEVICE, TRACER_REQUEST_BYTES,
    /// TRACER_LARGEST_FREE_BYTES, TRACER_DEVICE_FREE_BYTES, ... in its environment; its exit
    /// status goes into the session's notes.
    #[arg(long, value_name = "CMD")]
    pub on_warning: Option<String>,
    /// The user --on-warning's command runs as (default: the one who ran sudo).
    #[arg(long, value_name = "USER", requires = "on_warning")]
    pub on_warning_user: Option<String>,
    /// At most one run per process in this long.
    #[arg(long, value_parser = parse_duration, default_value = "60s", requires = "on_warning")]
    pub on_warning_interval: Duration,
    /// Kill a run still going after this long.
    #[arg(long, value_parser = parse_duration, default_value = "30s", requires = "on_warning")]
    pub on_warning_timeout: Duration,
    /// At each out-of-memory PyTorch raises in a traced process, write its evidence in
    /// DIR/<uid>/<job>/<time>-rank<R>-pid<P>/: PyTorch's memory snapshot at the OOM
    /// (snapshot.pickle, read by PyTorch's _memory_viz.py and memory_viz), the layout then
    /// (layout.json) and explain's answer (explain.json). Folders are made as the process's
    /// user, mode 0700, never through a link; DIR must be reached through no link, and it and
    /// every folder above it owned by root or you and sticky where others may write in it (as
    /// /tmp is).
    #[arg(long, value_name = "DIR")]
    pub dump_on_oom: Option<PathBuf>,
    /// Keep at most this many --dump-on-oom folders per user (the oldest removed first).
    #[arg(long, value_name = "N", default_value_t = 50, requires = "dump_on_oom")]
    pub dump_max: usize,
    /// Run this shell command once each --dump-on-oom folder is complete (upload it, page
    /// someone), as --on-warning's runs (the user who ran sudo, or --on-oom-user; never root),
    /// with TRACER_DUMP_DIR, TRACER_PID, TRACER_JOB, TRACER_RANK in its environment.
    #[arg(long, value_name = "CMD", requires = "dump_on_oom")]
    pub on_oom: Option<String>,
    /// The user --on-oom's command runs as (default: the one who ran sudo).
    #[arg(long, value_name = "USER", requires = "on_oom")]
    pub on_oom_user: Option<String>,
    /// Kill an --on-oom run still going after this long.
    #[arg(long, value_parser = parse_duration, default_value = "60s", requires = "on_oom")]
    pub on_oom_timeout: Duration,
}
