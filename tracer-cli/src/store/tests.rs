//! The store's unit tests: writes, reads, walks, keyframes, eviction, migrations.
//!
//! Over 700 lines because they share one set of fixtures (a store, varied calls, keyframes).

use rusqlite::params;
use tracer_common::Op;

use super::*;
use crate::{decode::Call, exit::code_of, model::stack_id, store::readonly};

fn call(op: Op, ts: u64, size: Option<u64>, ptr: Option<u64>, ret: i32) -> Call {
    Call {
        ts_mono_ns: ts,
        pid: 100,
        tid: 101,
        op,
        device: Some(0),
        ret,
        duration_ns: 1000,
        size,
        ptr,
        aux0: 0,
        aux1: 0,
        flags: 0,
        comm: "worker".into(),
        site: None,
        stack: None,
    }
}

pub(crate) fn new_store(dir: &tempfile::TempDir) -> (Store, i64) {
    let store = Store::open(&dir.path().join("t.db"), Access::ReadWrite).unwrap();
    let session = new_session(&store);
    (store, session)
}

fn new_session(store: &Store) -> i64 {
    store
        .begin_session(&SessionStart {
            source: "ebpf",
            ..Default::default()
        })
        .unwrap()
}

pub(crate) fn write(store: &mut Store, session: i64, calls: &[Call]) {
    let threads = vec![(100, 101, "worker".to_string())];
    store
        .write_batch(&Batch {
            session,
            wall_offset_ns: 1_000,
            calls,
            threads: &threads,
            processes: &[],
            offcpu: &[],
            messages: &[],
        })
        .unwrap();
}

#[test]
fn creates_schema_and_events_view() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, session) = new_store(&dir);
    write(
        &mut store,
        session,
        &[
            call(Op::CudaMalloc, 5, Some(4096), Some(0x7f00), 0),
            call(Op::CudaFree, 9, Some(4096), Some(0x7f00), 0),
        ],
    );
    let version: i64 = store
        .conn()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let row: (i64, i64, String, String, i64, i64) = store
        .conn()
        .query_row(
            "SELECT session_id, ts_ns, comm, op, size, ptr FROM events ORDER BY ts_ns LIMIT 1",
            [],
            |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                ))
            },
        )
        .unwrap();
    assert_eq!(
        row,
        (
            session,
            1_005,
            "worker".into(),
            "cudaMalloc".into(),
            4096,
            0x7f00
        )
    );
}

#[test]
fn reopening_keeps_data_and_read_only_works() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut store, session) = new_store(&dir);
        write(
            &mut store,
            session,
            &[call(Op::CudaMalloc, 5, Some(1), Some(1), 0)],
        );
    }
    let ro = Store::open(&dir.path().join("t.db"), Access::ReadOnly).unwrap();
    let n: i64 = ro
        .conn()
        .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
    let rw = Store::open(&dir.path().join("t.db"), Access::ReadWrite).unwrap();
    let n: i64 = rw
        .conn()
        .query_row("SELECT count(*) FROM calls", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
}

#[test]
fn refuses_newer_schema_without_touching_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    drop(new_store(&dir));
    Connection::open(&path)
        .unwrap()
        .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
        .unwrap();
    let before = std::fs::read(&path).unwrap();
    for access in [Access::ReadWrite, Access::ReadOnly] {
        let err = Store::open(&path, access).err().unwrap();
        assert_eq!(code_of(&err), crate::exit::BAD_INPUT);
        assert!(err.to_string().contains("newer tracer"), "{err}");
    }
    assert_eq!(std::fs::read(&path).unwrap(), before);
}

#[test]
fn refuses_corrupt_and_foreign_files() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.db");
    std::fs::write(&junk, vec![b'x'; 4096]).unwrap();
    let err = Store::open(&junk, Access::ReadWrite).err().unwrap();
    assert!(
        err.to_string().contains("not a usable tracer database"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&junk).unwrap(),
        vec![b'x'; 4096],
        "a corrupt file is left as it was"
    );

    let foreign = dir.path().join("other.db");
    Connection::open(&foreign)
        .unwrap()
        .execute_batch("CREATE TABLE notes (x)")
        .unwrap();
    let err = Store::open(&foreign, Access::ReadWrite).err().unwrap();
    assert!(err.to_string().contains("another program"), "{err}");

    let missing = dir.path().join("missing.db");
    let err = Store::open(&missing, Access::ReadOnly).err().unwrap();
    assert!(err.to_string().contains("does not exist"), "{err}");
    assert!(!missing.exists());
}

#[test]
fn max_size_deletes_oldest_sessions_first() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, old) = new_store(&dir);
    let calls: Vec<Call> = (0..20_000)
        .map(|i| call(Op::CudaMalloc, i, Some(i), Some(i), 0))
        .collect();
    write(&mut store, old, &calls);
    let current = new_session(&store);
    write(&mut store, current, &calls[..2000]);
    let used = store.used_bytes().unwrap();
    let notes = store.enforce_max_size(current, used / 2).unwrap().notes;
    assert!(
        notes[0].contains(&format!("deleted session {old} (20000 events)")),
        "{notes:?}"
    );
    assert!(store.used_bytes().unwrap() <= used / 2);
    let left: i64 = store
        .conn()
        .query_row(
            "SELECT count(*) FROM calls WHERE session_id = ?1",
            [current],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        left, 2000,
        "the current session is untouched while older ones remain"
    );
}

#[test]
fn query_guard_allows_reads_and_refuses_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, session) = new_store(&dir);
    write(
        &mut store,
        session,
        &[call(Op::CudaMalloc, 5, Some(7), Some(8), 2)],
    );
    drop(store);
    let ro = Store::open(&dir.path().join("t.db"), Access::ReadOnly).unwrap();
    let mut rows = Vec::new();
    readonly::run(
        ro.conn(),
        "SELECT op, ret FROM events",
        |_| Ok(()),
        |r| {
            rows.push(r.to_vec());
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(
        rows,
        vec![vec![
            readonly::Cell::Text("cudaMalloc".into()),
            readonly::Cell::Int(2)
        ]]
    );
    for sql in [
        "DELETE FROM calls",
        "INSERT INTO ops VALUES (99, 'x', 'y', 'z')",
        "ATTACH DATABASE ':memory:' AS other",
        "PRAGMA user_version = 7",
        "SELECT load_extension('/tmp/evil.so')",
        "SELECT 1; DROP TABLE calls",
        "CREATE TEMP TABLE t (x)",
    ] {
        let err = readonly::run(ro.conn(), sql, |_| Ok(()), |_| Ok(()))
            .err()
            .unwrap_or_else(|| panic!("{sql} ran"));
        assert_eq!(code_of(&err), crate::exit::BAD_INPUT, "{sql}: {err}");
    }
    let n: i64 = ro
        .conn()
        .query_row("SELECT count(*) FROM calls", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
}

#[test]
fn migrates_a_version_1_database_and_keeps_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(super::schema::MIGRATIONS[0]).unwrap();
        conn.execute_batch(
            "INSERT INTO sessions (started_ns, status, source, tracer_version) VALUES (1, 'complete', 'ebpf', '0.1.0');
             INSERT INTO calls (session_id, ts_ns, pid, tid, op_id, ret, duration_ns, flags) VALUES (1, 5, 1, 1, 0, 0, 9, 0);
             PRAGMA user_version = 1;",
        )
        .unwrap();
    }
    let err = Store::open(&path, Access::ReadOnly).err().unwrap();
    assert!(err.to_string().contains("schema version 1"), "{err}");
    let store = Store::open(&path, Access::ReadWrite).unwrap();
    let version: i64 = store
        .conn()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let n: i64 = store
        .conn()
        .query_row(
            "SELECT count(*) FROM events WHERE duration_ns = 9",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(n, 1);
    let (off, blocks): (i64, i64) = store
        .conn()
        .query_row(
            "SELECT offcpu_dropped, call_blocks FROM sessions",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((off, blocks), (0, 0), "an old session has no call blocks");
    // So explain reads its rows.
    drop(store);
    let events = whole_session::load(&path, 1, i64::MAX, None).unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!((events[0].ts_ns, events[0].duration_ns), (5, 9));
}

/// The parallel reader returns exactly what one ordered query returns: the session's calls up
/// to the end time, of the pid asked for, in (entry time, id) order, even when another session's
/// rows are interleaved and the writer's batches are out of time order.
#[test]
fn parallel_load_matches_one_ordered_query() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, first) = new_store(&dir);
    let second = new_session(&store);
    for batch in 0..20u64 {
        for session in [first, second] {
            // Entry times go backwards inside a batch, as returns from several CPUs do.
            let calls: Vec<Call> = (0..50u64)
                .map(|i| {
                    let mut c = call(
                        Op::CudaMalloc,
                        1_000_000 + batch * 1000 + (50 - i) * 7 % 40,
                        Some(i),
                        Some(i),
                        0,
                    );
                    c.pid = 100 + (i % 3) as u32;
                    c
                })
                .collect();
            write(&mut store, session, &calls);
        }
    }
    let path = dir.path().join("t.db");
    let key = |e: &crate::model::Event| (e.ts_ns, e.pid, e.size);
    for (pid, to_ns) in [(None, i64::MAX), (Some(101), i64::MAX), (None, 1_011_020)] {
        let single = whole_session::load_split(&path, second, to_ns, pid, i64::MAX).unwrap();
        let parallel = whole_session::load_split(&path, second, to_ns, pid, 1).unwrap();
        let mut stmt = store
            .conn()
            .prepare(
                "SELECT ts_ns, pid, size FROM calls WHERE session_id = ?1 AND ts_ns <= ?2
                 AND (?3 IS NULL OR pid = ?3) ORDER BY ts_ns, id",
            )
            .unwrap();
        let expected: Vec<(i64, u32, u64)> = stmt
            .query_map(rusqlite::params![second, to_ns, pid], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get::<_, Option<i64>>(2)?.unwrap_or(0) as u64,
                ))
            })
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert!(expected.len() > 100, "{pid:?} {to_ns}: {}", expected.len());
        assert_eq!(single.iter().map(key).collect::<Vec<_>>(), expected);
        assert_eq!(parallel.iter().map(key).collect::<Vec<_>>(), expected);
    }
}

/// A call site is named by its first frame in the user's own code: not the CUDA libraries, not
/// site-packages or the standard library (nor what --skip-frames adds); a stack without any
/// Python frame by its first native frame outside the runtime.
#[test]
fn site_labels_pick_the_first_user_frame() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, session) = new_store(&dir);
    let native = |f: &str, module: &str| StackFrame {
        kind: "native",
        function: Some(f.into()),
        file: None,
        line: None,
        module: Some(module.into()),
        address: Some(0x10),
    };
    let py = |f: &str, file: &str, line: i64| StackFrame {
        kind: "python",
        function: Some(f.into()),
        file: Some(file.into()),
        line: Some(line),
        module: None,
        address: None,
    };
    let python_stack = [
        native("cudaMalloc", "/x/libcudart.so.12"),
        py(
            "malloc",
            "/venv/lib/python3.11/site-packages/torch/cuda/memory.py",
            40,
        ),
        py("helper", "/home/me/proj/utils.py", 7),
        py("train_step", "/home/me/proj/train.py", 74),
    ];
    let c_stack = [
        native("cudaMalloc", "/x/libcudart.so.12"),
        native("allocate", "/home/me/app"),
        native("main", "/home/me/app"),
    ];
    // A framework installed as a package: every Python frame under site-packages, native
    // frames of PyTorch's inside (issue 49's A100 snapshot, torchtitan).
    let site = "/venv/lib/python3.11/site-packages";
    let framework_stack = [
        native("cudaMalloc", "/x/libcudart.so.12"),
        native(
            "at::detail::empty_generic",
            &format!("{site}/torch/lib/libtorch_cpu.so"),
        ),
        py(
            "cross_entropy",
            &format!("{site}/torch/nn/functional.py"),
            3494,
        ),
        py(
            "cross_entropy_loss",
            &format!("{site}/torchtitan/components/loss.py"),
            21,
        ),
        py("train_step", &format!("{site}/torchtitan/train.py"), 400),
        py("_run_module_as_main", "<frozen runpy>", 198),
    ];
    let lightning_stack = [
        native("cudaMalloc", "/x/libcudart.so.12"),
        py("linear", &format!("{site}/torch/nn/modules/linear.py"), 125),
        py(
            "training_step",
            &format!("{site}/lightning/pytorch/core/module.py"),
            77,
        ),
    ];
    let mut ids = Vec::new();
    for frames in [
        &python_stack[..],
        &c_stack[..],
        &framework_stack[..],
        &lightning_stack[..],
    ] {
        ids.push(
            store
                .insert_stack(
                    session,
                    &StackRow {
                        pid: 100,
                        native_depth: 3,
                        python: "ok",
                        frames,
                    },
                )
                .unwrap(),
        );
    }
    let labels = events::site_labels(store.conn(), session, &[]).unwrap();
    assert_eq!(
        labels[&stack_id(ids[0]).unwrap()],
        "proj/utils.py:7 (helper)"
    );
    assert_eq!(labels[&stack_id(ids[1]).unwrap()], "allocate (me/app)");
    assert_eq!(
        labels[&stack_id(ids[2]).unwrap()],
        "components/loss.py:21 (cross_entropy_loss)"
    );
    assert_eq!(
        labels[&stack_id(ids[3]).unwrap()],
        "core/module.py:77 (training_step)"
    );
    let skip = ["utils.py".to_string()];
    let labels = events::site_labels(store.conn(), session, &skip).unwrap();
    assert_eq!(
        labels[&stack_id(ids[0]).unwrap()],
        "proj/train.py:74 (train_step)"
    );
}

/// Calls with every field varied: absent values, aux values, call sites, several processes and
/// entry times out of order, as a trace writes them.
pub(crate) fn varied_calls(n: u64, seed: u64) -> Vec<Call> {
    (0..n)
        .map(|i| {
            let k = i * 7 + seed;
            let op = Op::ALL[(k % Op::ALL.len() as u64) as usize];
            let mut c = call(
                op,
                10_000_000 + seed * 100_000_000 + i * 1_000 - (k % 5) * 300,
                (!k.is_multiple_of(4)).then_some(k << 12),
                (!k.is_multiple_of(6)).then_some(0x7f00_0000_0000 + (k % 97) * 4096),
                if k.is_multiple_of(11) { 2 } else { 0 },
            );
            c.pid = 100 + (k % 3) as u32;
            c.tid = 1000 + (k % 5) as u32;
            c.device = (!k.is_multiple_of(13)).then_some((k % 2) as i32);
            c.duration_ns = 500 + k % 10_000;
            c.aux0 = if k.is_multiple_of(9) { k << 20 } else { 0 };
            c.aux1 = if k.is_multiple_of(9) { k << 30 } else { 0 };
            c
        })
        .collect()
}

/// The events that have rows: all but the allocator's block events.
fn without_block_events(events: &[crate::model::Event]) -> Vec<crate::model::Event> {
    events
        .iter()
        .filter(|e| {
            !matches!(
                e.class(),
                tracer_common::OpClass::BlockAlloc | tracer_common::OpClass::BlockFree
            )
        })
        .copied()
        .collect()
}

/// What the rows say, through the row reader.
fn from_rows(
    path: &std::path::Path,
    session: i64,
    to_ns: i64,
    pid: Option<u32>,
) -> Vec<crate::model::Event> {
    whole_session::load_split(path, session, to_ns, pid, 1).unwrap()
}

/// Every call of a session has its copy in the call blocks: decoding the blocks gives exactly
/// the events the rows give (every field, the same order, the same filters), and the blocks'
/// id ranges cover the session's rows one to one.
#[test]
fn call_blocks_hold_exactly_the_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, first) = new_store(&dir);
    let second = new_session(&store);
    let stack = store
        .insert_stack(
            second,
            &StackRow {
                pid: 100,
                native_depth: 0,
                python: "ok",
                frames: &[],
            },
        )
        .unwrap();
    for batch in 0..4u64 {
        for session in [first, second] {
            // One batch larger than a block, so that batches span several blocks.
            let n = if batch == 1 {
                blocks::MAX_CALLS as u64 + 1000
            } else {
                700
            };
            let mut calls = varied_calls(n, batch);
            for (i, c) in calls.iter_mut().enumerate() {
                c.stack = (session == second && i.is_multiple_of(3)).then_some(stack);
            }
            write(&mut store, session, &calls);
        }
    }
    let rows_total: i64 = store
        .conn()
        .query_row(
            "SELECT count(*) FROM calls WHERE session_id = ?1",
            [second],
            |r| r.get(0),
        )
        .unwrap();
    let (blocks, copied, covered, rowless): (i64, i64, i64, i64) = store
        .conn()
        .query_row(
            "SELECT count(*), sum(b.calls),
                    sum((SELECT count(*) FROM calls c WHERE c.session_id = b.session_id
                         AND c.id BETWEEN b.first_call AND b.last_call)), sum(b.rowless)
             FROM call_blocks b WHERE b.session_id = ?1",
            [second],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    // The allocator's block events have no rows: the blocks hold them and every row.
    assert!(rowless > 50, "{rowless}");
    assert_eq!((copied - rowless, covered), (rows_total, rows_total));
    let tensor_rows: i64 = store
        .conn()
        .query_row(
            "SELECT count(*) FROM tensor_events WHERE session_id = ?1",
            [second],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tensor_rows, rowless);
    assert_eq!(
        blocks, 5,
        "3 small batches in one block each, the large one in two"
    );
    for (pid, to_ns) in [
        (None, i64::MAX),
        (Some(101), i64::MAX),
        (None, 110_002_000),
        (Some(102), 210_000_000),
    ] {
        let rows = from_rows(&path, second, to_ns, pid);
        let from_blocks = whole_session::load_blocks(&path, second, to_ns, pid).unwrap();
        assert!(rows.len() > 100, "{pid:?} {to_ns}: {}", rows.len());
        assert_eq!(without_block_events(&from_blocks), rows, "{pid:?} {to_ns}");
        assert_eq!(
            whole_session::load(&path, second, to_ns, pid).unwrap(),
            from_blocks
        );
    }
    let with_site = from_rows(&path, second, i64::MAX, None)
        .iter()
        .filter(|e| e.stack == stack_id(stack))
        .count();
    assert!(with_site > 1000, "{with_site}");
}

/// A block that cannot be decoded is not misread: explain's loader says so and reads the rows.
#[test]
fn a_damaged_call_block_falls_back_to_the_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, session) = new_store(&dir);
    write(&mut store, session, &varied_calls(500, 0));
    write(&mut store, session, &varied_calls(500, 1));
    store
        .conn()
        .execute("UPDATE call_blocks SET data = substr(data, 1, 100) WHERE id = (SELECT max(id) FROM call_blocks)", [])
        .unwrap();
    let err = whole_session::load_blocks(&path, session, i64::MAX, None).unwrap_err();
    assert!(
        format!("{err:#}").contains("is damaged: ends inside record"),
        "{err:#}"
    );
    let rows = from_rows(&path, session, i64::MAX, None);
    let rowed = |seed| {
        varied_calls(500, seed)
            .iter()
            .filter(|c| super::has_row(c))
            .count()
    };
    assert_eq!(rows.len(), rowed(0) + rowed(1));
    assert_eq!(
        whole_session::load(&path, session, i64::MAX, None).unwrap(),
        rows
    );
}

/// --max-db evicting the oldest calls of the running session removes whole blocks and exactly
/// their rows, so the blocks still equal the rows, and counts what it deleted.
#[test]
fn evicting_part_of_the_current_session_keeps_blocks_and_rows_equal() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, session) = new_store(&dir);
    write(&mut store, session, &varied_calls(5000, 0));
    // Without a keyframe nothing of the session can go: what its calls built would be lost.
    let used = store.used_bytes().unwrap();
    let eviction = store.enforce_max_size(session, used / 4).unwrap();
    assert!(eviction.notes.is_empty() && eviction.need_keyframe);
    for batch in 1..6u64 {
        store.insert_keyframe(session, batch as i64, &[]).unwrap();
        write(&mut store, session, &varied_calls(5000, batch));
    }
    let used = store.used_bytes().unwrap();
    let eviction = store.enforce_max_size(session, used * 8 / 10).unwrap();
    assert!(!eviction.notes.is_empty());
    // Cut at keyframes: the keyframes before the cut went, the one at it stays.
    let (keyframes, first_through, first_block): (i64, i64, i64) = store
        .conn()
        .query_row(
            "SELECT count(*), min(through_block), (SELECT min(id) FROM call_blocks WHERE session_id = ?1)
             FROM keyframes WHERE session_id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert!(keyframes < 5);
    assert_eq!(first_through + 1, first_block);
    // The pages the deleted blocks used went back to the file system.
    let free: i64 = store
        .conn()
        .query_row("PRAGMA freelist_count", [], |r| r.get(0))
        .unwrap();
    assert_eq!(free, 0);
    let (left, rows_left, evicted): (i64, i64, i64) = store
        .conn()
        .query_row(
            "SELECT (SELECT sum(calls) FROM call_blocks WHERE session_id = ?1),
                    (SELECT count(*) FROM calls WHERE session_id = ?1), evicted_events
             FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(left + evicted, 30_000);
    assert_eq!(
        evicted % 5000,
        0,
        "whole blocks (one per batch here): {evicted}"
    );
    assert!(evicted > 0 && left > 0, "{left} left, {evicted} evicted");
    let rows = from_rows(&path, session, i64::MAX, None);
    assert_eq!(rows.len() as i64, rows_left);
    let from_blocks = whole_session::load_blocks(&path, session, i64::MAX, None).unwrap();
    assert_eq!(from_blocks.len() as i64, left);
    assert_eq!(without_block_events(&from_blocks), rows);
}

/// The loader's sort gives what a stable sort by entry time gives: for calls in return order
/// (nearly sorted), and for calls in no order at all (where it falls back to the general sort).
#[test]
fn nearly_sorted_calls_are_put_in_time_order_stably() {
    let mk = |ts: i64, id: u64| crate::model::Event {
        ts_ns: ts,
        duration_ns: 0,
        size: id,
        ptr: 0,
        aux0: 0,
        aux1: 0,
        pid: 1,
        tid: 1,
        ret: 0,
        device: 0,
        stack: None,
        op: Op::CudaMalloc,
    };
    // Return order: call i began at 10 i and lasted (i * 37) % 100, a few long ones much more.
    let mut by_return: Vec<(i64, i64, u64)> = (0..5000u64)
        .map(|i| {
            let ts = 10 * i as i64 / 3; // equal entry times too
            let dur = if i.is_multiple_of(997) {
                20_000
            } else {
                (i as i64 * 37) % 100
            };
            (ts + dur, ts, i)
        })
        .collect();
    by_return.sort();
    let nearly: Vec<_> = by_return.iter().map(|&(_, ts, id)| mk(ts, id)).collect();
    let shuffled: Vec<_> = (0..5000u64)
        .map(|i| mk(((i * 7919) % 5000) as i64 / 2, i))
        .collect();
    for input in [nearly, shuffled] {
        let mut want = input.clone();
        want.sort_by_key(|e| e.ts_ns);
        let mut got = input.clone();
        whole_session::sort_nearly_sorted(&mut got);
        assert_eq!(got, want);
    }
}

/// A session left running by a tracer that is gone (killed, or the machine restarted) is
/// marked crashed by the next trace, its calls kept; a running tracer's session is left alone.
#[test]
fn sessions_whose_tracer_is_gone_are_marked_crashed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, ours) = new_store(&dir);
    write(
        &mut store,
        ours,
        &[call(Op::CudaMalloc, 10, Some(64), Some(0x10), 0)],
    );
    let killed = new_session(&store);
    let rebooted = new_session(&store);
    store
        .conn()
        .execute(
            "UPDATE sessions SET tracer_pid = 999999999 WHERE id = ?1",
            [killed],
        )
        .unwrap();
    store
        .conn()
        .execute(
            "UPDATE sessions SET boot_id = 'another boot' WHERE id = ?1",
            [rebooted],
        )
        .unwrap();
    assert_eq!(
        store.close_orphaned_sessions().unwrap(),
        vec![killed, rebooted]
    );
    let status = |id: i64| -> (String, String) {
        store
            .conn()
            .query_row(
                "SELECT status, coalesce(note, '') FROM sessions WHERE id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap()
    };
    assert_eq!(status(ours).0, "running");
    assert_eq!(status(killed).0, "crashed");
    assert!(
        status(killed).1.contains("tracer process is gone"),
        "{:?}",
        status(killed)
    );
    assert!(status(rebooted).1.contains("machine restarted"));
    let kept: i64 = store
        .conn()
        .query_row(
            "SELECT count(*) FROM calls WHERE session_id = ?1",
            [ours],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(kept, 1);
    assert!(store.close_orphaned_sessions().unwrap().is_empty());
}

/// The walk hands calls on in exactly the loader's order (entry time, then the writer's), a
/// block at a time, also when a long call is stored far behind the ones that began after it; and
/// from a keyframe, exactly the calls of the blocks after it.
#[test]
fn the_walk_reads_what_the_loader_reads_in_its_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, session) = new_store(&dir);
    let mut through = 0;
    for batch in 0..5 {
        let mut calls = varied_calls(20_000, batch);
        // A call that began long before the rest of its batch, stored with it.
        calls[19_000].ts_mono_ns = 1_000;
        write(&mut store, session, &calls);
        if batch == 2 {
            through = store
                .insert_keyframe(session, 0, &[])
                .unwrap()
                .through_block;
        }
    }
    for (to_ns, pid) in [(i64::MAX, None), (250_000_000, Some(101))] {
        let mut walked = Vec::new();
        let w = super::walk::walk(
            &super::events::open_reader(&path).unwrap(),
            session,
            0,
            to_ns,
            pid,
            |step| {
                if let super::walk::Step::Call(e) = step {
                    walked.push(*e);
                }
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(
            walked,
            whole_session::load(&path, session, to_ns, pid).unwrap()
        );
        assert_eq!((w.calls as usize, w.out_of_order), (walked.len(), 0));
        // A process's span from the blocks at its ends: the walk's first and last of its calls
        // (the long call stored late is the first).
        for p in [100, 101, 102, 999]
            .into_iter()
            .filter(|&p| pid.is_none_or(|q| q == p))
        {
            let conn = super::events::open_reader(&path).unwrap();
            let theirs: Vec<i64> = walked
                .iter()
                .filter(|e| e.pid == p)
                .map(|e| e.ts_ns)
                .collect();
            let span = theirs.first().zip(theirs.last()).map(|(a, b)| (*a, *b));
            let read = super::walk::pid_span(&conn, session, p, to_ns).unwrap();
            assert_eq!(read, span, "pid {p} up to {to_ns}");
        }
    }
    let mut after = 0;
    super::walk::walk(
        &super::events::open_reader(&path).unwrap(),
        session,
        through,
        i64::MAX,
        None,
        |_| {
            after += 1;
            Ok(())
        },
    )
    .unwrap();
    let expected: i64 = store
        .conn()
        .query_row(
            "SELECT sum(calls) FROM call_blocks WHERE session_id = ?1 AND id > ?2",
            [session, through],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(after, expected);
    assert_eq!(expected, 40_000);
}

/// --max-db keeps the detail around an incident the whole-run series counted (an OOM in the
/// fifth of twenty batches, 100 s apart) and deletes the rest of the oldest calls; a walk over
/// what is left passes each hole once, between the kept calls and the latest ones, and every
/// call is either walked or counted evicted.
#[test]
fn eviction_keeps_the_detail_around_an_incident_and_walks_resume_after_holes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, session) = new_store(&dir);
    let gap = 100_000_000_000u64;
    for batch in 0..20u64 {
        store
            .insert_keyframe(session, (batch * gap) as i64 + 1_000, &[])
            .unwrap();
        let mut calls = varied_calls(5000, batch % 7);
        for c in &mut calls {
            c.ts_mono_ns += batch * gap;
        }
        write(&mut store, session, &calls);
    }
    store
        .insert_keyframe(session, (20 * gap) as i64, &[])
        .unwrap();
    let oom_at = (4 * gap) as i64 + 412_000_000;
    store
        .conn()
        .execute(
            "INSERT INTO series (session_id, pid, device, start_ns, end_ns, allocated, reserved, cached,
               largest_free, fragmentation, largest_request, calls, errors, failures, ooms, retries, warnings, ops)
             VALUES (?1, 100, 0, ?2, ?2 + 10000000000, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, '[]')",
            params![session, oom_at],
        )
        .unwrap();
    let budget = store.footprint().unwrap() * 6 / 10;
    let eviction = store.enforce_max_size(session, budget).unwrap();
    assert!(
        eviction.notes.iter().any(|n| n.contains("incident")),
        "{:?}",
        eviction.notes
    );
    let (from, to, reason): (i64, i64, String) = store
        .conn()
        .query_row("SELECT from_ns, to_ns, reason FROM kept", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .unwrap();
    // From the first call left in the minute before it to 5 s after its 10 s interval.
    assert!((oom_at - 60_000_000_000..oom_at).contains(&from), "{from}");
    assert_eq!(
        (to, reason.as_str()),
        (oom_at + 15_000_000_000, "OOM, failed allocation")
    );
    let mut batches = std::collections::BTreeSet::new();
    let (mut calls, mut holes) = (0i64, Vec::new());
    super::walk::walk(
        &super::events::open_reader(&path).unwrap(),
        session,
        0,
        i64::MAX,
        None,
        |step| {
            match step {
                super::walk::Step::Call(e) => {
                    calls += 1;
                    batches.insert(e.ts_ns as u64 / gap);
                }
                super::walk::Step::Hole(h) => {
                    holes.push((h.from_ns as u64 / gap, h.to_ns as u64 / gap))
                }
            }
            Ok(())
        },
    )
    .unwrap();
    // The minute before the OOM holds no call (batch 3 lies at 300 s): the OOM's batch is kept,
    // from the keyframe at its start; those before and the next ones went.
    let first_after = batches.iter().copied().nth(1).unwrap();
    assert_eq!(batches.first(), Some(&4), "{batches:?}");
    assert!(first_after > 5, "{batches:?}");
    assert_eq!(holes, [(0, 3), (5, first_after - 1)], "{batches:?}");
    assert!(batches.iter().skip(1).copied().eq(first_after..20));
    let (evicted, hole_calls): (i64, i64) = store
        .conn()
        .query_row(
            "SELECT evicted_events, (SELECT sum(calls) FROM holes) FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(calls + evicted, 100_000);
    assert_eq!(hole_calls, evicted);
}

/// A block written after eviction deleted every block gets an id above the hole's: the walk
/// reads it after the hole, not as a call from before it (SQLite's rowid would have started
/// again at one).
#[test]
fn blocks_written_after_everything_was_evicted_come_after_the_hole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, session) = new_store(&dir);
    for batch in 0..3u64 {
        store.insert_keyframe(session, 0, &[]).unwrap();
        write(&mut store, session, &varied_calls(5000, batch));
    }
    store.insert_keyframe(session, 0, &[]).unwrap();
    store.enforce_max_size(session, 172_032).unwrap();
    let (blocks, hole_end): (i64, i64) = store
        .conn()
        .query_row(
            "SELECT (SELECT count(*) FROM call_blocks), (SELECT max(through_block) FROM holes)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(blocks, 0);
    write(&mut store, session, &varied_calls(5000, 3));
    let first: i64 = store
        .conn()
        .query_row("SELECT min(id) FROM call_blocks", [], |r| r.get(0))
        .unwrap();
    assert!(
        first > hole_end,
        "block {first} after hole through {hole_end}"
    );
    let mut steps = Vec::new();
    super::walk::walk(
        &super::events::open_reader(&path).unwrap(),
        session,
        0,
        i64::MAX,
        None,
        |step| {
            steps.push(matches!(step, super::walk::Step::Hole(_)));
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(steps.len(), 5001);
    assert!(steps[0], "the hole first, then the new calls");
}

/// While a reader holds the log (an `explain` run beside `trace`), SQLite cannot truncate it:
/// deleting more calls only makes the log longer. One round then deletes one step's worth and
/// waits for a later round, and never the session's every call.
/// A reader in a transaction that has read: SQLite's log cannot be truncated while it lives.
fn hold_log(path: &std::path::Path) -> rusqlite::Connection {
    let reader = rusqlite::Connection::open(path).unwrap();
    reader.execute_batch("BEGIN").unwrap();
    let _: i64 = reader
        .query_row("SELECT count(*) FROM call_blocks", [], |r| r.get(0))
        .unwrap();
    reader
}

/// Calls the session's blocks still hold.
fn calls_left(store: &Store, session: i64) -> i64 {
    store
        .conn()
        .query_row(
            "SELECT coalesce(sum(calls), 0) FROM call_blocks WHERE session_id = ?1",
            [session],
            |r| r.get(0),
        )
        .unwrap()
}

#[test]
fn a_reader_holding_the_log_does_not_make_eviction_delete_everything() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, session) = new_store(&dir);
    for batch in 0..20u64 {
        store.insert_keyframe(session, batch as i64, &[]).unwrap();
        write(&mut store, session, &varied_calls(5000, batch % 7));
    }
    store.insert_keyframe(session, 20, &[]).unwrap();
    let reader = hold_log(&path);
    let budget = store.footprint().unwrap() * 6 / 10;
    store.enforce_max_size(session, budget).unwrap();
    let left = |store: &Store| calls_left(store, session);
    let held = left(&store);
    assert!(
        held >= 80_000,
        "{held} of 100000 calls left while the log was held"
    );
    // Once the reader lets go, later rounds bring the database under the budget.
    reader.execute_batch("COMMIT").unwrap();
    for _ in 0..3 {
        store.enforce_max_size(session, budget).unwrap();
    }
    assert!(store.footprint().unwrap() <= budget, "under the budget");
    assert!((1..held).contains(&left(&store)), "{}", left(&store));
}

/// The flight test's failure under a loaded CI machine: a job that ended leaves its latest
/// keyframe on the session's latest block, and readers (explain beside the trace) hold the log,
/// so the footprint stays over `--max-db` whatever is deleted; the cut at that keyframe, allowed
/// past the budget, took every call. A log held is not the detail's size: it is no reason to
/// delete the last calls.
#[test]
fn a_held_log_never_makes_eviction_cut_at_the_latest_block() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, session) = new_store(&dir);
    store.insert_keyframe(session, 0, &[]).unwrap();
    for batch in 0..10u64 {
        write(&mut store, session, &varied_calls(5000, batch % 7));
    }
    store.insert_keyframe(session, 10, &[]).unwrap();
    let reader = hold_log(&path);
    let budget = store.footprint().unwrap() * 6 / 10;
    for _ in 0..12 {
        store.enforce_max_size(session, budget).unwrap();
    }
    let left = calls_left(&store, session);
    assert!(left > 0, "every call evicted while a reader held the log");
    reader.execute_batch("COMMIT").unwrap();
}

/// Off-CPU intervals are packed in blocks; explain's loader and `offcpu_intervals` give back
/// every one, with the rows of sessions recorded before version 13, and --max-db deletes and
/// counts them with the calls they lie among.
#[test]
fn off_cpu_intervals_are_packed_and_read_back_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (mut store, session) = new_store(&dir);
    let threads = vec![(100, 101, "worker".to_string())];
    let offset = 1_000;
    let intervals = |batch: u64| -> Vec<crate::decode::OffCpu> {
        (0..300u64)
            .map(|i| {
                let off = batch * 1_000_000_000 + 10_000 + i * 3_000;
                crate::decode::OffCpu {
                    pid: 100,
                    tid: 101 + (i % 3) as u32,
                    off_mono_ns: off,
                    on_mono_ns: off + 1_000 + i % 7,
                    wakeup_mono_ns: (i % 2 == 0).then_some(off + 900),
                    preempted: i % 2 == 1,
                }
            })
            .collect()
    };
    for batch in 0..4u64 {
        store.insert_keyframe(session, batch as i64, &[]).unwrap();
        let mut calls = varied_calls(2000, batch);
        for c in &mut calls {
            c.ts_mono_ns += batch * 1_000_000_000;
        }
        let off = intervals(batch);
        store
            .write_batch(&Batch {
                session,
                wall_offset_ns: offset,
                calls: &calls,
                threads: &threads,
                processes: &[],
                offcpu: &off,
                messages: &[],
            })
            .unwrap();
    }
    store.insert_keyframe(session, 4, &[]).unwrap();
    // A row as version 12 wrote it.
    store
        .conn()
        .execute(
            "INSERT INTO offcpu (session_id, pid, tid, off_ns, on_ns, wakeup_ns, preempted) VALUES (?1, 100, 109, 5, 6, NULL, 1)",
            [session],
        )
        .unwrap();
    let expected: Vec<crate::model::OffSlice> = (0..4)
        .flat_map(intervals)
        .map(|o| crate::model::OffSlice {
            pid: o.pid,
            tid: o.tid,
            off_ns: o.off_mono_ns as i64 + offset,
            on_ns: o.on_mono_ns as i64 + offset,
            wakeup_ns: o.wakeup_mono_ns.map(|w| w as i64 + offset),
            preempted: o.preempted,
        })
        .collect();
    let host = events::host(store.conn(), session, i64::MAX, None).unwrap();
    assert_eq!(host.slices.len(), 1201);
    assert_eq!(host.slices[0].tid, 109, "the old row first");
    assert_eq!(host.slices[1..], expected[..]);
    // Only those begun by the time asked, of the process asked.
    let to = expected[450].off_ns;
    assert_eq!(
        events::host(store.conn(), session, to, Some(100))
            .unwrap()
            .slices
            .len(),
        452
    );
    assert!(events::host(store.conn(), session, i64::MAX, Some(7))
        .unwrap()
        .slices
        .is_empty());
    let sql: Vec<(i64, i64, Option<i64>, i64)> = {
        let mut stmt = store
            .conn()
            .prepare("SELECT tid, on_ns, wakeup_ns, preempted FROM offcpu_intervals WHERE session_id = ?1")
            .unwrap();
        let rows = stmt
            .query_map([session], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
            })
            .unwrap();
        rows.collect::<rusqlite::Result<_>>().unwrap()
    };
    assert_eq!(sql.len(), 1201);
    let s = &expected[7];
    assert_eq!(
        sql[7],
        (
            i64::from(s.tid),
            s.on_ns,
            s.wakeup_ns,
            i64::from(s.preempted)
        )
    );
    assert_eq!(sql[1200], (109, 6, None, 1), "the old row last");
    let packed_bytes: i64 = store
        .conn()
        .query_row("SELECT sum(length(data)) FROM offcpu_blocks", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert!(packed_bytes < 1200 * 10, "{packed_bytes} bytes");
    // Eviction takes the oldest batches' intervals with their calls, and counts them.
    store
        .conn()
        .execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
        .unwrap();
    let budget = store.footprint().unwrap() * 6 / 10;
    store.enforce_max_size(session, budget).unwrap();
    let (evicted, left): (i64, i64) = store
        .conn()
        .query_row(
            "SELECT evicted_offcpu, (SELECT count(*) FROM offcpu_intervals WHERE session_id = ?1) FROM sessions WHERE id = ?1",
            [session],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert!(evicted >= 300, "{evicted}");
    assert_eq!(evicted + left, 1201);
    drop(store);
    let reopened = Store::open(&path, Access::ReadOnly).unwrap();
    assert_eq!(
        events::host(reopened.conn(), session, i64::MAX, None)
            .unwrap()
            .slices
            .len() as i64,
        left
    );
}

/// A damaged off-CPU block is refused by name, by explain's loader and by SQL, not misread.
#[test]
fn a_damaged_off_cpu_block_is_named_not_misread() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, session) = new_store(&dir);
    let off: Vec<crate::decode::OffCpu> = (0..50u64)
        .map(|i| crate::decode::OffCpu {
            pid: 100,
            tid: 101,
            off_mono_ns: 1_000 + i * 100,
            on_mono_ns: 1_050 + i * 100,
            wakeup_mono_ns: None,
            preempted: true,
        })
        .collect();
    store
        .write_batch(&Batch {
            session,
            wall_offset_ns: 0,
            calls: &[],
            threads: &[],
            processes: &[],
            offcpu: &off,
            messages: &[],
        })
        .unwrap();
    let id: i64 = store
        .conn()
        .query_row("SELECT id FROM offcpu_blocks", [], |r| r.get(0))
        .unwrap();
    store
        .conn()
        .execute("UPDATE offcpu_blocks SET data = substr(data, 1, 30)", [])
        .unwrap();
    let err = events::host(store.conn(), session, i64::MAX, None).unwrap_err();
    assert_eq!(
        format!("{err:#}"),
        format!("off-CPU block {id} is damaged: ends inside record 4")
    );
    let sql = store
        .conn()
        .query_row("SELECT count(*) FROM offcpu_intervals", [], |r| {
            r.get::<_, i64>(0)
        })
        .unwrap_err();
    assert!(
        sql.to_string()
            .contains(&format!("off-CPU block {id} is damaged")),
        "{sql}"
    );
}

/// A version 12 database (no `offcpu_blocks`) is read as it is: its `offcpu` rows are the host
/// context, for explain and through `offcpu_intervals`.
#[test]
fn a_version_12_database_reads_its_off_cpu_rows() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let (store, session) = new_store(&dir);
    store
        .conn()
        .execute_batch(&format!(
            "INSERT INTO offcpu (session_id, pid, tid, off_ns, on_ns, wakeup_ns, preempted)
               VALUES ({session}, 100, 101, 10, 20, 15, 0), ({session}, 100, 102, 30, 40, NULL, 1);
             DROP TABLE offcpu_blocks;
             PRAGMA user_version = 12;"
        ))
        .unwrap();
    drop(store);
    let old = Store::open(&path, Access::ReadOnly).unwrap();
    let host = events::host(old.conn(), session, i64::MAX, None).unwrap();
    assert_eq!(
        host.slices
            .iter()
            .map(|s| (s.tid, s.on_ns, s.wakeup_ns, s.preempted))
            .collect::<Vec<_>>(),
        [(101, 20, Some(15), false), (102, 40, None, true)]
    );
    let n: i64 = old
        .conn()
        .query_row(
            "SELECT count(*) FROM offcpu_intervals WHERE session_id = ?1 AND block_id IS NULL",
            [session],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(n, 2);
}

/// When the only keyframe to cut at is at the latest block, eviction under the budget leaves
/// the calls (cutting there would leave the session none to explain); past the budget itself
/// it cuts, as the bound requires.
#[test]
fn eviction_under_the_budget_never_leaves_the_session_without_a_call() {
    let dir = tempfile::tempdir().unwrap();
    let (mut store, session) = new_store(&dir);
    for batch in 0..3u64 {
        write(&mut store, session, &varied_calls(5000, batch));
    }
    store.insert_keyframe(session, 3, &[]).unwrap();
    store
        .conn()
        .execute_batch("PRAGMA wal_checkpoint(TRUNCATE)")
        .unwrap();
    let left = |store: &Store| -> i64 {
        store
            .conn()
            .query_row("SELECT count(*) FROM call_blocks", [], |r| r.get(0))
            .unwrap()
    };
    let used = store.footprint().unwrap();
    store.enforce_max_size(session, used * 100 / 90).unwrap();
    assert_eq!(left(&store), 3, "at 90 % of the budget every call stays");
    store.enforce_max_size(session, used * 9 / 10).unwrap();
    assert_eq!(left(&store), 0, "past the budget, the bound holds");
}
