//! `tracer mcp`: an MCP server over stdio that lets an assistant investigate a trace database,
//! read-only. Every tool opens its own read-only connection (so a database a live trace is
//! writing shows its newest sessions), answers in abbreviated fields whose meaning each tool's
//! description gives, and bounds what it returns. Errors and refusals come back as tool results
//! marked as errors. Nothing here can write, attach another database, trace or run a demo.
//!
//! Over 700 lines because each tool is its arguments, its bounded answer type and its handler, and
//! the server lists them in one place.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use rmcp::{
    handler::server::{
        router::{prompt::PromptRouter, tool::ToolRouter},
        wrapper::Parameters,
    },
    model::{
        GetPromptResult, Implementation, PromptMessage, Role, ServerCapabilities, ServerConfig,
    },
    prompt, prompt_handler, prompt_router, tool, tool_handler, tool_router, Json, ServerHandler,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use tracer_common::OpClass;

use crate::{
    analysis::select_quantile,
    query::{
        explain::{self, ExplainQuery},
        layout::{self, At, LayoutQuery},
    },
    store::{events, readonly, Access, Store},
    units::{format_bytes, format_utc},
};

/// Rows a query returns at most (and by default).
pub const MAX_ROWS: u32 = 500;
const DEFAULT_ROWS: u32 = 100;
/// Bytes of cell text a query returns at most.
pub const MAX_QUERY_BYTES: usize = 64 * 1024;
/// How long one query may run, unless `tracer mcp --query-time` says otherwise.
pub const QUERY_TIME: Duration = Duration::from_secs(20);
/// Time windows op_stats returns at most.
const MAX_WINDOWS: usize = 300;
/// Chains, timeline entries and processes an explain answer holds at most.
const MAX_CHAINS: usize = 20;
const MAX_TIMELINE: usize = 8;
const MAX_PROCESSES: usize = 32;

/// The server: the database it reads.
#[derive(Clone)]
pub struct TracerMcp {
    db: Arc<PathBuf>,
    query_time: Duration,
    /// Where `export_snapshot` writes (`--export-dir`); None: exports are off.
    export_dir: Option<Arc<crate::paths::ExportDir>>,
    tool_router: ToolRouter<Self>,
    prompt_router: PromptRouter<Self>,
}

/// A tool's failure, as the text of an error result.
fn failure(e: anyhow::Error) -> String {
    match e.downcast_ref::<crate::exit::Coded>() {
        Some(coded) => coded.to_string(),
        None => format!("{e:#}"),
    }
}

impl TracerMcp {
    /// Runs blocking database work off the protocol's thread; its error becomes the result's text.
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Path) -> Result<T> + Send + 'static,
    ) -> Result<T, String> {
        let db = Arc::clone(&self.db);
        tokio::task::spawn_blocking(move || work(&db))
            .await
            .map_err(|e| format!("the tool's work failed: {e}"))?
            .map_err(failure)
    }
}

// ---- sessions ----

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct SessionsArgs {
    /// How many sessions, newest first (default 20, at most 50).
    pub limit: Option<u32>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct SessionOut {
    pub id: i64,
    /// Started, UTC.
    pub start: String,
    pub start_ns: i64,
    pub end_ns: Option<i64>,
    /// recording, running, ended, crashed...
    pub status: String,
    pub source: String,
    pub cmd: Option<String>,
    /// Events stored.
    pub stored: u64,
    /// Everything not kept, summed; `losses` names the non-zero counters.
    pub lost: u64,
    pub losses: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct SessionsOut {
    pub sessions: Vec<SessionOut>,
}

pub fn sessions(db: &Path, args: &SessionsArgs) -> Result<SessionsOut> {
    let store = Store::open(db, Access::ReadOnly)?;
    let limit = args.limit.unwrap_or(20).clamp(1, 50);
    let sessions = events::session_summaries(store.conn(), limit)?
        .into_iter()
        .map(|s| {
            let mut losses: BTreeMap<String, u64> = s
                .counters
                .losses()
                .into_iter()
                .filter(|(_, v)| *v > 0)
                .map(|(k, v)| (k.to_owned(), v))
                .collect();
            for (kind, n) in [
                ("evicted_events", s.evicted_events),
                ("evicted_calls", s.evicted_calls),
                ("evicted_block_events", s.evicted_block_events),
                ("evicted_offcpu", s.evicted_offcpu),
            ] {
                if n > 0 {
                    losses.insert(kind.into(), n);
                }
            }
            SessionOut {
                id: s.id,
                start: format_utc(s.started_ns),
                start_ns: s.started_ns,
                end_ns: s.ended_ns,
                stored: s.counters.events_stored,
                lost: s.lost(),
                losses,
                status: s.status,
                source: s.source,
                cmd: s.command,
            }
        })
        .collect();
    Ok(SessionsOut { sessions })
}

// ---- explain ----

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct ExplainArgs {
    /// The session (default: the latest).
    pub session: Option<i64>,
    /// Only the last seconds of the session.
    pub since_s: Option<f64>,
    /// Only this process.
    pub pid: Option<u32>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct ChainOut {
    /// rule
    #[serde(rename = "r")]
    pub rule: String,
    /// severity
    #[serde(rename = "sev")]
    pub severity: String,
    pub pid: u32,
    /// title
    #[serde(rename = "t")]
    pub title: String,
    pub root: String,
    /// effect
    #[serde(rename = "eff")]
    pub effect: String,
    /// compounding
    #[serde(rename = "cmp")]
    pub compounding: Vec<String>,
    /// timeline: [seconds since the window's start, text]
    #[serde(rename = "tl")]
    pub timeline: Vec<(f64, String)>,
    pub fix: Vec<String>,
    /// evidence
    #[serde(rename = "ev")]
    pub evidence: String,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct OpOut {
    pub op: String,
    /// calls
    #[serde(rename = "n")]
    pub calls: u64,
    /// errors
    #[serde(rename = "err")]
    pub errors: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    /// bytes, and in human units
    #[serde(rename = "b")]
    pub bytes: u64,
    #[serde(rename = "bh")]
    pub bytes_human: String,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcOut {
    pub pid: u32,
    pub comm: Option<String>,
    pub ops: Vec<OpOut>,
    /// warnings
    pub warn: Vec<String>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct DevOut {
    pub pid: u32,
    /// device
    #[serde(rename = "d")]
    pub device: i32,
    /// view: blocks (PyTorch's probes seen) or segments
    #[serde(rename = "v")]
    pub view: String,
    /// peak device memory held, and in human units
    pub held: u64,
    #[serde(rename = "held_h")]
    pub held_human: String,
    /// peak reserved and allocated (blocks view)
    #[serde(rename = "res")]
    pub reserved: u64,
    #[serde(rename = "alloc")]
    pub allocated: u64,
    /// highest fragmentation ratio
    #[serde(rename = "frag")]
    pub fragmentation: f64,
    /// failed allocations
    #[serde(rename = "fail")]
    pub failures: u64,
    /// the physical GPU behind the device number, and the job the process belongs to
    pub gpu: String,
    pub job: String,
}

/// Who held the GPU at a process's out-of-memory.
#[derive(Debug, Serialize, JsonSchema)]
pub struct HoldersOut {
    /// the process that ran out of memory, its device and physical GPU
    pub pid: u32,
    #[serde(rename = "d")]
    pub device: i32,
    pub gpu: String,
    /// seconds since the window's start
    pub at: f64,
    /// bytes the failed call asked for
    #[serde(rename = "req")]
    pub requested: u64,
    /// the device's capacity and free bytes, when cudaMemGetInfo said
    pub total: Option<u64>,
    pub free: Option<u64>,
    /// this process: allocated and cached by its allocator (PyTorch's probes), all it held
    /// through traced calls, outside the allocator by library [library, bytes], and what
    /// PyTorch's message says it had beyond (its CUDA context)
    #[serde(rename = "alloc")]
    pub allocated: Option<u64>,
    pub cached: Option<u64>,
    pub held: u64,
    pub outside: Vec<(String, u64)>,
    pub untraced: Option<u64>,
    /// other processes on the GPU: [pid, command, bytes, named only by PyTorch's message]
    pub others: Vec<(u32, Option<String>, u64, bool)>,
    /// in use, held by no traced process and no process PyTorch's message names
    pub unattributed: Option<u64>,
    /// other_processes, this_process, beyond_device, fragmentation,
    /// fragmentation_and_other_processes, memory_fraction or unknown
    pub verdict: String,
    /// the OOM's arithmetic: bytes the request was short of what the device could give, and
    /// in words what was asked, what the device could give and what stood in the way, with
    /// the verdict that follows
    pub short: Option<u64>,
    pub math: String,
    /// the whole split in words
    pub said: String,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct ExplainOut {
    /// session
    #[serde(rename = "s")]
    pub session: i64,
    /// window [from_ns, to_ns] and as UTC text
    #[serde(rename = "w")]
    pub window_ns: (i64, i64),
    #[serde(rename = "wt")]
    pub window_text: String,
    /// calls in the window
    #[serde(rename = "n")]
    pub events: u64,
    /// causal chains, most severe first
    #[serde(rename = "ch")]
    pub chains: Vec<ChainOut>,
    /// per process
    #[serde(rename = "pr")]
    pub processes: Vec<ProcOut>,
    /// per process and device
    #[serde(rename = "dev")]
    pub devices: Vec<DevOut>,
    /// at each out-of-memory: who held the GPU
    pub who: Vec<HoldersOut>,
    /// what was left out to keep the answer short: chains, processes, process-device rows
    pub omitted: (usize, usize, usize),
    /// what the answer covers: evictions (and the whole-run series in their place), the
    /// keyframe read from, what tracer did not see, when each layout was exact again
    #[serde(rename = "cov")]
    pub coverage: Vec<String>,
}

pub fn explain_compact(db: &Path, args: &ExplainArgs) -> Result<ExplainOut> {
    let since = match args.since_s {
        Some(s) if !(s > 0.0 && s < 1e10) => {
            return Err(crate::exit::user_error(format!(
                "since_s {s} is not a number of seconds between 0 and 1e10"
            )))
        }
        s => s.map(Duration::from_secs_f64),
    };
    let r = explain::explain(
        db,
        &ExplainQuery {
            session: args.session,
            since,
            pid: args.pid,
            ..Default::default()
        },
    )?
    .report;
    let from = r.window.from_ns;
    let cov = r.coverage.lines(r.window);
    let chains = r.chains.len();
    let processes = r.processes.len();
    let devices = r.devices.len();
    Ok(ExplainOut {
        session: r.session,
        window_ns: (r.window.from_ns, r.window.to_ns),
        window_text: format!(
            "{} - {}",
            format_utc(r.window.from_ns),
            format_utc(r.window.to_ns)
        ),
        events: r.events_in_window,
        chains: r
            .chains
            .iter()
            .take(MAX_CHAINS)
            .map(|c| ChainOut {
                rule: c.rule.name().to_owned(),
                severity: format!("{:?}", c.severity).to_uppercase(),
                pid: c.pid,
                title: c.title.clone(),
                root: c.root.clone(),
                effect: c.effect.clone(),
                compounding: c.compounding.clone(),
                timeline: c
                    .timeline
                    .iter()
                    .take(MAX_TIMELINE)
                    .map(|e| ((e.ts_ns - from) as f64 / 1e9, e.text.clone()))
                    .collect(),
                fix: c.fix.iter().map(|f| f.text.to_string()).collect(),
                evidence: c.evidence.clone(),
            })
            .collect(),
        processes: r
            .processes
            .iter()
            .take(MAX_PROCESSES)
            .map(|p| ProcOut {
                pid: p.pid,
                comm: p.comm.clone(),
                ops: p
                    .ops
                    .iter()
                    .map(|o| OpOut {
                        op: o.op.to_owned(),
                        calls: o.calls,
                        errors: o.errors,
                        p50_ns: o.p50_ns,
                        p99_ns: o.p99_ns,
                        max_ns: o.max_ns,
                        bytes: o.bytes,
                        bytes_human: format_bytes(o.bytes),
                    })
                    .collect(),
                warn: p.warnings.clone(),
            })
            .collect(),
        devices: r
            .devices
            .iter()
            .take(MAX_PROCESSES * 8)
            .map(|d| DevOut {
                pid: d.pid,
                device: d.device,
                view: d.view.to_owned(),
                held: d.peak_held,
                held_human: format_bytes(d.peak_held),
                reserved: d.peak_reserved,
                allocated: d.peak_allocated,
                fragmentation: d.fragmentation,
                failures: d.failures,
                gpu: d.gpu.clone(),
                job: d.job.clone(),
            })
            .collect(),
        who: r
            .holders
            .iter()
            .take(MAX_PROCESSES)
            .map(|h| HoldersOut {
                pid: h.pid,
                device: h.device,
                gpu: h.gpu.clone(),
                at: (h.at_ns - from) as f64 / 1e9,
                requested: h.requested,
                total: h.device_total,
                free: h.device_free,
                allocated: h.allocated,
                cached: h.cached,
                held: h.held,
                outside: h
                    .outside
                    .iter()
                    .map(|o| (o.library.clone(), o.bytes))
                    .collect(),
                untraced: h.untraced,
                others: h
                    .others
                    .iter()
                    .take(MAX_PROCESSES)
                    .map(|t| (t.pid, t.comm.clone(), t.bytes, t.from_message))
                    .collect(),
                unattributed: h.unattributed,
                verdict: h.verdict.name().to_owned(),
                short: h.arithmetic.shortfall,
                math: format!(
                    "{}: {}",
                    h.arithmetic.figures(),
                    h.arithmetic.verdict_on(&h.gpu)
                ),
                said: h.split_said(),
            })
            .collect(),
        omitted: (
            chains.saturating_sub(MAX_CHAINS),
            processes.saturating_sub(MAX_PROCESSES),
            devices.saturating_sub(MAX_PROCESSES * 8),
        ),
        coverage: cov,
    })
}

// ---- query ----

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct QueryArgs {
    /// One read-only SQL statement.
    pub sql: String,
    /// Rows to return at most (default 100, at most 500).
    pub max_rows: Option<u32>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct QueryOut {
    pub cols: Vec<String>,
    pub rows: Vec<Vec<serde_json::Value>>,
    /// More rows, or more bytes, than the limits: the rest was not read.
    pub truncated: bool,
}

/// Why a query stopped early.
#[derive(Debug)]
struct Enough;
impl std::fmt::Display for Enough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("limit reached")
    }
}
impl std::error::Error for Enough {}

pub fn query(db: &Path, args: &QueryArgs, limit: Duration) -> Result<QueryOut> {
    let store = Store::open(db, Access::ReadOnly)?;
    let max_rows = args.max_rows.unwrap_or(DEFAULT_ROWS).clamp(1, MAX_ROWS) as usize;
    let deadline = Instant::now() + limit;
    // SQLite calls this every 10,000 steps; true interrupts the statement.
    store
        .conn()
        .progress_handler(10_000, Some(move || Instant::now() > deadline));
    let mut out = QueryOut {
        cols: Vec::new(),
        rows: Vec::new(),
        truncated: false,
    };
    let mut bytes = 0usize;
    let result = readonly::run(
        store.conn(),
        &args.sql,
        |cols| {
            out.cols = cols.to_vec();
            Ok(())
        },
        |cells| {
            if out.rows.len() == max_rows {
                return Err(Enough.into());
            }
            let row: Vec<serde_json::Value> = cells.iter().map(cell_json).collect();
            bytes += row.iter().map(|v| v.to_string().len()).sum::<usize>();
            if bytes > MAX_QUERY_BYTES {
                return Err(Enough.into());
            }
            out.rows.push(row);
            Ok(())
        },
    );
    store.conn().progress_handler(0, None::<fn() -> bool>);
    match result {
        Ok(()) => Ok(out),
        Err(e) if e.downcast_ref::<Enough>().is_some() => {
            out.truncated = true;
            Ok(out)
        }
        Err(e) if Instant::now() > deadline => Err(crate::exit::user_error(format!(
            "refused: the query ran past its time limit of {:.1} s and was stopped ({e}); narrow it with WHERE session_id = ... or LIMIT",
            limit.as_secs_f64()
        ))),
        Err(e) => Err(e),
    }
}

fn cell_json(c: &readonly::Cell) -> serde_json::Value {
    use readonly::Cell;
    match c {
        Cell::Null => serde_json::Value::Null,
        Cell::Int(v) => (*v).into(),
        Cell::Real(v) => (*v).into(),
        Cell::Text(t) => t.clone().into(),
        Cell::Blob(b) => format!("<blob of {} bytes>", b.len()).into(),
    }
}

// ---- op statistics over time ----

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct OpStatsArgs {
    /// The session (default: the latest).
    pub session: Option<i64>,
    /// Window width in seconds (default 30).
    pub window_s: Option<f64>,
    /// Only this op (e.g. cudaMalloc).
    pub op: Option<String>,
    /// Only this process.
    pub pid: Option<u32>,
    /// Start at this many seconds after the session's first call (to page on: next_from_s).
    pub from_s: Option<f64>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct WindowOut {
    /// window start, seconds since the session's first call
    #[serde(rename = "w")]
    pub start_s: f64,
    pub op: String,
    /// calls, errors
    #[serde(rename = "n")]
    pub calls: u64,
    #[serde(rename = "err")]
    pub errors: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    /// bytes of successful calls, and in human units
    #[serde(rename = "b")]
    pub bytes: u64,
    #[serde(rename = "bh")]
    pub bytes_human: String,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct OpStatsOut {
    #[serde(rename = "s")]
    pub session: i64,
    /// the session's first call, ns since the epoch
    pub t0_ns: i64,
    pub window_s: f64,
    pub rows: Vec<WindowOut>,
    /// More windows follow: ask again with from_s = next_from_s.
    pub truncated: bool,
    pub next_from_s: Option<f64>,
}

/// The op of this name.
fn op_named(name: &str) -> Result<tracer_common::Op> {
    tracer_common::Op::ALL
        .into_iter()
        .find(|o| o.name() == name)
        .ok_or_else(|| {
            crate::exit::user_error(format!(
                "no op named {name}: ops are the names in `SELECT name FROM ops`"
            ))
        })
}

pub fn op_stats(db: &Path, args: &OpStatsArgs) -> Result<OpStatsOut> {
    let window_s = args.window_s.unwrap_or(30.0);
    if !(0.001..=1e7).contains(&window_s) {
        return Err(crate::exit::user_error(format!(
            "window_s {window_s} is not between 0.001 and 1e7 seconds"
        )));
    }
    let op = match &args.op {
        Some(name) => Some(op_named(name)?),
        None => None,
    };
    let store = Store::open(db, Access::ReadOnly)?;
    let info = events::session(store.conn(), args.session)?;
    let width = ns_of(window_s);
    let from_s = args.from_s.unwrap_or(0.0);
    if !(0.0..=1e10).contains(&from_s) {
        return Err(crate::exit::user_error(format!(
            "from_s {from_s} is not between 0 and 1e10 seconds"
        )));
    }
    let first_window = ns_of(from_s) / width;
    let mut windows: BTreeMap<(i64, &'static str), (Vec<u64>, u64, u64)> = BTreeMap::new();
    // One walk over the stored calls (from the keyframe the calls --max-db left begin at).
    let begin = crate::query::begin(store.conn(), info.id, i64::MIN, args.pid)?;
    let mut t0: Option<i64> = None;
    crate::query::walk_calls(store.conn(), info.id, &begin, i64::MAX, args.pid, |e| {
        let t0 = *t0.get_or_insert(e.ts_ns);
        if op.is_some_and(|o| o != e.op)
            || matches!(e.class(), OpClass::BlockAlloc | OpClass::BlockFree)
        {
            return;
        }
        let window = (e.ts_ns - t0) / width;
        if window < first_window {
            return;
        }
        let w = windows.entry((window, e.op.name())).or_default();
        w.0.push(e.duration_ns);
        if e.ret != 0 {
            w.1 += 1;
        } else {
            w.2 += e.size;
        }
    })?;
    // A page ends at a window's boundary: the window the cut falls in goes whole to the next
    // page (its rows, one per op, would otherwise be split across two).
    let next_window = windows.keys().nth(MAX_WINDOWS).map(|&(w, _)| w);
    let next_from_s = next_window.map(|w| (w * width) as f64 / 1e9);
    let truncated = next_from_s.is_some();
    let rows = windows
        .into_iter()
        .take_while(|((w, _), _)| next_window.is_none_or(|next| *w < next))
        .map(|((w, op), (mut d, err, b))| WindowOut {
            start_s: (w * width) as f64 / 1e9,
            op: op.to_owned(),
            calls: d.len() as u64,
            errors: err,
            p50_ns: select_quantile(&mut d, 0.5),
            p99_ns: select_quantile(&mut d, 0.99),
            max_ns: d.iter().max().copied().unwrap_or(0),
            bytes: b,
            bytes_human: format_bytes(b),
        })
        .collect();
    Ok(OpStatsOut {
        session: info.id,
        t0_ns: t0.unwrap_or(0),
        window_s,
        rows,
        truncated,
        next_from_s,
    })
}

/// Seconds as nanoseconds, to the nearest: a page's `next_from_s` (8.04) read back truncated
/// (8039999999 ns) began the next page a window early, splitting it across the two.
fn ns_of(seconds: f64) -> i64 {
    (seconds * 1e9).round() as i64
}

// ---- stacks ----

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct StacksArgs {
    /// The session (default: the latest).
    pub session: Option<i64>,
    /// Only this op.
    pub op: Option<String>,
    /// Only this process.
    pub pid: Option<u32>,
    /// How many call sites (default 10, at most 50).
    pub top: Option<u32>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct StackSiteOut {
    pub id: i64,
    pub op: String,
    pub pid: u32,
    /// calls, bytes and in human units
    #[serde(rename = "n")]
    pub calls: u64,
    #[serde(rename = "b")]
    pub bytes: u64,
    #[serde(rename = "bh")]
    pub bytes_human: String,
    /// the Python call site (file:line function), if any
    #[serde(rename = "py")]
    pub python: String,
    /// innermost frames first, at most 6: "function file:line" or "function (module)"
    #[serde(rename = "fr")]
    pub frames: Vec<String>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct StacksOut {
    #[serde(rename = "s")]
    pub session: i64,
    pub sites: Vec<StackSiteOut>,
}

pub fn stacks(db: &Path, args: &StacksArgs) -> Result<StacksOut> {
    let op = match &args.op {
        Some(name) => Some(op_named(name)?),
        None => None,
    };
    let store = Store::open(db, Access::ReadOnly)?;
    let info = events::session(store.conn(), args.session)?;
    let top = args.top.unwrap_or(10).clamp(1, 50);
    let sites = events::stacks(store.conn(), info.id, op, args.pid, top)?
        .into_iter()
        .map(|s| StackSiteOut {
            id: s.stack_id,
            op: s.op.to_owned(),
            pid: s.pid,
            calls: s.calls,
            bytes: s.bytes,
            bytes_human: format_bytes(s.bytes),
            python: s.python,
            frames: s
                .frames
                .iter()
                .take(6)
                .map(|f| {
                    let func = f.function.as_deref().unwrap_or("?");
                    match (&f.file, f.line, &f.module) {
                        (Some(file), Some(line), _) => format!("{func} {file}:{line}"),
                        (_, _, Some(module)) => format!("{func} ({module})"),
                        _ => func.to_owned(),
                    }
                })
                .collect(),
        })
        .collect();
    Ok(StacksOut {
        session: info.id,
        sites,
    })
}

// ---- layout ----

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct LayoutArgs {
    /// The session (default: the latest).
    pub session: Option<i64>,
    /// Only this process.
    pub pid: Option<u32>,
    /// "oom" (the first out-of-memory), "end" (default), or Unix seconds.
    pub at: Option<String>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct SegOut {
    /// address (hex), device, pool, size and in human units
    #[serde(rename = "a")]
    pub address: String,
    #[serde(rename = "d")]
    pub device: i32,
    pub pool: String,
    pub size: u64,
    #[serde(rename = "sh")]
    pub size_human: String,
    /// allocated and free blocks in it, its largest free run
    pub alloc_blocks: u64,
    pub free_blocks: u64,
    pub largest_free: u64,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct DevLayoutOut {
    /// device
    #[serde(rename = "d")]
    pub device: i32,
    pub allocated: u64,
    pub reserved: u64,
    pub free_blocks: u64,
    pub largest_free: u64,
    /// the same in human units: allocated / reserved / largest free
    #[serde(rename = "h")]
    pub figures: String,
    /// device memory outside the allocator's segments
    pub outside: u64,
    /// the physical GPU, and the bytes in use then that no traced process held and no process
    /// PyTorch's message named (as explain's `who`)
    pub gpu: String,
    pub unattributed: Option<u64>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct ProcLayoutOut {
    pub pid: u32,
    pub comm: Option<String>,
    pub at_ns: i64,
    /// blocks (PyTorch's probes seen) or segments
    pub view: String,
    #[serde(rename = "devs")]
    pub devices: Vec<DevLayoutOut>,
    /// segments, largest first, at most 12; how many in all
    #[serde(rename = "segs")]
    pub segments: Vec<SegOut>,
    pub seg_count: usize,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct LayoutOut {
    #[serde(rename = "s")]
    pub session: i64,
    #[serde(rename = "procs")]
    pub processes: Vec<ProcLayoutOut>,
    /// processes left out (at most 32 are returned)
    pub procs_omitted: usize,
}

/// A tool's `at`: "oom", "end" (default) or a time.
fn at_of(at: Option<&str>) -> Result<At> {
    Ok(match at {
        None | Some("end") => At::End,
        Some("oom") => At::Oom,
        Some(t) => At::Time(crate::units::parse_time(t).map_err(|e| {
            crate::exit::user_error(format!(
                "at {t:?}: {e}; give \"oom\", \"end\" or Unix seconds"
            ))
        })?),
    })
}

pub fn layout(db: &Path, args: &LayoutArgs) -> Result<LayoutOut> {
    let at = at_of(args.at.as_deref())?;
    let (s, layouts) = layout::layout(
        db,
        &LayoutQuery {
            session: args.session,
            pid: args.pid,
            device: None,
            at,
        },
    )?;
    let procs_omitted = layouts.len().saturating_sub(MAX_PROCESSES);
    let procs = layouts
        .into_iter()
        .take(MAX_PROCESSES)
        .map(|p| {
            let mut segs: Vec<SegOut> = p
                .segments
                .iter()
                .map(|seg| {
                    let runs = |kind| seg.runs.iter().filter(move |r| r.kind == kind);
                    SegOut {
                        address: format!("{:#x}", seg.addr),
                        device: seg.device,
                        pool: seg
                            .pool
                            .map_or("?".into(), |p| format!("{p:?}").to_lowercase()),
                        size: seg.size,
                        size_human: format_bytes(seg.size),
                        alloc_blocks: runs(crate::model::layout::RunKind::Allocated).count() as u64,
                        free_blocks: runs(crate::model::layout::RunKind::Free).count() as u64,
                        largest_free: runs(crate::model::layout::RunKind::Free)
                            .map(|r| r.size)
                            .max()
                            .unwrap_or(0),
                    }
                })
                .collect();
            let seg_count = segs.len();
            segs.sort_by_key(|s| std::cmp::Reverse(s.size));
            segs.truncate(12);
            ProcLayoutOut {
                pid: p.pid,
                comm: p.comm,
                at_ns: p.at_ns,
                view: p.view.to_owned(),
                devices: p
                    .devices
                    .iter()
                    .map(|d| DevLayoutOut {
                        device: d.device,
                        allocated: d.total.allocated,
                        reserved: d.total.reserved,
                        free_blocks: d.total.free_blocks,
                        largest_free: d.total.largest_free,
                        figures: format!(
                            "{} / {} / {}",
                            format_bytes(d.total.allocated),
                            format_bytes(d.total.reserved),
                            format_bytes(d.total.largest_free)
                        ),
                        outside: d.outside,
                        gpu: d.gpu.clone(),
                        unattributed: d.gpu_share.unattributed,
                    })
                    .collect(),
                segments: segs,
                seg_count,
            }
        })
        .collect();
    Ok(LayoutOut {
        session: s,
        processes: procs,
        procs_omitted,
    })
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct ExportSnapshotArgs {
    /// The session (default: the latest).
    pub session: Option<i64>,
    /// The process (needed when several used PyTorch's allocator).
    pub pid: Option<u32>,
    /// "oom" (the first out-of-memory), "end" (default), or Unix seconds.
    pub at: Option<String>,
    /// The most trace entries kept, the newest (default 100000, at most 1000000).
    pub max_entries: Option<u64>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct ExportSnapshotOut {
    /// The file written, in the server's export directory.
    pub path: String,
    #[serde(rename = "s")]
    pub session: i64,
    pub pid: u32,
    pub segments: usize,
    pub blocks: usize,
    pub entries: usize,
    /// What was left out (tracer did not see it, or the bounds cut it), in words.
    pub left_out: Vec<String>,
}

/// The most trace entries one export may keep.
const MAX_EXPORT_ENTRIES: u64 = 1_000_000;

/// Writes one process as PyTorch's memory snapshot in the export directory, under a name made
/// of numbers only (the session, the pid, the instant), never of anything the traced program
/// said.
pub fn export_snapshot(
    db: &Path,
    dir: &crate::paths::ExportDir,
    args: &ExportSnapshotArgs,
) -> Result<ExportSnapshotOut> {
    use crate::query::pytorch_snapshot as snapshot;
    let max_entries = args
        .max_entries
        .unwrap_or(snapshot::DEFAULT_MAX_ENTRIES as u64);
    if !(1..=MAX_EXPORT_ENTRIES).contains(&max_entries) {
        return Err(crate::exit::user_error(format!(
            "max_entries {max_entries}: give 1 to {MAX_EXPORT_ENTRIES}"
        )));
    }
    let at = at_of(args.at.as_deref())?;
    let export = snapshot::export(
        db,
        &snapshot::SnapshotQuery {
            session: args.session,
            pid: args.pid,
            at,
            since_ns: None,
            max_entries: max_entries as usize,
        },
    )?;
    let mut bytes = Vec::new();
    crate::present::pytorch_snapshot::write(&mut bytes, &export)?;
    let instant = match at {
        At::End => "end".to_owned(),
        At::Oom => "oom".to_owned(),
        At::Time(t) => format!("t{t}"),
    };
    let stem = format!("tracer-s{}-p{}-{instant}", export.session, export.pid);
    let mut written = None;
    for n in 1..=100 {
        let name = if n == 1 {
            format!("{stem}.pickle")
        } else {
            format!("{stem}-{n}.pickle")
        };
        written = dir.write_new(&name, &bytes)?;
        if written.is_some() {
            break;
        }
    }
    let path = written.ok_or_else(|| {
        crate::exit::user_error(format!(
            "{stem}.pickle and 99 more of its names exist in the export directory: remove some"
        ))
    })?;
    Ok(ExportSnapshotOut {
        path: path.display().to_string(),
        session: export.session,
        pid: export.pid,
        segments: export.segments.len(),
        blocks: export.segments.iter().map(|s| s.blocks.len()).sum(),
        entries: export.traces.iter().map(Vec::len).sum(),
        left_out: crate::present::pytorch_snapshot::left_out_lines(&export.left_out),
    })
}

// ---- the protocol ----

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct InvestigateArgs {
    /// The session to investigate (default: the latest).
    pub session: Option<String>,
}

#[tool_router(router = tool_router)]
impl TracerMcp {
    pub fn new(
        db: PathBuf,
        query_time: Duration,
        export_dir: Option<crate::paths::ExportDir>,
    ) -> Self {
        TracerMcp {
            db: Arc::new(db),
            query_time,
            export_dir: export_dir.map(Arc::new),
            tool_router: Self::tool_router(),
            prompt_router: Self::prompt_router(),
        }
    }

    #[tool(
        name = "sessions",
        description = "Recorded trace sessions, newest first: id, start (UTC), status, source, cmd (the tracer command), stored (events stored), lost (events or records tracer could not keep, summed) and losses (the non-zero loss counters by name, as in the sessions table). Start here.",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn sessions(
        &self,
        Parameters(args): Parameters<SessionsArgs>,
    ) -> Result<Json<SessionsOut>, String> {
        self.blocking(move |db| sessions(db, &args)).await.map(Json)
    }

    #[tool(
        name = "explain",
        description = "What went wrong in a session and why: the causal chains and per-process tables of `tracer explain --json`, abbreviated. Fields: s = session, w = window [from_ns, to_ns], wt = window as UTC text, n = calls in the window; ch = chains (r = rule, sev = severity, t = title, root = root cause, eff = effect, cmp = compounding, tl = timeline [seconds since the window's start, text], fix = fixes, ev = evidence); pr = processes (ops: n = calls, err = errors, p50_ns/p99_ns/max_ns = latency, b = bytes, bh = bytes in human units; warn = warnings); dev = per process and device (d = device, v = view, held = peak held bytes, res = peak reserved, alloc = peak allocated, frag = fragmentation ratio, fail = failed allocations, gpu = the physical GPU, job = the job it belongs to); who = at each out-of-memory, who held the GPU (req = bytes asked, total/free = the device's, alloc/cached/held/outside/untraced = this process's, others = [pid, command, bytes, named only by PyTorch's message], unattributed = held by no one traced or named, verdict, short = bytes short of what the device could give, math = the OOM's arithmetic in words, said = in words); omitted = (chains, processes, process-device rows) left out (at most 20 chains, 32 processes and 256 rows are returned).",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn explain(
        &self,
        Parameters(args): Parameters<ExplainArgs>,
    ) -> Result<Json<ExplainOut>, String> {
        self.blocking(move |db| explain_compact(db, &args))
            .await
            .map(Json)
    }

    #[tool(
        name = "query",
        description = "One read-only SQL statement over the trace database (SQLite), as `tracer query` runs it: writes, ATTACH, extensions and pragma assignments are refused; at most 500 rows (max_rows, default 100) and 64 KiB of cells are returned (truncated says so); a statement running past the server's time limit (tracer mcp --query-time, default 20 s) is stopped. Tables: sessions(id, started_ns, ended_ns, status, source, command, events_stored, dropped_ring_full, ... loss counters), processes(session_id, pid, comm, cmdline, exe), threads(session_id, pid, tid, comm), ops(id, name, library, class), stacks(id, session_id, pid, python, native_depth), frames, messages(session_id, ts_ns, pid, tid, op, text); the view events(session_id, ts_ns, pid, tid, comm, op, device, size, ptr, ret, duration_ns, stack_id, library, class, mem_free, mem_total) holds the device calls (times are ns since the epoch; ret 0 is success); the virtual table tensor_events(session_id, ts_ns, pid, tid, op, device, size, ptr, stack_id) holds PyTorch's block events (pytorch:malloc/free). Example: SELECT (ts_ns - (SELECT min(ts_ns) FROM events WHERE session_id = 1)) / 30000000000 AS w, count(*), avg(duration_ns) FROM events WHERE session_id = 1 AND op = 'cudaMalloc' GROUP BY w.",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn query(
        &self,
        Parameters(args): Parameters<QueryArgs>,
    ) -> Result<Json<QueryOut>, String> {
        let limit = self.query_time;
        self.blocking(move |db| query(db, &args, limit))
            .await
            .map(Json)
    }

    #[tool(
        name = "op_stats",
        description = "Per op, per time window (window_s seconds, default 30): w = window start in seconds since the session's first call, n = calls, err = errors, p50_ns/p99_ns/max_ns = duration (nearest rank), b = bytes of successful calls, bh = the same in human units. PyTorch's block events have no duration and are left out. At most 300 rows, whole windows: when truncated, ask again with from_s = next_from_s.",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn op_stats(
        &self,
        Parameters(args): Parameters<OpStatsArgs>,
    ) -> Result<Json<OpStatsOut>, String> {
        self.blocking(move |db| op_stats(db, &args)).await.map(Json)
    }

    #[tool(
        name = "stacks",
        description = "Top call sites of a session recorded with --stack, most calls first: op, pid, n = calls, b = bytes (bh in human units), py = the Python line that made them, fr = innermost frames (at most 6).",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn stacks(
        &self,
        Parameters(args): Parameters<StacksArgs>,
    ) -> Result<Json<StacksOut>, String> {
        self.blocking(move |db| stacks(db, &args)).await.map(Json)
    }

    #[tool(
        name = "layout",
        description = "The allocator's segments and blocks at a moment (at = \"oom\", \"end\" or Unix seconds), summarised per process: view (blocks when PyTorch's probes were seen), devs (per device: allocated, reserved, free_blocks, largest_free bytes, h = the same in human units, outside = device bytes outside the allocator, gpu = the physical GPU, unattributed = bytes in use then held by no traced process and no process PyTorch's message names), segs (the 12 largest segments: a = address, d = device, pool, size, alloc_blocks, free_blocks, largest_free), seg_count; procs_omitted (at most 32 processes are returned). Fragmentation shows as reserved far above allocated with a small largest_free.",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn layout(
        &self,
        Parameters(args): Parameters<LayoutArgs>,
    ) -> Result<Json<LayoutOut>, String> {
        self.blocking(move |db| layout(db, &args)).await.map(Json)
    }

    #[tool(
        name = "whatif",
        description = "One process's recorded allocator requests on one device replayed through PyTorch's allocator policy. fid: whether the simulator reproduces the run (ok; dev = device allocations recorded/simulated, placed = blocks at the recorded address / all, div = the first divergence); when ok is false the rows are the simulator's, not a prediction. rows: conf (PYTORCH_CUDA_ALLOC_CONF simulated; the first row is as run), oom (the first refused request's index, null: none), res = peak reserved, cached = peak reserved-not-allocated, allocs = device allocations, retries, least = the least memory the allocator needs for no OOM; h = the same in human units. conf: settings to try, each added to the recorded ones (at most 12; default: expandable segments, max_split_size_mb 64-512, roundup_power2_divisions, garbage_collection_threshold, pairs).",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn whatif(
        &self,
        Parameters(args): Parameters<WhatIfArgs>,
    ) -> Result<Json<WhatIfOut>, String> {
        self.blocking(move |db| whatif(db, &args)).await.map(Json)
    }

    #[tool(
        name = "export_snapshot",
        description = "Writes one process's allocator as PyTorch's memory snapshot pickle (what torch.cuda.memory._dump_snapshot() writes: segments, blocks, the trace entries with their frames) at an instant (at = \"oom\", \"end\" or Unix seconds), for pytorch.org/memory_viz or torch.cuda._memory_viz. Writes only a new file in the directory `tracer mcp --export-dir` named (refused without it); returns its path, the counts, and what was left out (segments whose blocks tracer did not see are left out whole, never shown free).",
        annotations(
            read_only_hint = false,
            destructive_hint = false,
            idempotent_hint = false,
            open_world_hint = false
        )
    )]
    async fn export_snapshot(
        &self,
        Parameters(args): Parameters<ExportSnapshotArgs>,
    ) -> Result<Json<ExportSnapshotOut>, String> {
        let Some(dir) = self.export_dir.clone() else {
            return Err("exports are off: start tracer mcp with --export-dir DIR to allow them (files are written only there)".to_owned());
        };
        self.blocking(move |db| export_snapshot(db, &dir, &args))
            .await
            .map(Json)
    }
}

#[prompt_router]
impl TracerMcp {
    #[prompt(
        name = "investigate",
        description = "Walk an investigation of a CUDA out-of-memory or slow-allocation problem: what failed, when it started, which call sites, which fix."
    )]
    async fn investigate(&self, Parameters(args): Parameters<InvestigateArgs>) -> GetPromptResult {
        let which = args
            .session
            .map_or("the latest session".to_owned(), |s| format!("session {s}"));
        let steps = format!(
            "Investigate {which} of this tracer database, read-only, in this order:\n\
             1. Call `sessions` and check `lost`: if tracer lost events, say so before concluding.\n\
             2. Call `explain` and read the chains, most severe first: what failed (rule oom, failed allocations), and the root cause.\n\
             3. Find when it started: `op_stats` with a window of a few seconds shows when cudaMalloc latency, errors or bytes changed; confirm with `query` over the events view if needed.\n\
             4. Call `layout` with at = \"oom\" (or the time the trouble began): reserved far above allocated with a small largest_free means fragmentation; large `outside` means memory held outside PyTorch's allocator.\n\
             5. Call `stacks` to name the Python lines that made the calls of the chains.\n\
             6. Answer with: what failed and when, the chain from cause to failure with its figures, the call sites, and the fix the chain names (for example PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."
        );
        GetPromptResult::new(vec![PromptMessage::new_text(Role::User, steps)])
            .with_description(format!("Investigate {which}"))
    }
}

#[tool_handler(router = self.tool_router)]
#[prompt_handler(router = self.prompt_router)]
impl ServerHandler for TracerMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_prompts()
                .build(),
        )
        .with_server_info(Implementation::new("tracer", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "tracer's CUDA allocation traces, read-only. Start with `sessions`, then `explain`; the `investigate` prompt walks the whole path. Times are ns since the epoch unless a field says seconds.",
        )
    }
}

/// Serves the protocol on stdin/stdout until the client goes.
pub async fn serve(
    db: PathBuf,
    query_time: Duration,
    export_dir: Option<crate::paths::ExportDir>,
) -> Result<()> {
    use rmcp::ServiceExt as _;
    let server = TracerMcp::new(db, query_time, export_dir)
        .serve(rmcp::transport::stdio())
        .await
        .context("starting the MCP session on stdio")?;
    server.waiting().await.context("serving MCP on stdio")?;
    Ok(())
}

// ---- whatif ----

/// Settings one call may try.
const MAX_CONFS: usize = 12;

#[derive(Debug, Default, Deserialize, JsonSchema)]
pub struct WhatIfArgs {
    /// The session (default: the latest).
    pub session: Option<i64>,
    /// The process (default: the one with an OOM, else the busiest).
    pub pid: Option<u32>,
    /// The device (default: the process's busiest).
    pub device: Option<i32>,
    /// Settings to try, each added to the recorded ones.
    pub conf: Option<Vec<String>>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct FidelityOut {
    #[serde(rename = "ok")]
    pub holds: bool,
    /// device allocations recorded / simulated
    #[serde(rename = "dev")]
    pub device_allocs: (usize, usize),
    /// blocks at the recorded address / all
    #[serde(rename = "placed")]
    pub placements: (usize, usize),
    /// the first divergence, in words
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(rename = "div")]
    pub divergence: Option<String>,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct WhatIfRowOut {
    pub conf: String,
    pub oom: Option<usize>,
    #[serde(rename = "res")]
    pub peak_reserved: u64,
    #[serde(rename = "cached")]
    pub peak_cached: u64,
    pub allocs: u64,
    pub retries: u64,
    #[serde(rename = "least")]
    pub least_memory: u64,
    #[serde(rename = "h")]
    pub text: String,
}

#[derive(Debug, Serialize, JsonSchema)]
pub struct WhatIfOut {
    pub session: i64,
    pub pid: u32,
    pub device: i32,
    pub requests: usize,
    #[serde(rename = "fid")]
    pub fidelity: FidelityOut,
    pub rows: Vec<WhatIfRowOut>,
}

pub fn whatif(db: &Path, args: &WhatIfArgs) -> Result<WhatIfOut> {
    let confs = args.conf.clone().unwrap_or_default();
    if confs.len() > MAX_CONFS {
        return Err(crate::exit::user_error(format!(
            "conf: {} settings asked, at most {MAX_CONFS} a call: split them",
            confs.len()
        )));
    }
    let w = crate::query::whatif::whatif(
        db,
        &crate::query::whatif::WhatIfQuery {
            session: args.session,
            pid: args.pid,
            device: args.device,
            confs,
            search: true,
        },
    )?;
    let f = &w.fidelity;
    let div = f
        .first_device_divergence
        .map(|(i, a, b)| format!("device allocation #{i}: recorded {a} B, simulated {b} B"))
        .or_else(|| {
            f.first_placement_divergence
                .map(|(i, a, b)| format!("allocation #{i}: recorded {a:#x}, simulated {b:#x}"))
        });
    Ok(WhatIfOut {
        session: w.session,
        pid: w.pid,
        device: w.device,
        requests: w.requests,
        fidelity: FidelityOut {
            holds: f.holds,
            device_allocs: (f.device_allocs_recorded, f.device_allocs_simulated),
            placements: (f.placements_matched, f.placements),
            divergence: div,
        },
        rows: w
            .rows
            .iter()
            .map(|r| WhatIfRowOut {
                conf: r.conf.clone(),
                oom: r.oom_request,
                peak_reserved: r.peak_reserved,
                peak_cached: r.peak_cached,
                allocs: r.device_allocs,
                retries: r.retries,
                least_memory: r.least_memory.unwrap_or(0),
                text: format!(
                    "{}; peak reserved {}, least memory {}",
                    r.oom_request
                        .map_or("no OOM".to_owned(), |i| format!("OOM at request {i}")),
                    format_bytes(r.peak_reserved),
                    format_bytes(r.least_memory.unwrap_or(0))
                ),
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_next_from_s_read_back_starts_at_its_own_window() {
        let width = ns_of(0.005);
        for w in [1i64, 1607, 1608, 123_457] {
            let next_from_s = (w * width) as f64 / 1e9;
            assert_eq!(ns_of(next_from_s) / width, w, "{next_from_s}");
        }
        assert_eq!(ns_of(0.3), 300_000_000);
    }

    #[test]
    fn every_tool_has_an_output_schema() {
        let server = TracerMcp::new(PathBuf::from("/nonexistent"), QUERY_TIME, None);
        let tools = server.tool_router.list_all();
        assert_eq!(tools.len(), 8);
        for t in tools {
            assert!(t.output_schema.is_some(), "{} has no output schema", t.name);
        }
    }
}
