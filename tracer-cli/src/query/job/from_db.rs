//! `tracer explain --db A --db B ...`: every node's database read as the dump folders would
//! be. Each out-of-memory explain finds is a rank's row (its verdict, request, line and the
//! reserved bytes then); every other process of a job that ran out somewhere is a peer, its
//! layout taken at that job's first OOM (another node's clock: said by the presenter).

use std::{collections::HashMap, path::Path};

use anyhow::{Context as _, Result};

use super::{judged, reserved_of, RankDump};
use crate::{
    model::{
        job::{job_key, job_name, NO_JOB},
        Rank,
    },
    query::{
        explain::{explain, ExplainQuery},
        layout::{layout, At, LayoutQuery},
    },
    store::{events, Access, Store},
};

/// A process of a named job that did not run out in its database: measured once the job's
/// first OOM (from any database) is known.
#[derive(Clone, Debug)]
pub struct DbPeer {
    pub db: std::path::PathBuf,
    pub session: i64,
    pub row: RankDump,
}

/// The OOMs of session `session` (default: the latest) of `db` as rank rows, and its other
/// processes of named jobs.
pub fn from_db(db: &Path, session: Option<i64>) -> Result<(Vec<RankDump>, Vec<DbPeer>)> {
    let explained = explain(
        db,
        &ExplainQuery {
            session,
            since: None,
            from: None,
            to: None,
            pid: None,
            skip_frames: Vec::new(),
        },
    )
    .with_context(|| format!("explain {}", db.display()))?;
    let session = explained.report.session;
    let store = Store::open(db, Access::ReadOnly)?;
    let conn = store.conn();
    let node = events::session_host(conn, session)?;
    let envs = events::envs(conn, session)?;
    let starts = events::start_times(conn, session)?;
    let holders = serde_json::to_value(&explained.report.holders)?;
    let row = |pid: u32, ts_ns: i64| -> RankDump {
        let env = envs.get(&pid).cloned().unwrap_or_default();
        let rank = Rank::from_env(|k| env.get(k).map(String::as_str));
        RankDump {
            path: db.to_owned(),
            job: job_name(&env, None),
            rank: env.get("RANK").map(|r| crate::model::job::clean(r, 8)),
            node: node.clone(),
            pid,
            role: "peer".into(),
            ts_ns,
            verdict: None,
            asked: None,
            shortfall: None,
            reserved: None,
            site: None,
            world_size: rank.and_then(|r| r.world_size),
            started_ns: starts.get(&pid).copied(),
        }
    };
    let mut ooms = Vec::new();
    for h in holders.as_array().into_iter().flatten() {
        let (Some(pid), Some(at)) = (h["pid"].as_u64(), h["at_ns"].as_i64()) else {
            continue;
        };
        let (verdict, asked, shortfall) = judged(Some(h));
        ooms.push(RankDump {
            role: "oom".into(),
            verdict,
            asked,
            shortfall,
            reserved: reserved_at(db, session, pid as u32, at)?,
            site: h["site"].as_str().map(str::to_owned),
            ..row(pid as u32, at)
        });
    }
    let mut pids: Vec<u32> = envs.keys().copied().collect();
    pids.sort();
    let peers = pids
        .into_iter()
        .filter(|pid| !ooms.iter().any(|o| o.pid == *pid))
        .map(|pid| row(pid, 0))
        .filter(|r| r.job != NO_JOB)
        .map(|row| DbPeer {
            db: db.to_owned(),
            session,
            row,
        })
        .collect();
    Ok((ooms, peers))
}

/// The peers of jobs that ran out somewhere among `ooms`, each laid out at its job's first OOM.
pub fn measure_peers(peers: Vec<DbPeer>, ooms: &[RankDump]) -> Result<Vec<RankDump>> {
    let mut first: HashMap<String, i64> = HashMap::new();
    for o in ooms {
        let key = job_key(&o.job, o.node.as_deref(), o.pid);
        let t = first.entry(key).or_insert(o.ts_ns);
        *t = (*t).min(o.ts_ns);
    }
    let mut out = Vec::new();
    for p in peers {
        let key = job_key(&p.row.job, p.row.node.as_deref(), p.row.pid);
        let Some(&at) = first.get(&key) else { continue };
        if p.row.started_ns.is_some_and(|s| s > at) {
            // Started after the job's OOM: a later run's, not a rank then.
            continue;
        }
        out.push(RankDump {
            ts_ns: at,
            reserved: reserved_at(&p.db, p.session, p.row.pid, at)?,
            ..p.row
        });
    }
    Ok(out)
}

/// What process `pid`'s allocator reserved at `at_ns`, over its devices.
fn reserved_at(db: &Path, session: i64, pid: u32, at_ns: i64) -> Result<Option<u64>> {
    let (_, layouts) = layout(
        db,
        &LayoutQuery {
            session: Some(session),
            pid: Some(pid),
            device: None,
            at: At::Time(at_ns),
        },
    )
    .with_context(|| format!("lay out pid {pid} of {} at its job's OOM", db.display()))?;
    Ok(reserved_of(&serde_json::to_value(&layouts)?))
}
