//! `tracer trace`: record every call into the database, show a live table, and flush
//! everything on Ctrl-C, SIGTERM, --duration, or when the traced processes are gone.

use std::{io::IsTerminal as _, net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Result;
use clap::Args;
use tracer_cli::model::arming::{Mode, Settings};
use tracer_cli::{
    exit::user_error,
    paths,
    present::{self, live},
    record::{
        dump::{DumpOnOom, OnOom, OomReport, OomSink, PodJob},
        on_warning::OnWarning,
        signals, RecordOptions, Recording, RecordingStatus, Stop,
    },
    serve::{
        metrics::MetricsServer,
        otlp::{OtlpConfig, OtlpPusher},
    },
    traced::pods::{KubeSource, PodDirectory},
};

mod args;
pub use args::{ArmingArgs, EvidenceArgs, RecordingArgs, ServingArgs};

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("exported").multiple(true).args(["metrics", "otlp_endpoint"])))]
pub struct TraceArgs {
    #[command(flatten)]
    pub recording: RecordingArgs,
    #[command(flatten, next_help_heading = "Serving (metrics, OTLP, pods)")]
    pub serving: ServingArgs,
    #[command(flatten, next_help_heading = "PyTorch's allocator probes")]
    pub arming: ArmingArgs,
    #[command(flatten, next_help_heading = "Early warnings and OOM evidence")]
    pub evidence: EvidenceArgs,
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
        arm_share: args.arming.arm_share,
        hold_share: (args.arming.arm_share - 0.1).max(0.0),
        warmup_ns: ns(args.arming.arm_warmup),
        quiet_ns: ns(args.arming.arm_quiet),
        min_armed_ns: ns(args.arming.arm_min),
    }
}

pub fn run(args: TraceArgs) -> Result<()> {
    // Signals are caught from here on: a Ctrl-C during set-up still ends in a flushed session.
    let (stop_tx, stops) = std::sync::mpsc::channel();
    signals::stop_on_signals(stop_tx)?;
    let who = paths::invoker();
    let db = args.recording.db.path_for(&who)?;
    let on_warning = match &args.evidence.on_warning {
        Some(command) => Some(OnWarning {
            command: command.clone(),
            user: OnWarning::resolve_user(args.evidence.on_warning_user.as_deref(), who.owner)
                .map_err(|e| user_error(format!("{e:#}")))?,
            interval: args.evidence.on_warning_interval,
            timeout: args.evidence.on_warning_timeout,
        }),
        None => None,
    };
    let otlp = OtlpConfig::read(
        args.serving.otlp_endpoint.as_deref(),
        args.serving.otlp_interval,
        &|name| std::env::var(name).ok(),
    )?;
    // Each OOM also as a log record, to the same collector (with --dump-on-oom).
    let oom_logs = match (&otlp, &args.evidence.dump_on_oom) {
        (Some(config), Some(_)) => Some(Arc::new(OtlpPusher::start(
            config.for_logs(&|name| std::env::var(name).ok())?,
        )?)),
        _ => None,
    };
    let exporter = if args.serving.metrics.is_some() || otlp.is_some() {
        Some(Exporter::start(args.serving.metrics, otlp, &args)?)
    } else {
        None
    };
    let started = Recording::start(RecordOptions {
        pids: args.recording.pids.clone(),
        libs: args.recording.libs.clone(),
        db,
        max_db: args.recording.max_db,
        ring_bytes: args.recording.ring_size,
        stack: args.recording.stack,
        floor: match args.recording.usdt_parts {
            Some(parts) => tracer_common::maps::FLOOR_USDT_PARTS + parts,
            None if args.recording.floor_clock => 2,
            None => u32::from(args.recording.floor),
        },
        program_stats: args.recording.program_stats,
        no_keyframes: args.recording.no_keyframes,
        no_host_context: args.recording.no_host_context,
        hold: !args.recording.no_hold,
        open_watch: !args.recording.no_open_watch,
        nvml: match args.recording.nvml.as_deref() {
            Some("off") => None,
            Some(path) => Some(path.to_owned()),
            None => Some("libnvidia-ml.so.1".to_owned()),
        },
        nvml_required: args.recording.nvml.as_deref().is_some_and(|p| p != "off"),
        allocator: args.arming.allocator.into(),
        arming: arming_settings(&args),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        on_warning,
        dump_on_oom: match &args.evidence.dump_on_oom {
            Some(dir) => Some(DumpOnOom {
                dir: dir.clone(),
                max: args.evidence.dump_max,
                render: |out, export| tracer_cli::present::pytorch_snapshot::write(out, export),
                on_oom: on_oom(&args, &who)?,
                sink: oom_logs.clone().map(|logs| {
                    OomSink(Arc::new(move |report: &OomReport| {
                        use prost::Message as _;
                        let body = present::otlp::oom_log_request(report, logs.resource());
                        logs.push(body.encode_to_vec());
                    }))
                }),
                // The pods' owners, where the metrics' pod lookups run (the DaemonSet).
                pod_job: exporter.as_ref().map(|e| {
                    let pods = Arc::clone(&e.pods);
                    PodJob(Arc::new(move |uid: &str| pods.name(uid)?.job))
                }),
            }),
            None => None,
        },
        figures_grace: if exporter.is_some() {
            // Zero means "no figures kept at all"; exported, the least is "gone at once".
            args.serving.metrics_grace.max(Duration::from_nanos(1))
        } else {
            Duration::ZERO
        },
    });
    let mut recording = match (started, &exporter) {
        (Ok(recording), _) => recording,
        (Err(e), Some(exporter)) if args.serving.keep_serving => {
            return Err(exporter.not_tracing(e, &stops));
        }
        (Err(e), _) => return Err(e),
    };
    if args.recording.json {
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
    let outcome = recording.run(&stops, args.recording.duration, |snapshot| {
        if let Some(exporter) = &exporter {
            exporter.publish(snapshot, session);
        }
        if !args.recording.quiet {
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
    let printed = if args.recording.json {
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
    pods: Arc<PodDirectory>,
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
                let server = MetricsServer::start(addr, args.serving.metrics_max_connections)
                    .map_err(|e| user_error(format!("{e:#}: pick another --metrics address")))?;
                eprintln!(
                    "tracer: metrics on http://{}/metrics (no authentication; at most {} connections)",
                    server.local_addr(),
                    args.serving.metrics_max_connections
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
        let source = match args.serving.kubernetes.as_str() {
            "auto" => KubeSource::InCluster,
            "off" => KubeSource::Off,
            path => KubeSource::Kubeconfig(path.into()),
        };
        let exporter = Exporter {
            server,
            otlp,
            pods: Arc::new(PodDirectory::start(source)),
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
    let Some(command) = &args.evidence.on_oom else {
        return Ok(None);
    };
    let user = OnWarning::resolve_user(args.evidence.on_oom_user.as_deref(), who.owner)
        .map_err(|e| user_error(format!("{e:#}").replace("--on-warning", "--on-oom")))?;
    Ok(Some(OnOom {
        command: command.clone(),
        user,
        timeout: args.evidence.on_oom_timeout,
    }))
}
