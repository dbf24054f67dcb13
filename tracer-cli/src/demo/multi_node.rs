//! `tracer demo multi-node`: the multi-GPU job split over two simulated nodes, each node's
//! runtime writing its own log that its own "tracer" (an importer into that node's database,
//! the session's host the node's name) reads; then the job answered across both databases as
//! `tracer explain --db A --db B` answers it. Always through the simulated runtime's logs: one
//! machine's eBPF would see both nodes' ranks in one session.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

use super::{supervise, workload, DemoOptions, Scenario};
use crate::{paths, present, query::job, record::import::SimlogImporter, store::Store};

const NODES: [&str; 2] = ["node-a", "node-b"];

/// `db`'s sibling for `node`: tracer.db -> tracer-node-a.db.
fn node_db(db: &Path, node: &str) -> PathBuf {
    let stem = db
        .file_stem()
        .map_or("tracer".into(), |s| s.to_string_lossy().into_owned());
    db.with_file_name(format!("{stem}-{node}.db"))
}

/// One simulated node: its database, session, runtime log and reader of it.
struct Node {
    db: PathBuf,
    store: Store,
    session: i64,
    log: PathBuf,
    importer: SimlogImporter,
}

pub(super) fn run(
    sim: &Path,
    demos: &Path,
    scenario: &Scenario,
    opts: &DemoOptions,
    owner: Option<(u32, u32)>,
) -> Result<()> {
    let log_dir = {
        let _as_user = paths::act_as(owner);
        tempfile::Builder::new()
            .prefix("tracer-demo-")
            .tempdir()
            .context("make a private temporary folder for the simulated nodes' logs")?
    };
    let mut nodes = Vec::new();
    for name in NODES {
        let db = node_db(&opts.db, name);
        let store = Store::open_writable(&db, owner)?;
        let session = SimlogImporter::begin_session_on(&store, name)?;
        nodes.push(Node {
            db,
            store,
            session,
            log: log_dir.path().join(format!("{name}.log")),
            importer: SimlogImporter::new(true),
        });
    }
    eprintln!(
        "demo: two simulated nodes, two ranks each; each node's runtime reports its own calls into its own database (sessions marked simulated): {} and {}",
        nodes[0].db.display(),
        nodes[1].db.display()
    );
    let logs: Vec<String> = nodes.iter().map(|n| n.log.display().to_string()).collect();
    let child = workload(demos, sim, scenario, opts, None)
        .env("SIMCUDA_NODE_EVENTS", logs.join(","))
        .spawn()
        .context("start the workload (python3)")?;
    let mut failure = None;
    let outcome = supervise(child, || {
        for n in &mut nodes {
            if let Err(e) = n.importer.import(&n.log, &mut n.store, n.session) {
                failure.get_or_insert(e);
            }
        }
    })?;
    if let Some(e) = failure {
        return Err(e.context("import a simulated node's log"));
    }
    for n in &mut nodes {
        n.importer.import(&n.log, &mut n.store, n.session)?;
        n.importer.end_session(
            &n.store,
            n.session,
            &format!("simulated node: events reported by the simulated runtime; {outcome}"),
            "complete",
        )?;
    }
    {
        let _as_user = paths::act_as(owner);
        drop(log_dir);
    }
    eprintln!("demo: {} finished: {outcome}", scenario.name);
    answer(&nodes)
}

/// The job across both nodes' databases, as `tracer explain --db A --db B` prints it.
fn answer(nodes: &[Node]) -> Result<()> {
    let (mut rows, mut peers) = (Vec::new(), Vec::new());
    for n in nodes {
        let (ooms, theirs) = job::from_db(&n.db, Some(n.session))?;
        rows.extend(ooms);
        peers.extend(theirs);
    }
    let measured = job::measure_peers(peers, &rows)?;
    rows.extend(measured);
    let jobs = job::answer(rows);
    let mut out = std::io::stdout().lock();
    present::job::text(&mut out, &jobs)?;
    writeln!(
        out,
        "\nEach node alone: tracer explain --db {}   Both again: tracer explain --db {} --db {}",
        nodes[0].db.display(),
        nodes[0].db.display(),
        nodes[1].db.display()
    )?;
    Ok(())
}
