"""Writes N synthetic calls (a cudaMalloc/cudaFree stream from four threads, latency creeping up)
into a new session of an existing tracer database, for `cargo xtask bench-explain`."""
import sqlite3, sys, random, time
db, n = sys.argv[1], int(sys.argv[2])
c = sqlite3.connect(db)
c.execute("PRAGMA journal_mode=WAL"); c.execute("PRAGMA synchronous=OFF")
cur = c.execute("INSERT INTO sessions (started_ns, status, source, tracer_version) VALUES (1, 'complete', 'ebpf', 'bench')")
sid = cur.lastrowid
rng = random.Random(1)
t0 = 1_795_000_000_000_000_000
def rows():
    live = []
    ts = t0
    for i in range(n):
        ts += 20_000
        tid = 1000 + (i % 4)
        if live and (len(live) > 5000 or rng.random() < 0.5):
            ptr, size = live.pop(rng.randrange(len(live)))
            yield (sid, ts, 100, tid, 1, 0, size, ptr, 0, 5000, None, None, 3)
        else:
            size = rng.choice([2, 20, 40]) << 20
            ptr = 0x7f0000000000 + i * 4096
            live.append((ptr, size))
            yield (sid, ts, 100, tid, 0, 0, size, ptr, 0, 60000 + (i * 50 // n) * 1000, None, None, 3)
start = time.time()
c.executemany("INSERT INTO calls (session_id, ts_ns, pid, tid, op_id, device, size, ptr, ret, duration_ns, aux0, aux1, flags) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows())
c.commit()
print("session", sid, "rows", n, "in", round(time.time() - start, 1), "s")
