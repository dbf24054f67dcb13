//! `--allocator auto` at the level of the probes: arming a process raises its sites'
//! semaphores there and nowhere else; arming and disarming many times over takes no table's
//! slots for good and leaves no descriptor.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    time::Instant,
};

use tracer_cli::{
    model::arming::Mode,
    probe::{
        attach::{LoadOptions, Probes},
        discover,
    },
    traced::semaphore,
};

use crate::common::*;

/// This process's descriptors of the kinds arming could leave open: BPF objects, perf events
/// and files under /proc (other tests' threads open pipes and files meanwhile).
fn open_descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter(|target| {
            let t = target.to_string_lossy();
            t.starts_with("anon_inode:") || t.starts_with("/proc/")
        })
        .count()
}

/// A process mapping the library, doing nothing.
fn holder_process(lib: &std::path::Path) -> std::process::Child {
    let mut holder = Command::new("python3")
        .args([
            "-c",
            "import ctypes, sys, time\nctypes.CDLL(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(600)\n",
        ])
        .arg(lib)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(holder.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    holder
}

#[test]
fn arming_raises_the_semaphores_of_one_process_and_ten_thousand_cycles_exhaust_no_table() {
    let Some(fx) = Fixture::new() else { return };
    let lib = PathBuf::from(fx.lib("libsimtorch.so"));
    let mut holder = holder_process(&lib);
    let mut other = holder_process(&lib);
    let pid = holder.id();
    let mut probes = Probes::load(LoadOptions {
        ring_bytes: 1 << 16,
        wakeup_bytes: 1,
        floor: 0,
        stack: false,
        host_context: false,
        allocator: Mode::Auto,
    })
    .unwrap();
    for candidate in discover::explicit_libraries(std::slice::from_ref(&lib)).unwrap() {
        probes.attach(&candidate, None).unwrap();
    }
    let site = tracer_cli::probe::usdt::read_sites(&lib).unwrap()[0].clone();
    let file = std::fs::metadata(&lib).unwrap();
    let semaphore_of = |pid: u32| {
        use std::os::unix::fs::MetadataExt as _;
        let maps = tracer_cli::traced::maps::read(pid).unwrap();
        let addr =
            semaphore::address(pid, &maps, (file.dev(), file.ino()), site.semaphore).unwrap();
        semaphore::Memory::open(pid)
            .unwrap()
            .adjust(addr, 0)
            .unwrap()
    };
    let semaphore = || semaphore_of(pid);
    assert_eq!(semaphore(), 0, "not armed: the sites do not run");
    let before = open_descriptors();
    let cycles = 10_000;
    let t = Instant::now();
    for i in 0..cycles {
        let raised = probes
            .arm(pid)
            .unwrap_or_else(|e| panic!("cycle {i}: {e:#}"));
        assert_eq!(raised, 2, "malloc's and free's semaphores, together");
        if i == 0 {
            assert_eq!(semaphore(), 1, "armed in this process");
            assert_eq!(semaphore_of(other.id()), 0, "and in no other");
        }
        assert!(probes.disarm(pid));
    }
    let per_cycle = t.elapsed() / cycles;
    // Each site keeps its one slot of the plan map however often it is armed; nothing else
    // was made or left open.
    assert_eq!(probes.armed_now(), (0, 2));
    assert_eq!(open_descriptors(), before);
    assert_eq!(semaphore(), 0, "lowered again");
    eprintln!("one arm and disarm cycle: {per_cycle:?}");
    for p in [&mut holder, &mut other] {
        let _ = p.kill();
        let _ = p.wait();
    }
}

/// A share that is no share of a GPU is refused before anything starts, naming the option.
#[test]
fn an_arm_share_that_is_no_share_is_refused_naming_it() {
    for bad in ["0", "1.5", "most"] {
        let out = Command::new(TRACER)
            .args(["trace", "--allocator", "auto", "--arm-share", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--arm-share") && err.contains("not a share of the GPU"),
            "{err}"
        );
    }
}
