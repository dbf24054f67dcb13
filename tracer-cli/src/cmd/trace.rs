//! `tracer trace`: record every call into the database, show a live table, and flush
//! everything on Ctrl-C, SIGTERM, --duration, or when the traced processes are gone.

use std::{io::IsTerminal as _, net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Result;
use clap::Args;
use tracer_cli::model::arming::{Mode, Settings};
use tracer_cli::{
    exit::user_error,
    paths,
    present::{self, live},
    record::{
        dump::{DumpOnOom, OnOom, OomReport, OomSink},
        on_warning::OnWarning,
        signals, RecordOptions, Recording, RecordingStatus, Stop,
    },
    serve::{
        metrics::{self as endpoint, MetricsServer},
        otlp::{OtlpConfig, OtlpPusher},
    },
    traced::pods::{KubeSource, PodDirectory},
    units::{parse_duration, parse_size},
};
use tracer_common::maps::DEFAULT_RING_BYTES;

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("exported").multiple(true).args(["metrics", "otlp_endpoint"])))]
pub struct TraceArgs {
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
    pub db: super::db::DbArgs,
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
    /// user, mode 0700, never through a link; DIR must be no link, owned by root or you, and
    /// sticky where others may write in it (as /tmp is).
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
    /// NVIDIA's management library, asked at the start and at each out-of-memory which
    /// processes hold each GPU (those that allocated before the trace too): `off`, or a file
    /// (then required). Default: the system's libnvidia-ml.so.1 where the loader finds it.
    #[arg(long, value_name = "PATH|off")]
    pub nvml: Option<String>,
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
    /// Benchmark floor: the same probes with empty programs; counts calls, stores nothing.
    #[arg(long, hide = true)]
    pub floor: bool,
    /// Benchmark floor that also reads the clock at entry and return, as timing a call needs.
    #[arg(long, hide = true, conflicts_with = "floor")]
    pub floor_clock: bool,
    /// Benchmark: no keyframes (what they cost is measured against this; --max-db then cannot
    /// evict the current session's calls).
    #[arg(long, hide = true, conflicts_with = "max_db")]
    pub no_keyframes: bool,
    /// Benchmark: no scheduler programs (what host context costs is measured against this).
    #[arg(long, hide = true)]
    pub no_host_context: bool,
}

/// `--allocator`'s values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AllocatorMode {
    Always,
    Auto,
    Off,
}

impl From<AllocatorMode> for Mode {
    fn from(m: AllocatorMode) -> Mode {
        match m {
            AllocatorMode::Always => Mode::Always,
            AllocatorMode::Auto => Mode::Auto,
            AllocatorMode::Off => Mode::Off,
        }
    }
}

/// A share of a GPU: more than 0, at most 1.
fn parse_share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 1.0 => Ok(v),
        _ => Err(format!(
            "{text:?} is not a share of the GPU: give a number above 0 and at most 1, e.g. 0.85"
        )),
    }
}

fn arming_settings(args: &TraceArgs) -> Settings {
    let ns = |d: Duration| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
    Settings {
        arm_share: args.arm_share,
        hold_share: (args.arm_share - 0.1).max(0.0),
        warmup_ns: ns(args.arm_warmup),
        quiet_ns: ns(args.arm_quiet),
        min_armed_ns: ns(args.arm_min),
    }
}

pub fn run(args: TraceArgs) -> Result<()> {
    // Signals are caught from here on: a Ctrl-C during set-up still ends in a flushed session.
    let (stop_tx, stops) = std::sync::mpsc::channel();
    signals::stop_on_signals(stop_tx)?;
    let who = paths::invoker();
    let db = args.db.path_for(&who)?;
    let on_warning = match &args.on_warning {
        Some(command) => Some(OnWarning {
            command: command.clone(),
            user: OnWarning::resolve_user(args.on_warning_user.as_deref(), who.owner)
                .map_err(|e| user_error(format!("{e:#}")))?,
            interval: args.on_warning_interval,
            timeout: args.on_warning_timeout,
        }),
        None => None,
    };
    let otlp = OtlpConfig::read(args.otlp_endpoint.as_deref(), args.otlp_interval, &|name| {
        std::env::var(name).ok()
    })?;
    // Each OOM also as a log record, to the same collector (with --dump-on-oom).
    let oom_logs = match (&otlp, &args.dump_on_oom) {
        (Some(config), Some(_)) => Some(Arc::new(OtlpPusher::start(
            config.for_logs(&|name| std::env::var(name).ok())?,
        )?)),
        _ => None,
    };
    let exporter = if args.metrics.is_some() || otlp.is_some() {
        Some(Exporter::start(args.metrics, otlp, &args)?)
    } else {
        None
    };
    let started = Recording::start(RecordOptions {
        pids: args.pids.clone(),
        libs: args.libs.clone(),
        db,
        max_db: args.max_db,
        ring_bytes: args.ring_size,
        stack: args.stack,
        floor: if args.floor_clock {
            2
        } else {
            u32::from(args.floor)
        },
        program_stats: args.program_stats,
        no_keyframes: args.no_keyframes,
        no_host_context: args.no_host_context,
        nvml: match args.nvml.as_deref() {
            Some("off") => None,
            Some(path) => Some(path.to_owned()),
            None => Some("libnvidia-ml.so.1".to_owned()),
        },
        nvml_required: args.nvml.as_deref().is_some_and(|p| p != "off"),
        allocator: args.allocator.into(),
        arming: arming_settings(&args),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        on_warning,
        dump_on_oom: match &args.dump_on_oom {
            Some(dir) => Some(DumpOnOom {
                dir: dir.clone(),
                max: args.dump_max,
                render: |out, export| tracer_cli::present::pytorch_snapshot::write(out, export),
                on_oom: on_oom(&args, &who)?,
                sink: oom_logs.clone().map(|logs| {
                    OomSink(Arc::new(move |report: &OomReport| {
                        use prost::Message as _;
                        let body = present::otlp::oom_log_request(report, logs.resource());
                        logs.push(body.encode_to_vec());
                    }))
                }),
            }),
            None => None,
        },
        figures_grace: if exporter.is_some() {
            // Zero means "no figures kept at all"; exported, the least is "gone at once".
            args.metrics_grace.max(Duration::from_nanos(1))
        } else {
            Duration::ZERO
        },
    });
    let mut recording = match (started, &exporter) {
        (Ok(recording), _) => recording,
        (Err(e), Some(exporter)) if args.keep_serving => {
            return Err(exporter.not_tracing(e, &stops));
        }
        (Err(e), _) => return Err(e),
    };
    if args.json {
        let mut started = serde_json::to_value(recording.started())?;
        started["event"] = "started".into();
        if let Some(server) = exporter.as_ref().and_then(|e| e.server.as_ref()) {
            started["metrics"] = server.local_addr().to_string().into();
        }
        if let Some(otlp) = exporter.as_ref().and_then(|e| e.otlp.as_ref()) {
            started["otlp"] = otlp.endpoint().into();
        }
        // A reader of stdout that went away stops nothing: the database is the record.
        unless_broken_pipe(present::json::line(&started))?;
    }
    let mut view = live::LiveView::new(std::io::stderr().is_terminal());
    let session = recording.started().session;
    let outcome = recording.run(&stops, args.duration, |snapshot| {
        if let Some(exporter) = &exporter {
            exporter.publish(snapshot, session);
        }
        if !args.quiet {
            view.draw(&live::Status {
                elapsed: snapshot.elapsed,
                libraries: snapshot.libraries,
                probes: snapshot.probes,
                stats: &snapshot.stats,
                counters: &snapshot.counters,
                allocators: &snapshot.allocators,
            });
        }
    });
    let finished = recording.finish(outcome)?;
    if let Some(exporter) = exporter {
        exporter.finish();
    }
    // The dump thread, the only other holder, has ended with the recording.
    if let Some(logs) = oom_logs.and_then(|l| Arc::try_unwrap(l).ok()) {
        let endpoint = logs.endpoint().to_owned();
        let c = logs.finish();
        eprintln!(
            "tracer: OTLP: {} OOM log record(s) sent to {endpoint}, {} dropped, {} failed attempt(s)",
            c.sent, c.dropped, c.failed
        );
    }
    let printed = if args.json {
        present::json::line(&present::summary::json(&finished.summary))
    } else {
        present::summary::text(&mut std::io::stdout().lock(), &finished.summary)
    };
    // Everything is stored; the kernel removes the probes in the background.
    finished.detach()?;
    unless_broken_pipe(printed)
}

/// `result` of a write to stdout, with a closed stdout counted as success.
fn unless_broken_pipe(result: Result<()>) -> Result<()> {
    match result {
        Err(e) if tracer_cli::exit::is_broken_pipe(&e) => Ok(()),
        other => other,
    }
}

/// The metrics endpoint, the OTLP sender, and the pod names their series carry.
struct Exporter {
    server: Option<MetricsServer>,
    otlp: Option<OtlpPusher>,
    pods: PodDirectory,
    /// When the exported counters began (OTLP's start time of cumulative series).
    started_ns: u64,
    /// The latest export request, pushed once more when tracer stops.
    last: std::sync::Mutex<Option<Vec<u8>>>,
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl Exporter {
    fn start(
        addr: Option<SocketAddr>,
        otlp: Option<OtlpConfig>,
        args: &TraceArgs,
    ) -> Result<Exporter> {
        let server = match addr {
            Some(addr) => {
                let server = MetricsServer::start(addr, args.metrics_max_connections)
                    .map_err(|e| user_error(format!("{e:#}: pick another --metrics address")))?;
                eprintln!(
                    "tracer: metrics on http://{}/metrics (no authentication; at most {} connections)",
                    server.local_addr(),
                    args.metrics_max_connections
                );
                Some(server)
            }
            None => None,
        };
        let otlp = match otlp {
            Some(config) => {
                let pusher = OtlpPusher::start(config)?;
                eprintln!(
                    "tracer: metrics pushed over OTLP/HTTP to {} every {} s",
                    pusher.endpoint(),
                    pusher.interval.as_secs_f64()
                );
                Some(pusher)
            }
            None => None,
        };
        let source = match args.kubernetes.as_str() {
            "auto" => KubeSource::InCluster,
            "off" => KubeSource::Off,
            path => KubeSource::Kubeconfig(path.into()),
        };
        let exporter = Exporter {
            server,
            otlp,
            pods: PodDirectory::start(source),
            started_ns: now_ns(),
            last: std::sync::Mutex::new(None),
        };
        exporter.publish_health(None, false, "starting");
        Ok(exporter)
    }

    fn health(
        &self,
        session: Option<i64>,
        tracing: bool,
        reason: &str,
    ) -> present::metrics::Health {
        present::metrics::Health {
            tracing,
            reason: reason.to_owned(),
            session,
            refused: self.server.as_ref().map_or(0, MetricsServer::refused),
            otlp: self.otlp.as_ref().map(OtlpPusher::counts),
        }
    }

    /// What a second of recording adds up to; asks for the names of pods not yet known.
    fn publish(&self, snapshot: &RecordingStatus, session: i64) {
        for p in snapshot.figures.processes() {
            if let Some(pod) = &p.pod {
                if self.pods.name(&pod.pod_uid).is_none() {
                    self.pods.want(&pod.pod_uid);
                }
            }
        }
        let health = self.health(Some(session), true, "");
        let families =
            present::metrics::families(Some(snapshot), &health, &|uid| self.pods.name(uid));
        self.export(&families, true, "tracing");
    }

    fn publish_health(&self, session: Option<i64>, tracing: bool, reason: &str) {
        let families =
            present::metrics::families(None, &self.health(session, tracing, reason), &|_| None);
        self.export(&families, tracing, reason);
    }

    /// The same families to the page and, when due, to the collector.
    fn export(&self, families: &[prometheus::proto::MetricFamily], ready: bool, reason: &str) {
        if let Some(server) = &self.server {
            server.publish(present::metrics::text(families), ready, reason);
        }
        if let Some(otlp) = &self.otlp {
            use prost::Message as _;
            let resource = otlp.resource();
            let body = present::otlp::request(families, resource, self.started_ns, now_ns())
                .encode_to_vec();
            let Ok(mut last) = self.last.lock() else {
                return;
            };
            if otlp.due(std::time::Instant::now()) {
                otlp.push(body);
                *last = None;
            } else {
                *last = Some(body);
            }
        }
    }

    /// Pushes the last figures not yet pushed and says what the OTLP sender did.
    fn finish(self) {
        let Some(otlp) = self.otlp else {
            return;
        };
        if let Some(body) = self.last.lock().ok().and_then(|mut l| l.take()) {
            otlp.push(body);
        }
        let endpoint = otlp.endpoint().to_owned();
        let c = otlp.finish();
        eprintln!(
            "tracer: OTLP: {} metric batch(es) sent to {endpoint}, {} dropped, {} failed attempt(s)",
            c.sent, c.dropped, c.failed
        );
    }

    /// Tracing could not start: serve that, unready, until a stop arrives; then the error.
    fn not_tracing(
        &self,
        error: anyhow::Error,
        stops: &std::sync::mpsc::Receiver<Stop>,
    ) -> anyhow::Error {
        let reason = format!("{error:#}");
        eprintln!("tracer: cannot trace: {reason}");
        eprintln!("tracer: --keep-serving: serving /metrics and an unready /readyz until stopped");
        loop {
            self.publish_health(None, false, &reason);
            match stops.recv_timeout(Duration::from_secs(1)) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                _ => return error,
            }
        }
    }
}

/// `--on-oom`'s command and whom it runs as (the rule `--on-warning` follows).
fn on_oom(args: &TraceArgs, who: &tracer_cli::paths::Invoker) -> Result<Option<OnOom>> {
    let Some(command) = &args.on_oom else {
        return Ok(None);
    };
    let user = OnWarning::resolve_user(args.on_oom_user.as_deref(), who.owner)
        .map_err(|e| user_error(format!("{e:#}").replace("--on-warning", "--on-oom")))?;
    Ok(Some(OnOom {
        command: command.clone(),
        user,
        timeout: args.on_oom_timeout,
    }))
}
