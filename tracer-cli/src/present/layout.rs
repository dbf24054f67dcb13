//! `tracer layout` as text: per process and device the allocator's figures, then each segment
//! as a bar (`#` allocated, `~` freed but kept for other streams, `.` free, space unmapped)
//! with its largest free block.

use std::io::Write;

use anyhow::Result;

use crate::{
    model::{
        layout::{PoolStats, RunKind, SegmentMap},
        pools::{PoolUse, PrivatePool},
    },
    query::layout::{GpuShare, ProcessLayout},
    units::{format_bytes as b, format_utc},
};

const BAR: usize = 64;
/// Run kinds, indexed by `RunKind as usize`.
const KINDS: usize = RunKind::Unmapped as usize + 1;

fn figures(s: &PoolStats) -> String {
    format!(
        "allocated {}, reserved {}, cached {} in {} free blocks, largest {}; fragmentation {:.0} %, slack {:.0} %",
        b(s.allocated),
        b(s.reserved),
        b(s.cached()),
        s.free_blocks,
        b(s.largest_free),
        s.fragmentation() * 100.0,
        s.slack_ratio() * 100.0
    )
}

/// Who held the physical GPU, in one line.
fn gpu_share(out: &mut impl Write, gpu: &str, s: &GpuShare) -> Result<()> {
    let mut parts = vec![format!("this process {}", b(s.held))];
    parts.extend(
        s.others
            .iter()
            .map(|(pid, device, held)| format!("pid {pid} (its device {device}) {}", b(*held))),
    );
    if !s.everyone_laid_out {
        parts.push("other processes not laid out (--pid)".into());
    }
    if let (Some(total), Some(free), Some(at)) = (s.device_total, s.device_free, s.said_at_ns) {
        parts.push(format!(
            "{} in all and {} free when cudaMemGetInfo said at {}",
            b(total),
            b(free),
            format_utc(at)
        ));
    }
    if let Some(u) = s.unattributed {
        parts.push(format!(
            "{} in use then held by no traced process (CUDA contexts, processes that allocated before the trace, libraries not traced)",
            b(u)
        ));
    }
    writeln!(out, "    on {gpu}: {}", parts.join("; "))?;
    Ok(())
}

/// A segment as a bar of BAR characters, each showing what most of its bytes are.
fn bar(seg: &SegmentMap) -> String {
    let per = (seg.size as f64 / BAR as f64).max(1.0);
    (0..BAR)
        .map(|i| {
            let (from, to) = (
                seg.addr + (i as f64 * per) as u64,
                seg.addr + ((i + 1) as f64 * per) as u64,
            );
            let mut by_kind = [0u64; KINDS];
            for r in &seg.runs {
                let (s, e) = (r.addr.max(from), (r.addr + r.size).min(to));
                if s < e {
                    by_kind[r.kind as usize] += e - s;
                }
            }
            let most = (0..KINDS).max_by_key(|&k| by_kind[k]).unwrap_or(0);
            match most {
                k if k == RunKind::Allocated as usize => '#',
                k if k == RunKind::Pending as usize => '~',
                k if k == RunKind::Free as usize => '.',
                _ => ' ',
            }
        })
        .collect()
}

/// One private pool: whose it is (what tracer saw of its captures), then its figures.
fn private_pool(out: &mut impl Write, pool: &PrivatePool) -> Result<()> {
    let whose = match pool.captures {
        Some(c) if c.made || (c.captures == 0 && c.routed > 0) => mem_pool_said(pool, &c),
        Some(c) => graph_pool_said(pool, &c),
        None => "a CUDA graph's or a MemPool's, from a snapshot's segment_pool_id".to_owned(),
    };
    writeln!(
        out,
        "    private pool ({}, {}) ({whose}): {} reserved in {} segments, {} allocated, {} free in {} blocks (largest {}) that only requests routed to this pool may use",
        pool.id.0,
        pool.id.1,
        b(pool.reserved),
        pool.segments,
        b(pool.allocated),
        b(pool.free),
        pool.free_blocks,
        b(pool.largest_free)
    )?;
    Ok(())
}

fn graph_pool_said(pool: &PrivatePool, c: &PoolUse) -> String {
    let mut said = format!(
        "CUDA graphs': {} capture(s), first at {}",
        c.captures,
        format_utc(c.first_ns)
    );
    if let Some(at) = &pool.captured_at {
        said.push_str(&format!(" from {at}"));
    }
    said.push_str(&match (c.freeable(), c.graphs) {
        (true, _) => "; no graph holds it any more: its segments with no live block go back at the next cache flush".to_owned(),
        (false, 0) => "; no graph holds it, but its use count is not 0 (a MemPool or a routing still holds it)".to_owned(),
        (false, n) => format!("; held by {n} graph(s) until their reset()"),
    });
    if c.numbered {
        said.push_str("; id as PyTorch numbers new pools, counted from the captures tracer saw");
    }
    said
}

/// A pool torch.cuda.MemPool made (or that requests were routed to outside any capture).
fn mem_pool_said(pool: &PrivatePool, c: &PoolUse) -> String {
    let mut said = if c.made {
        format!("a MemPool's, made at {}", format_utc(c.first_ns))
    } else {
        format!(
            "routed to outside a capture from {} (made before tracer saw it)",
            format_utc(c.first_ns)
        )
    };
    if let Some(at) = &pool.captured_at {
        said.push_str(&format!(" from {at}"));
    }
    said.push_str(&format!("; requests routed to it {} time(s)", c.routed));
    if c.captures > 0 {
        said.push_str(&format!(", {} capture(s) into it", c.captures));
    }
    if c.use_on_oom {
        said.push_str("; use_on_oom: a request the default pools cannot serve takes its free blocks before an OOM");
    }
    if pool.mapped_segments > 0 {
        said.push_str(&format!(
            "; {} of its segments mapped with the driver's virtual memory calls, not cudaMalloc'd: from the pool's own allocator (NCCL's ncclMemAlloc, for symmetric memory) unless expandable segments made them",
            pool.mapped_segments
        ));
    }
    said.push_str(&match (c.made, c.uses) {
        (false, _) => "; its use count is not known (made before tracer saw it)".to_owned(),
        (true, 0) => "; released (use count 0): its segments with no live block go back at the next cache flush".to_owned(),
        (true, n) => format!("; use count {n}"),
    });
    said
}

pub fn text(out: &mut impl Write, session: i64, layouts: &[ProcessLayout]) -> Result<()> {
    for p in layouts {
        writeln!(
            out,
            "Session {session}, process {} (PID {}) at {} ({} view)",
            p.comm.as_deref().unwrap_or("?"),
            p.pid,
            format_utc(p.at_ns),
            p.view
        )?;
        for d in &p.devices {
            writeln!(
                out,
                "  device {} ({}): {}",
                d.device,
                d.gpu,
                figures(&d.total)
            )?;
            for (pool, s) in &d.pools {
                writeln!(out, "    {:?} pool: {}", pool, figures(s))?;
            }
            for pool in &d.private_pools {
                private_pool(out, pool)?;
            }
            if d.outside > 0 {
                writeln!(out, "    outside the allocator: {}", b(d.outside))?;
            }
            gpu_share(out, &d.gpu, &d.gpu_share)?;
            if d.pending.0 > 0 {
                writeln!(
                    out,
                    "    freed, kept until other streams' work completes (record_stream): {} in {} blocks, neither allocated nor free",
                    b(d.pending.1),
                    d.pending.0
                )?;
            }
        }
        let u = p.unexplained;
        if u != Default::default() {
            writeln!(
                out,
                "  not explained by the trace: {} blocks outside known segments (allocated before the trace began), {} frees of unseen blocks, {} overlapping blocks, {} segments freed with blocks in them",
                u.blocks_outside_segments, u.unmatched_frees, u.overlapping_blocks, u.segments_freed_with_blocks
            )?;
        }
        if !p.unknown.exact() {
            writeln!(
                out,
                "  NOT EXACT since {}: {} blocks ({}) in segments tracer never saw created, {} ({}) freed unseen, {} ({}) carried over {} gap(s) and believed held; the figures above are the segments tracer saw",
                format_utc(p.unknown.since_ns.unwrap_or(0)),
                p.orphans.0,
                b(p.orphans.1),
                p.unknown.freed_unseen,
                b(p.unknown.freed_unseen_bytes),
                p.carried.0,
                b(p.carried.1),
                p.unknown.gaps
            )?;
        }
        if let Some(line) = sight_line(p) {
            writeln!(out, "  {line}")?;
        }
        if p.held_unseen > 0 {
            writeln!(
                out,
                "  {} segment(s) made while a free block that fit was shown free: blocks handed out without PyTorch's probes (torch.cuda.caching_allocator_alloc, raw_alloc) hold memory shown free here",
                p.held_unseen
            )?;
        }
        if p.unknown.exact() {
            if let (Some(since), Some(exact)) = (p.unknown.since_ns, p.unknown.exact_ns) {
                writeln!(
                    out,
                    "  uncertain from {} (tracer did not see everything), exact again at {}",
                    format_utc(since),
                    format_utc(exact)
                )?;
            }
        }
        for seg in &p.segments {
            let largest = seg
                .runs
                .iter()
                .filter(|r| r.kind == RunKind::Free)
                .map(|r| r.size)
                .max()
                .unwrap_or(0);
            let used: u64 = seg
                .runs
                .iter()
                .filter(|r| r.kind == RunKind::Allocated)
                .map(|r| r.size)
                .sum();
            writeln!(
                out,
                "  {:#014x} {:>10} [{}] {:>10} used, largest free {}{}",
                seg.addr,
                b(seg.size),
                bar(seg),
                b(used),
                b(largest),
                if seg.expandable { " (expandable)" } else { "" }
            )?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// What the layout knows of the blocks under `--allocator auto`, when not everything.
fn sight_line(p: &ProcessLayout) -> Option<String> {
    use crate::model::layout::BlockSight;
    let (n, bytes) = p.unseen_contents;
    let unseen = if n > 0 {
        format!(
            "; {n} segment(s) ({}) made before then hold blocks tracer did not see: not in the figures above, their free space unknown (never shown free) until released",
            b(bytes)
        )
    } else {
        String::new()
    };
    match p.block_sight {
        BlockSight::Always if n == 0 => None,
        BlockSight::Always => Some(format!("contents unknown{unseen}")),
        BlockSight::ArmedAt(at) => Some(format!(
            "PyTorch's allocator probes armed at {} (--allocator auto){unseen}",
            format_utc(at)
        )),
        BlockSight::ArmingSince(at) => Some(format!(
            "PyTorch's allocator probes being armed since {} (--allocator auto): segments made until they are up hold blocks tracer may not have seen{unseen}",
            format_utc(at)
        )),
        BlockSight::DisarmedAt(at) => Some(format!(
            "PyTorch's allocator probes NOT ARMED since {} (--allocator auto): blocks not seen; {n} segment(s) ({}) of unknown contents",
            format_utc(at),
            b(bytes)
        )),
    }
}
