//! The database schema: a public interface (documented in SCHEMA.md), versioned with
//! `PRAGMA user_version`. Each migration moves the schema one version up; never edit one that
//! has shipped, add another.

/// The schema version this tracer writes. A database with a higher version is refused.
pub const SCHEMA_VERSION: i64 = 15;

/// The oldest version read as it is, without a migration: the versions after it only added
/// a table and columns their readers look for (11: `thread_devices`, `sessions.devices_learned`,
/// `processes.gpus`; 12: `gpu_samples`; 13: `offcpu_blocks`; 14: `sessions.allocator`; 15:
/// `discovery`, `sessions.lib_opens_lost`).
pub const READABLE_FROM: i64 = 10;

/// `MIGRATIONS[n]` takes a database from version n to n + 1.
pub const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE sessions (
    id                INTEGER PRIMARY KEY,
    started_ns        INTEGER NOT NULL,
    ended_ns          INTEGER,
    status            TEXT NOT NULL,
    source            TEXT NOT NULL,
    host              TEXT,
    kernel            TEXT,
    tracer_version    TEXT NOT NULL,
    command           TEXT,
    pid_filter        TEXT,
    libraries         TEXT,
    entries           INTEGER NOT NULL DEFAULT 0,
    submitted         INTEGER NOT NULL DEFAULT 0,
    dropped_ring_full INTEGER NOT NULL DEFAULT 0,
    unmatched_returns INTEGER NOT NULL DEFAULT 0,
    alloc_map_full    INTEGER NOT NULL DEFAULT 0,
    inflight_full     INTEGER NOT NULL DEFAULT 0,
    events_read       INTEGER NOT NULL DEFAULT 0,
    events_stored     INTEGER NOT NULL DEFAULT 0,
    decode_errors     INTEGER NOT NULL DEFAULT 0,
    evicted_events    INTEGER NOT NULL DEFAULT 0,
    note              TEXT
);

CREATE TABLE processes (
    session_id    INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    pid           INTEGER NOT NULL,
    start_time_ns INTEGER,
    first_seen_ns INTEGER NOT NULL,
    comm          TEXT,
    cmdline       TEXT,
    exe           TEXT,
    cgroup        TEXT,
    PRIMARY KEY (session_id, pid)
);

CREATE TABLE threads (
    session_id INTEGER NOT NULL,
    pid        INTEGER NOT NULL,
    tid        INTEGER NOT NULL,
    comm       TEXT,
    PRIMARY KEY (session_id, pid, tid)
) WITHOUT ROWID;

CREATE TABLE ops (
    id      INTEGER PRIMARY KEY,
    name    TEXT NOT NULL UNIQUE,
    library TEXT NOT NULL,
    class   TEXT NOT NULL
);

CREATE TABLE calls (
    id          INTEGER PRIMARY KEY,
    session_id  INTEGER NOT NULL,
    ts_ns       INTEGER NOT NULL,
    pid         INTEGER NOT NULL,
    tid         INTEGER NOT NULL,
    op_id       INTEGER NOT NULL,
    device      INTEGER,
    size        INTEGER,
    ptr         INTEGER,
    ret         INTEGER NOT NULL,
    duration_ns INTEGER NOT NULL,
    aux0        INTEGER,
    aux1        INTEGER,
    flags       INTEGER NOT NULL,
    stack_id    INTEGER
);
CREATE INDEX calls_session_ts ON calls(session_id, ts_ns);

CREATE VIEW events AS
SELECT c.session_id, c.ts_ns, c.pid, c.tid, t.comm, o.name AS op, c.device, c.size, c.ptr,
       c.ret, c.duration_ns, c.stack_id,
       o.library, o.class,
       CASE WHEN o.class = 'meminfo' THEN c.aux0 END AS mem_free,
       CASE WHEN o.class = 'meminfo' THEN c.aux1 END AS mem_total,
       c.aux0, c.aux1, c.flags, c.id AS event_id
FROM calls c
JOIN ops o ON o.id = c.op_id
LEFT JOIN threads t ON t.session_id = c.session_id AND t.pid = c.pid AND t.tid = c.tid;
"#,
    // 2: host context - when traced threads were off the CPU.
    r#"
CREATE TABLE offcpu (
    session_id INTEGER NOT NULL,
    pid        INTEGER NOT NULL,
    tid        INTEGER NOT NULL,
    off_ns     INTEGER NOT NULL,
    on_ns      INTEGER NOT NULL,
    wakeup_ns  INTEGER,
    preempted  INTEGER NOT NULL
);
CREATE INDEX offcpu_session_tid ON offcpu(session_id, tid, off_ns);
ALTER TABLE sessions ADD COLUMN offcpu_submitted INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN offcpu_dropped INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN host_context TEXT;
"#,
    // 3: call sites (--stack) - calls.stack_id points at stacks.id.
    r#"
CREATE TABLE stacks (
    id           INTEGER PRIMARY KEY,
    session_id   INTEGER NOT NULL,
    pid          INTEGER NOT NULL,
    native_depth INTEGER NOT NULL,
    python       TEXT NOT NULL
);
CREATE INDEX stacks_session ON stacks(session_id);
CREATE TABLE stack_frames (
    stack_id INTEGER NOT NULL,
    idx      INTEGER NOT NULL,
    kind     TEXT NOT NULL,
    function TEXT,
    file     TEXT,
    line     INTEGER,
    module   TEXT,
    address  INTEGER,
    PRIMARY KEY (stack_id, idx)
) WITHOUT ROWID;
"#,
    // 4: call blocks - a compact copy of each session's calls that explain reads (store/blocks.rs).
    r#"
CREATE TABLE call_blocks (
    id         INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL,
    first_call INTEGER NOT NULL,
    last_call  INTEGER NOT NULL,
    calls      INTEGER NOT NULL,
    min_ts_ns  INTEGER NOT NULL,
    max_ts_ns  INTEGER NOT NULL,
    format     INTEGER NOT NULL,
    data       BLOB NOT NULL
);
CREATE INDEX call_blocks_session ON call_blocks(session_id, id);
ALTER TABLE sessions ADD COLUMN call_blocks INTEGER NOT NULL DEFAULT 0;
"#,
    // 5: texts the traced programs produced at a probe (PyTorch's out-of-memory message).
    r#"
CREATE TABLE messages (
    session_id INTEGER NOT NULL,
    ts_ns      INTEGER NOT NULL,
    pid        INTEGER NOT NULL,
    tid        INTEGER NOT NULL,
    op_id      INTEGER NOT NULL,
    text       TEXT NOT NULL,
    truncated  INTEGER NOT NULL
);
CREATE INDEX messages_session ON messages(session_id, ts_ns);
ALTER TABLE processes ADD COLUMN env TEXT;
"#,
    // 6: the allocator's block events (pytorch:malloc/free) live in call blocks only: `rowless`
    // counts a block's calls that have no `calls` row (read them through `tensor_events`).
    r#"
ALTER TABLE call_blocks ADD COLUMN rowless INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN tail_call_failed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN map_insert_failed INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN calls_abandoned INTEGER NOT NULL DEFAULT 0;
"#,
    // 7: what --stack could not know from a process's first call: calls made before its
    // interpreter was registered, and mapping records the kernel could not hand over.
    r#"
ALTER TABLE sessions ADD COLUMN calls_before_interpreter INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN mappings_lost INTEGER NOT NULL DEFAULT 0;
"#,
    // 8: which tracer process records a session, on which boot: a later trace marks a
    // 'running' session whose tracer is gone (killed, or the node restarted) 'crashed'.
    r#"
ALTER TABLE sessions ADD COLUMN tracer_pid INTEGER;
ALTER TABLE sessions ADD COLUMN boot_id TEXT;
"#,
    // 9: the flight recorder. Keyframes hold each process's state (allocator layout, live
    // allocations, devices, figures) so answers start from them instead of the first event;
    // the whole-run series survives eviction; gaps say what tracer did not see; eviction is
    // counted by kind.
    r#"
CREATE TABLE keyframes (
    id            INTEGER PRIMARY KEY,
    session_id    INTEGER NOT NULL,
    ts_ns         INTEGER NOT NULL,
    through_block INTEGER NOT NULL,
    processes     INTEGER NOT NULL
);
CREATE INDEX keyframes_session ON keyframes(session_id, through_block);
CREATE TABLE keyframe_states (
    keyframe_id   INTEGER NOT NULL,
    pid           INTEGER NOT NULL,
    start_time_ns INTEGER,
    format        INTEGER NOT NULL,
    data          BLOB NOT NULL,
    PRIMARY KEY (keyframe_id, pid)
) WITHOUT ROWID;
CREATE TABLE series (
    session_id      INTEGER NOT NULL,
    pid             INTEGER NOT NULL,
    device          INTEGER NOT NULL,
    start_ns        INTEGER NOT NULL,
    end_ns          INTEGER NOT NULL,
    allocated       INTEGER NOT NULL,
    reserved        INTEGER NOT NULL,
    cached          INTEGER NOT NULL,
    largest_free    INTEGER NOT NULL,
    fragmentation   REAL NOT NULL,
    largest_request INTEGER NOT NULL,
    device_free     INTEGER,
    calls           INTEGER NOT NULL,
    errors          INTEGER NOT NULL,
    failures        INTEGER NOT NULL,
    ooms            INTEGER NOT NULL,
    retries         INTEGER NOT NULL,
    warnings        INTEGER NOT NULL,
    ops             TEXT NOT NULL
);
CREATE INDEX series_session ON series(session_id, pid, start_ns);
CREATE TABLE gaps (
    session_id INTEGER NOT NULL,
    pid        INTEGER NOT NULL,
    from_ns    INTEGER,
    to_ns      INTEGER NOT NULL,
    kind       TEXT NOT NULL,
    detail     TEXT NOT NULL
);
CREATE INDEX gaps_session ON gaps(session_id, pid);
CREATE TABLE holes (
    session_id    INTEGER NOT NULL,
    after_block   INTEGER NOT NULL,
    through_block INTEGER NOT NULL,
    from_ns       INTEGER NOT NULL,
    to_ns         INTEGER NOT NULL,
    calls         INTEGER NOT NULL
);
CREATE INDEX holes_session ON holes(session_id, through_block);
CREATE TABLE kept (
    session_id    INTEGER NOT NULL,
    after_block   INTEGER NOT NULL,
    through_block INTEGER NOT NULL,
    from_ns       INTEGER NOT NULL,
    to_ns         INTEGER NOT NULL,
    reason        TEXT NOT NULL
);
CREATE INDEX kept_session ON kept(session_id, through_block);
ALTER TABLE sessions ADD COLUMN evicted_calls INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN evicted_block_events INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN evicted_offcpu INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN evicted_messages INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN evicted_until_ns INTEGER;
ALTER TABLE sessions ADD COLUMN restored_from INTEGER;
"#,
    // 10: events handed over after events made later than them.
    r#"
ALTER TABLE sessions ADD COLUMN events_late INTEGER NOT NULL DEFAULT 0;
"#,
    // 11: a thread's device learned after its first calls were stored (model/devices.rs).
    r#"
CREATE TABLE thread_devices (
    session_id INTEGER NOT NULL,
    pid        INTEGER NOT NULL,
    tid        INTEGER NOT NULL,
    device     INTEGER NOT NULL,
    from_ns    INTEGER NOT NULL,
    to_ns      INTEGER NOT NULL,
    how        TEXT NOT NULL
);
CREATE INDEX thread_devices_session ON thread_devices(session_id, pid, tid);
ALTER TABLE sessions ADD COLUMN devices_learned INTEGER NOT NULL DEFAULT 0;
ALTER TABLE processes ADD COLUMN gpus TEXT;
"#,
    r#"
CREATE TABLE gpu_samples (
    session_id INTEGER NOT NULL,
    ts_ns      INTEGER NOT NULL,
    gpu        TEXT NOT NULL,
    total      INTEGER NOT NULL,
    used       INTEGER NOT NULL,
    processes  TEXT NOT NULL
);
CREATE INDEX gpu_samples_session ON gpu_samples(session_id, ts_ns);
"#,
    // 13: off-CPU intervals packed in blocks (offcpu_blocks.rs); `offcpu` keeps older sessions'.
    r#"
CREATE TABLE offcpu_blocks (
    id         INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL,
    format     INTEGER NOT NULL,
    intervals  INTEGER NOT NULL,
    min_off_ns INTEGER NOT NULL,
    max_on_ns  INTEGER NOT NULL,
    data       BLOB NOT NULL
);
CREATE INDEX offcpu_blocks_session ON offcpu_blocks(session_id, min_off_ns);
"#,
    // 14: `--allocator`'s mode; its armings are marks in the calls (ops 35 and 36).
    r#"
ALTER TABLE sessions ADD COLUMN allocator TEXT;
"#,
    // 15: each process that opened a CUDA library, and whether tracer saw it from its first
    // call (record/discovery.rs).
    r#"
CREATE TABLE discovery (
    session_id INTEGER NOT NULL,
    pid        INTEGER NOT NULL,
    comm       TEXT,
    library    TEXT NOT NULL,
    opened_ns  INTEGER NOT NULL,
    probed_ns  INTEGER,
    held_us    INTEGER,
    outcome    TEXT NOT NULL,
    why        TEXT
);
CREATE INDEX discovery_session ON discovery(session_id, pid);
ALTER TABLE sessions ADD COLUMN lib_opens_lost INTEGER NOT NULL DEFAULT 0;
"#,
];
