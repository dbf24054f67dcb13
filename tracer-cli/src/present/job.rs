//! `tracer explain --dumps DIR`: each job's answer across its ranks and nodes, as text.

use std::io::Write;

use anyhow::Result;

use crate::{
    query::job::{Agreement, JobAnswer, RankDump, Shape},
    units::{format_bytes as b, format_utc},
};

pub fn text(out: &mut impl Write, jobs: &[JobAnswer]) -> Result<()> {
    if jobs.is_empty() {
        writeln!(
            out,
            "No job found: no --dump-on-oom folder (dump.json), rank snapshot or database OOM."
        )?;
    }
    for j in jobs {
        job(out, j)?;
    }
    Ok(())
}

fn rank_of(r: &RankDump) -> String {
    match (&r.rank, &r.node) {
        (Some(rank), Some(node)) => format!("rank {rank} on {node}"),
        (Some(rank), None) => format!("rank {rank}"),
        (None, Some(node)) => format!("pid {} on {node}", r.pid),
        (None, None) => format!("pid {}", r.pid),
    }
}

fn job(out: &mut impl Write, j: &JobAnswer) -> Result<()> {
    let ooms = j.ranks.iter().filter(|r| r.role == "oom").count();
    let nodes = match j.nodes.len() {
        0 => "no node named (PyTorch's snapshots name none)".to_owned(),
        n => format!("{n} node(s) ({})", j.nodes.join(", ")),
    };
    writeln!(
        out,
        "Job {}: {} process(es) from {nodes}, {ooms} out-of-memory",
        j.job,
        j.ranks.len(),
    )?;
    if let Some(first) = j.first {
        let r = &j.ranks[first];
        let mut said = format!("  First: {} at {}", rank_of(r), format_utc(r.ts_ns));
        for (i, delay) in &j.followed {
            said.push_str(&format!(
                "; then {} (+{:.3} s)",
                rank_of(&j.ranks[*i]),
                *delay as f64 / 1e9
            ));
        }
        writeln!(out, "{said}")?;
        if j.nodes.len() > 1 {
            writeln!(
                out,
                "  (Times from different nodes differ by their clocks' offset, which tracer does not measure: with NTP, usually milliseconds; an order closer than that is not known.)"
            )?;
        }
    }
    writeln!(out, "  {}", shape_said(j))?;
    if let Some(said) = agreement_said(&j.agreement) {
        writeln!(out, "  {said}")?;
    }
    writeln!(
        out,
        "  {:<8} {:<16} {:>8} {:<5} {:<27} {:<16} {:>12} {:>12}",
        "RANK", "NODE", "PID", "ROLE", "AT", "VERDICT", "ASKED", "RESERVED"
    )?;
    for r in &j.ranks {
        writeln!(
            out,
            "  {:<8} {:<16} {:>8} {:<5} {:<27} {:<16} {:>12} {:>12}",
            r.rank.as_deref().unwrap_or("-"),
            r.node.as_deref().unwrap_or("-"),
            r.pid,
            r.role,
            format_utc(r.ts_ns),
            r.verdict.as_deref().unwrap_or("-"),
            r.asked.map_or("-".into(), b),
            r.reserved.map_or("-".into(), b)
        )?;
    }
    Ok(())
}

/// What the ranks' own figures say of the job: one run, every rank, one WORLD_SIZE; or what
/// disagrees.
fn agreement_said(a: &Agreement) -> Option<String> {
    let mut said = Vec::new();
    match a.world_sizes.as_slice() {
        [] => {}
        [w] if *w as usize == a.ranks_seen => said.push(format!("all {w} ranks of WORLD_SIZE {w} seen")),
        [w] => said.push(format!("{} of WORLD_SIZE {w} ranks seen (gather the other nodes' to see every one)", a.ranks_seen)),
        many => said.push(format!(
            "the ranks disagree on WORLD_SIZE ({}): two jobs under one name, or a resized elastic job",
            many.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        )),
    }
    if let Some(spread) = a.start_spread_ns {
        said.push(format!(
            "started within {:.2} s of each other",
            spread as f64 / 1e9
        ));
    }
    if !a.restarted.is_empty() {
        said.push(format!(
            "rank(s) {} seen in more than one process (restarted): each process's OOM is its own row",
            a.restarted.join(", ")
        ));
    }
    if a.runs > 1 {
        said.push(format!(
            "run {} of {} under this name, told apart by start times more than 2 minutes apart",
            a.run, a.runs
        ));
    }
    (!said.is_empty()).then(|| {
        let mut s = said.join("; ");
        s[..1].make_ascii_uppercase();
        s + "."
    })
}

fn shape_said(j: &JobAnswer) -> String {
    match &j.shape {
        Shape::SameRequest { ranks, asked, site } => format!(
            "Every rank that ran out ({ranks}) asked for {}{}: the job's shape (its size for the device), not one rank's; a fix must shrink every rank's step",
            b(*asked),
            site.as_ref().map_or(String::new(), |s| format!(" at {s}"))
        ),
        Shape::Outlier {
            rank,
            asked,
            reserved,
            others_median_reserved,
            site,
        } => format!(
            "{} stood out: it ran out{}{} holding {} reserved, while the other ranks, taken at that instant, held {} (their median) and did not",
            rank_of(&j.ranks[*rank]),
            asked.map_or(String::new(), |a| format!(" asking for {}", b(a))),
            site.as_ref().map_or(String::new(), |s| format!(" at {s}")),
            reserved.map_or("an unknown amount".into(), b),
            others_median_reserved.map_or("an unknown amount".into(), b)
        ),
        Shape::Different => {
            "The ranks that ran out asked for different sizes: each rank's verdict below".into()
        }
        Shape::Alone => {
            "Only this rank's folders are here: gather the other ranks' (every node's DIR) to compare".into()
        }
        Shape::NoOom => "No rank ran out of memory in these folders".into(),
    }
}
