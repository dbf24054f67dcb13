//! Fuzzing every decoder of untrusted bytes: ring records, call blocks, off-CPU blocks, CPython line tables,
//! /proc/PID/maps lines, USDT notes and argument specs, the simulated runtime's log, PyTorch's
//! memory snapshots (pickles). Each gets
//! random inputs and mutations of valid ones; none may panic (a decoder's answer to garbage is
//! an error or nothing). The quick run is part of every test run; for minutes:
//!
//! ```sh
//! TRACER_FUZZ_SECS=300 cargo test --release -p tracer-cli --lib fuzz -- --ignored --nocapture
//! ```
//!
//! A crash found is kept below as a regression input.

use std::time::{Duration, Instant};

use tracer_common::{CallEvent, EventHeader, Op};

use crate::{
    decode,
    store::{blocks, offcpu_blocks},
};

/// xorshift64*: deterministic, so a failing seed reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }

    /// `seed` with a few bytes flipped, inserted, removed or overwritten with extremes.
    fn mutate(&mut self, seed: &[u8]) -> Vec<u8> {
        let mut v = seed.to_vec();
        for _ in 0..1 + self.below(4) {
            let at = self.below(v.len() + 1);
            match self.below(5) {
                0 if at < v.len() => v[at] ^= 1 << self.below(8),
                1 => v.insert(at, self.next() as u8),
                2 if at < v.len() => {
                    v.remove(at);
                }
                3 if at < v.len() => v[at] = [0x00, 0xff, 0x7f, 0x80][self.below(4)],
                _ => v.truncate(at),
            }
        }
        v
    }
}

fn record_seeds() -> Vec<Vec<u8>> {
    let call_event = CallEvent {
        header: EventHeader {
            kind: 1,
            len: CallEvent::LEN,
            ts_ns: 1_000,
            pid: 7,
            tid: 8,
        },
        op: Op::CudaMalloc as u32,
        device: 0,
        size: 4096,
        ptr: 0x7f00_0000,
        ..Default::default()
    };
    let call = decode::pod_bytes(&call_event).to_vec();
    let mut headers = Vec::new();
    for kind in 0..8u32 {
        for len in [0u32, 24, 32, 104, 200, 4096] {
            let mut h = vec![0u8; len.max(24) as usize];
            h[..4].copy_from_slice(&kind.to_le_bytes());
            h[4..8].copy_from_slice(&len.to_le_bytes());
            headers.push(h);
        }
    }
    // A call with two Python frames, its native stack by id (only the frames read are sent).
    let mut py = tracer_common::stack::CallPyEvent {
        call: call_event,
        py: tracer_common::PyStack {
            status: tracer_common::stack::py_status::OK,
            depth: 2,
            tstate: 0x5000,
            frames: [tracer_common::PyFrame::default(); tracer_common::stack::MAX_PY_FRAMES],
        },
    };
    py.call.header.kind = tracer_common::EventKind::CallPy as u32;
    py.call.header.len = tracer_common::stack::CallPyEvent::len_for(2);
    py.call.stack_id = 3;
    headers.push(decode::pod_bytes(&py)[..py.call.header.len as usize].to_vec());
    // A stage's events back to back, as the return program writes them.
    headers.push(call.repeat(3));
    headers.push(call);
    headers
}

fn block_seed() -> Vec<u8> {
    let calls: Vec<decode::Call> = (0..50u64)
        .map(|i| decode::Call {
            ts_mono_ns: 1_000 + i * 10,
            pid: 100 + (i % 3) as u32,
            tid: 200 + (i % 5) as u32,
            op: Op::ALL[(i as usize) % Op::ALL.len()],
            device: (i % 2 == 0).then_some(0),
            ret: 0,
            duration_ns: 500,
            size: Some(i << 12),
            ptr: Some(0x7f00_0000 + i * 4096),
            aux0: i,
            aux1: 0,
            flags: 0,
            comm: String::new(),
            site: None,
            stack: (i % 4 == 0).then_some(i as i64 + 1),
        })
        .collect();
    blocks::encode(&calls, 0).data
}

/// An off-CPU block of 40 varied intervals.
fn offcpu_seed() -> Vec<u8> {
    let intervals: Vec<decode::OffCpu> = (0..40u64)
        .map(|i| decode::OffCpu {
            pid: 100 + (i % 3) as u32,
            tid: 200 + (i % 5) as u32,
            off_mono_ns: 1_000 + i * 700,
            on_mono_ns: 1_500 + i * 700 + (i % 4) * 90,
            wakeup_mono_ns: (i % 3 != 0).then_some(1_200 + i * 700),
            preempted: i % 3 == 0,
        })
        .collect();
    offcpu_blocks::encode(&intervals, 0).data
}

/// A PERF_RECORD_MMAP2 of the side band, as the kernel writes it (time last).
fn perf_seed() -> Vec<u8> {
    let mut b = Vec::new();
    let name = b"/usr/lib/libpython3.12.so.1.0\0\0\0";
    let size = (8 + 64 + name.len() + 8) as u16;
    b.extend_from_slice(&10u32.to_ne_bytes());
    b.extend_from_slice(&0u16.to_ne_bytes());
    b.extend_from_slice(&size.to_ne_bytes());
    for v in [7u32, 7] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    for v in [0x7f00_0000u64, 0x2000, 0x1000] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    for v in [8u32, 1] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    for v in [42u64, 0] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    for v in [5u32, 2] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    b.extend_from_slice(name);
    b.extend_from_slice(&99u64.to_ne_bytes());
    b
}

const MAPS_LINE: &str = "7f00a000-7f00c000 r-xp 00002000 08:01 1234   /usr/lib/libcudart.so.12";
const SIMLOG_LINE: &str = "1000 250 7 8 cudaMalloc 0 0 4096 139637976727552 - -";
const SIMLOG_OOM_LINE: &str =
    "1795326684373497239 0 22534 22536 pytorch:oom 0 0 - - - - CUDA out of memory. Tried to allocate 2.00 MiB.";

/// One input to every decoder; a panic is the failure.
fn feed(rng: &mut Rng, blocks: [&[u8]; 2], records: &[Vec<u8>], elf: &[u8]) {
    let [block, offcpu] = blocks;
    let random = rng.bytes(256);
    let pick = rng.below(records.len());
    let record = rng.mutate(&records[pick]);
    for bytes in [&random, &record] {
        let _ = decode::decode(bytes);
        let _ = decode::decode_all(bytes).count();
        // What frame says of a record, decode agrees with: a record of that length, made then
        // (or one whose fields are bad, which only decode reads).
        if let Some((len, sent)) = decode::frame(bytes) {
            match decode::decode(&bytes[..len]) {
                Ok(record) => assert_eq!(record.sent_ns(), sent),
                Err(e) => assert!(matches!(e, decode::DecodeError::BadField { .. }), "{e}"),
            }
        }
    }
    // Spans anywhere, as a reader with a bug could hand over: each event decodes or fails.
    let spans = (0..rng.below(8))
        .map(|_| (rng.below(300) as u32, rng.below(300) as u32))
        .collect::<Vec<_>>();
    let n = spans.len();
    let events = decode::EventBytes::new(record.clone(), spans);
    assert_eq!(events.decode().count(), n);
    let b = rng.mutate(block);
    let _ = blocks::decode(&b, 50, |_| {});
    let _ = blocks::decode(&random, rng.below(9000), |_| {});
    let o = rng.mutate(offcpu);
    let _ = offcpu_blocks::decode(&o, 40, |_| {});
    let _ = offcpu_blocks::decode(&random, rng.below(9000), |_| {});
    let first = rng.next() as i32;
    let offset = rng.next() % 4096;
    let _ = crate::traced::python::linetable::line_from_locations(&random, first, offset);
    let _ = crate::traced::python::linetable::line_from_linetable_310(&random, first, offset);
    let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
    let _ = crate::traced::maps::parse_line(&text(rng.mutate(MAPS_LINE.as_bytes())));
    let _ = crate::traced::maps::parse_line(&text(random.clone()));
    let _ = crate::decode::simlog::parse_line(&text(rng.mutate(SIMLOG_LINE.as_bytes())));
    let _ = crate::decode::simlog::parse_line(&text(rng.mutate(SIMLOG_OOM_LINE.as_bytes())));
    let _ = crate::probe::usdt::parse_arg(&text(rng.mutate(b"-8@-56(%rbp)")));
    let _ = crate::probe::usdt::parse_arg(&text(random));
    let _ = crate::probe::usdt::sites_of(rng.mutate(elf).as_slice());
    let _ = crate::traced::mappings::parse_record(&rng.mutate(&perf_seed()));
    for pickle in [rng.mutate(SNAPSHOT_SEED), random_pickle(rng)] {
        if let Ok(p) = decode::pickle::decode(&pickle) {
            let _ = decode::memory_snapshot::read(&p);
        }
    }
}

/// A PyTorch memory snapshot as Python pickles it.
const SNAPSHOT_SEED: &[u8] = include_bytes!("../testdata/tiny_snapshot.pickle");

/// Opcodes of the pickle machine in random order, with random arguments: stack and memo
/// misuse rather than byte noise.
fn random_pickle(rng: &mut Rng) -> Vec<u8> {
    const OPS: &[u8] = b"(012N\x88\x89JKM\x8a\x8c]}\x29lt\x85\x86\x87aesud\x94qhjX.";
    let mut v = vec![0x80, 4];
    for _ in 0..rng.below(40) {
        v.push(OPS[rng.below(OPS.len())]);
        for _ in 0..rng.below(3) {
            v.push(rng.next() as u8);
        }
    }
    v.push(b'.');
    v
}

/// Runs `feed` until `budget` passes or `rounds` inputs, whichever first; the inputs made.
fn run(seed: u64, rounds: u64, budget: Duration) -> u64 {
    let mut rng = Rng(seed | 1);
    let block = block_seed();
    let offcpu = offcpu_seed();
    let records = record_seeds();
    // An ELF with USDT notes to mutate: the tests' own simulated allocator when built, else
    // this test binary (notes or not, its headers are worth mutating).
    let elf = std::fs::read("/proc/self/exe").unwrap_or_default();
    let elf = &elf[..elf.len().min(64 << 10)];
    let started = Instant::now();
    let mut n = 0;
    while n < rounds && started.elapsed() < budget {
        feed(&mut rng, [&block, &offcpu], &records, elf);
        n += 1;
    }
    n
}

#[test]
fn every_decoder_survives_garbage_quick() {
    // The seeds are valid inputs, so that mutations start from what the decoders accept.
    assert!(matches!(
        crate::traced::mappings::parse_record(&perf_seed()),
        Some((
            99,
            crate::traced::mappings::PerfRecord::Mmap2 { pid: 7, .. }
        ))
    ));
    let n = run(0x5eed, 20_000, Duration::from_secs(20));
    assert!(n > 1000, "{n} inputs");
}

#[test]
#[ignore = "minutes of fuzzing: TRACER_FUZZ_SECS=300 cargo test --release --lib fuzz -- --ignored"]
fn every_decoder_survives_garbage_long() {
    let secs = std::env::var("TRACER_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64);
    eprintln!("fuzz seed {seed:#x}");
    let n = run(seed, u64::MAX, Duration::from_secs(secs));
    eprintln!("fuzz: {n} inputs in {secs} s, no decoder panicked");
}

/// Inputs that once crashed a decoder.
#[test]
fn regressions() {
    // A call block whose pid delta overflows i64 (a panic in debug builds before the fix).
    let mut data = vec![0u8]; // presence byte
    data.push(1); // op
    data.push(0); // ts delta
    data.push(0); // duration
    data.extend([0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]); // pid: i64::MAX
    data.push(0); // tid
    data.push(0); // ret
    data.push(0); // presence byte of call 2
    data.push(1);
    data.push(0);
    data.push(0);
    data.extend([0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
    data.push(0);
    data.push(0);
    assert!(blocks::decode(&data, 2, |_| {}).is_err());
    // A row claiming more calls than any block holds.
    assert!(blocks::decode(&[], 1 << 40, |_| {}).is_err());
}
