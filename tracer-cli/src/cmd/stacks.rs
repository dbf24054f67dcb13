//! `tracer stacks`: the full call sites of a --stack session, Python frames where the
//! interpreter ran them, most frequent first.

use std::io::Write as _;

use anyhow::Result;
use clap::Args;
use tracer_cli::{
    exit::user_error,
    present,
    store::{events, Access, Store},
};
use tracer_common::Op;

#[derive(Debug, Args)]
pub struct StacksArgs {
    #[command(flatten)]
    pub db: super::db::DbArgs,
    /// The session (default: the latest).
    #[arg(long)]
    pub session: Option<i64>,
    /// Only calls of this op (e.g. cudaMalloc).
    #[arg(long)]
    pub op: Option<String>,
    /// Only this process.
    #[arg(long)]
    pub pid: Option<u32>,
    /// How many call sites to show.
    #[arg(long, default_value_t = 20)]
    pub top: u32,
    /// As JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: StacksArgs) -> Result<()> {
    let op = match &args.op {
        Some(name) => Some(Op::ALL.iter().copied().find(|o| o.name() == name).ok_or_else(|| {
            user_error(format!(
                "unknown op {name:?}: use a CUDA call name such as cudaMalloc, cuMemAlloc_v2 or cudaFreeAsync"
            ))
        })?),
        None => None,
    };
    let path = args.db.path()?;
    let store = Store::open(&path, Access::ReadOnly)?;
    let info = events::session(store.conn(), args.session)?;
    let stacks = events::stacks(store.conn(), info.id, op, args.pid, args.top)?;
    if args.json {
        return present::json::document(&stacks);
    }
    if stacks.is_empty() {
        return Err(user_error(format!(
            "session {} has no call sites{}: record them with `sudo tracer trace --stack`",
            info.id,
            if op.is_some() || args.pid.is_some() {
                " for this op or pid"
            } else {
                ""
            }
        )));
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    present::stacks::text(&mut out, &stacks)?;
    out.flush()?;
    Ok(())
}
