//! Reading a session's call sites back: the labels explain names them by (the user's own
//! frame), their frames, and the busiest sites by op.

use std::collections::HashMap;

use anyhow::{Context as _, Result};
use rusqlite::{params, Connection};
use tracer_common::Op;

use super::tensor_events::damaged_or;
use crate::model::{stack_id, SiteLabels};

/// Packages whose frames are PyTorch's own, never the user's line: matched as the path
/// component right after site-packages or dist-packages (so `lightning/pytorch/...` is not).
pub const PYTORCH_PACKAGES: &[&str] = &["torch", "functorch", "torchgen"];

/// Whether a Python frame's file is PyTorch's own or the interpreter's (its standard library,
/// frozen modules): not the user's line, whatever else is installed as a package is.
pub fn pytorch_or_interpreter(file: &str) -> bool {
    if file.starts_with('<') {
        return true;
    }
    let parts: Vec<&str> = file.split('/').collect();
    parts.iter().enumerate().any(|(i, part)| {
        let next = parts.get(i + 1).copied();
        match *part {
            "site-packages" | "dist-packages" => next.is_some_and(|n| {
                PYTORCH_PACKAGES.contains(&n)
                    || PYTORCH_PACKAGES
                        .iter()
                        .any(|p| n.strip_suffix(".py") == Some(p))
            }),
            // The standard library: lib/pythonX.Y/<module>, not its site-packages.
            _ if part.starts_with("python3")
                && i > 0
                && matches!(parts[i - 1], "lib" | "lib64") =>
            {
                next.is_some_and(|n| n != "site-packages" && n != "dist-packages")
            }
            _ => false,
        }
    })
}

/// Native modules that are never the call site (the CUDA libraries, the FFI and the interpreter).
fn runtime_module(module: &str) -> bool {
    [
        "libcudart",
        "libcuda.",
        "libffi",
        "libpython",
        "/python3",
        "libc.so",
        "ld-linux",
    ]
    .iter()
    .any(|m| module.contains(m))
}

/// "dir/train.py" from "/home/me/dir/train.py": enough to tell files apart, short enough to read.
fn short_path(path: &str) -> String {
    let parts: Vec<&str> = path.rsplit('/').take(2).collect();
    parts.into_iter().rev().collect::<Vec<_>>().join("/")
}

/// The call site of each of the session's stacks: its innermost Python frame outside PyTorch's
/// own files and the interpreter's ("dir/train.py:74 (train_step)"), ahead of any native frame;
/// frames whose file contains one of `skip` are passed over too.
pub fn site_labels(conn: &Connection, session: i64, skip: &[String]) -> Result<SiteLabels> {
    let mut stmt = conn.prepare(
        "SELECT f.stack_id, f.kind, f.function, f.file, f.line, f.module FROM stack_frames f
         JOIN stacks s ON s.id = f.stack_id WHERE s.session_id = ?1 ORDER BY f.stack_id, f.idx",
    )?;
    let mut rows = stmt.query([session])?;
    let mut labels = SiteLabels::new();
    // Per stack: the chosen Python frame, else the first native one outside the runtime.
    let mut best: HashMap<i64, (u8, String)> = HashMap::new();
    // Whether a file is PyTorch's or the interpreter's, once per file (a session repeats few).
    let mut library_file: HashMap<String, bool> = HashMap::new();
    while let Some(r) = rows.next().context("read stack_frames")? {
        let id: i64 = r.get(0)?;
        let current = best.get(&id).map_or(u8::MAX, |(rank, _)| *rank);
        if current == 0 {
            // The stack's user frame is found: its outer frames cannot rank higher.
            continue;
        }
        let kind = r.get_ref(1)?.as_str().unwrap_or_default() == "python";
        let function: Option<String> = r.get(2)?;
        let file: Option<String> = r.get(3)?;
        let line: Option<i64> = r.get(4)?;
        let where_ = |file: &str| match line {
            Some(l) => format!("{}:{l}", short_path(file)),
            None => short_path(file),
        };
        let candidate = if kind {
            let file = file.unwrap_or_default();
            let library = match library_file.get(&file) {
                Some(&known) => known,
                None => {
                    let known = pytorch_or_interpreter(&file)
                        || skip.iter().any(|p| file.contains(p.as_str()));
                    library_file.insert(file.clone(), known);
                    known
                }
            };
            // Rank 0: the innermost frame outside PyTorch and the interpreter (a framework
            // installed as a package included); 2: any Python frame.
            let rank = if library { 2 } else { 0 };
            (rank < current).then(|| {
                (
                    rank,
                    format!("{} ({})", where_(&file), function.unwrap_or_default()),
                )
            })
        } else if current > 1 {
            let module: String = r.get::<_, Option<String>>(5)?.unwrap_or_default();
            match function {
                Some(f) if !runtime_module(&module) => Some((
                    1,
                    match file {
                        Some(file) => format!("{} ({f})", where_(&file)),
                        None if module.is_empty() => f,
                        None => format!("{f} ({})", short_path(&module)),
                    },
                )),
                _ => None,
            }
        } else {
            None
        };
        if let Some((rank, label)) = candidate {
            if rank < current {
                best.insert(id, (rank, label));
            }
        }
    }
    for (id, (_, label)) in best {
        if let Some(id) = stack_id(id) {
            labels.insert(id, label);
        }
    }
    Ok(labels)
}

/// A stored frame, for `tracer stacks`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FrameOut {
    pub kind: String,
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<i64>,
    pub module: Option<String>,
    pub address: Option<i64>,
}

/// One call site with the calls made from it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StackSite {
    pub stack_id: i64,
    pub op: &'static str,
    pub pid: u32,
    pub calls: u64,
    pub bytes: u64,
    pub python: String,
    pub native_depth: u32,
    /// Innermost first.
    pub frames: Vec<FrameOut>,
}

/// The frames of call site `stack_id`, innermost first.
pub fn frames_of(conn: &Connection, stack_id: i64) -> Result<Vec<FrameOut>> {
    let mut stmt = conn.prepare_cached(
        "SELECT kind, function, file, line, module, address FROM stack_frames WHERE stack_id = ?1 ORDER BY idx",
    )?;
    let frames = stmt
        .query_map([stack_id], |r| {
            Ok(FrameOut {
                kind: r.get(0)?,
                function: r.get(1)?,
                file: r.get(2)?,
                line: r.get(3)?,
                module: r.get(4)?,
                address: r.get(5)?,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()
        .with_context(|| format!("read the frames of call site {stack_id}"))?;
    Ok(frames)
}

/// The session's call sites by (stack, op), most calls first.
pub fn stacks(
    conn: &Connection,
    session: i64,
    op: Option<Op>,
    pid: Option<u32>,
    top: u32,
) -> Result<Vec<StackSite>> {
    let mut stmt = conn.prepare(
        "WITH c AS (
             SELECT stack_id, op_id, pid, size, ret FROM calls
             WHERE session_id = ?1 AND stack_id IS NOT NULL
             UNION ALL
             SELECT t.stack_id, o.id, t.pid, t.size, 0 FROM tensor_events t JOIN ops o ON o.name = t.op
             WHERE t.session_id = ?1 AND t.stack_id IS NOT NULL)
         SELECT c.stack_id, c.op_id, s.pid, count(*), coalesce(sum(CASE WHEN c.ret = 0 THEN c.size END), 0),
                s.python, s.native_depth
         FROM c JOIN stacks s ON s.id = c.stack_id
         WHERE (?2 IS NULL OR c.op_id = ?2) AND (?3 IS NULL OR c.pid = ?3)
         GROUP BY c.stack_id, c.op_id ORDER BY count(*) DESC, c.stack_id LIMIT ?4",
    )?;
    let rows = stmt.query_map(params![session, op.map(|o| o as u32), pid, top], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, u32>(1)?,
            r.get::<_, u32>(2)?,
            r.get::<_, i64>(3)?,
            r.get::<_, i64>(4)?,
            r.get::<_, String>(5)?,
            r.get::<_, u32>(6)?,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (stack_id, op_id, pid, calls, bytes, python, native_depth) =
            row.map_err(|e| damaged_or(e, session, "read call sites"))?;
        let Some(op) = Op::from_u32(op_id) else {
            continue;
        };
        let frames = frames_of(conn, stack_id)?;
        out.push(StackSite {
            stack_id,
            op: op.name(),
            pid,
            calls: calls as u64,
            bytes: bytes as u64,
            python,
            native_depth,
            frames,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::pytorch_or_interpreter as theirs;

    /// PyTorch's own files and the interpreter's, by path component: a framework installed as
    /// a package (torchtitan, lightning's `pytorch/` folder) is the user's line.
    #[test]
    fn pytorch_and_the_interpreter_are_told_by_path_component() {
        for file in [
            "/venv/lib/python3.11/site-packages/torch/nn/functional.py",
            "/usr/lib/python3/dist-packages/torch/_tensor.py",
            "/venv/lib/python3.12/site-packages/functorch/_src/eager.py",
            "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py",
            "/usr/lib/python3.11/json/encoder.py",
            "<frozen runpy>",
        ] {
            assert!(theirs(file), "{file}");
        }
        for file in [
            "/venv/lib/python3.11/site-packages/torchtitan/components/loss.py",
            "/venv/lib/python3.11/site-packages/lightning/pytorch/trainer/trainer.py",
            "/venv/lib/python3.11/site-packages/torchvision/models/resnet.py",
            "/home/me/torch_experiments/train.py",
            "/home/me/proj/train.py",
            "train.py",
        ] {
            assert!(!theirs(file), "{file}");
        }
    }
}
