//! `tracer whatif`: the recorded requests replayed under other allocator settings: whether the
//! OOM happens, the memory reserved, and the least memory the job needs under each.

use std::io::Write as _;

use anyhow::Result;
use clap::Args;
use tracer_cli::{
    present,
    query::whatif::{self, WhatIfQuery},
};

#[derive(Debug, Args)]
pub struct WhatIfArgs {
    #[command(flatten)]
    pub db: super::db::DbArgs,
    /// The session (default: the latest).
    #[arg(long)]
    pub session: Option<i64>,
    /// The process (default: the one with an OOM, else the one with the most requests).
    #[arg(long)]
    pub pid: Option<u32>,
    /// The device (default: the process's busiest).
    #[arg(long)]
    pub device: Option<i32>,
    /// Settings to try, as PYTORCH_CUDA_ALLOC_CONF writes them, each added to the recorded
    /// ones (repeatable; default: expandable segments, max_split_size_mb 64-512,
    /// roundup_power2_divisions, garbage_collection_threshold and useful pairs).
    #[arg(long = "conf", value_name = "SETTINGS")]
    pub confs: Vec<String>,
    /// Skip the least-memory search (about 15 replays a setting; for long runs).
    #[arg(long)]
    pub no_search: bool,
    /// As JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: WhatIfArgs) -> Result<()> {
    let db = args.db.path()?;
    let answer = whatif::whatif(
        &db,
        &WhatIfQuery {
            session: args.session,
            pid: args.pid,
            device: args.device,
            confs: args.confs,
            search: !args.no_search,
        },
    )?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &answer)?;
        writeln!(out)?;
    } else {
        present::whatif::text(&mut out, &answer)?;
    }
    out.flush()?;
    Ok(())
}
