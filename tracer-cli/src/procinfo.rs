//! What /proc says about a process, read once when its first event arrives.

use std::path::Path;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessInfo {
    pub pid: u32,
    /// Wall-clock start time (from /proc/PID/stat and the boot time).
    pub start_time_ns: Option<i64>,
    pub first_seen_ns: i64,
    pub comm: Option<String>,
    pub cmdline: Option<String>,
    pub exe: Option<String>,
    pub cgroup: Option<String>,
}

/// Reads /proc/PID; a process that has already exited gives what the event itself carried.
pub fn read(
    pid: u32,
    first_seen_ns: i64,
    fallback_comm: &str,
    boot_time_ns: Option<i64>,
) -> ProcessInfo {
    let dir = Path::new("/proc").join(pid.to_string());
    let comm = std::fs::read_to_string(dir.join("comm"))
        .map(|s| s.trim_end().to_owned())
        .unwrap_or_else(|_| fallback_comm.to_owned());
    let cmdline = std::fs::read(dir.join("cmdline"))
        .ok()
        .filter(|b| !b.is_empty())
        .map(|b| {
            let parts: Vec<String> = b
                .split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect();
            parts.join(" ")
        });
    let exe = std::fs::read_link(dir.join("exe"))
        .ok()
        .map(|p| p.display().to_string());
    let cgroup = std::fs::read_to_string(dir.join("cgroup"))
        .ok()
        .map(|s| s.trim_end().to_owned());
    let start_time_ns = std::fs::read_to_string(dir.join("stat"))
        .ok()
        .and_then(|s| start_ticks(&s))
        .zip(boot_time_ns)
        .map(|(ticks, boot)| boot + (ticks as i64) * (1_000_000_000 / clock_ticks()));
    ProcessInfo {
        pid,
        start_time_ns,
        first_seen_ns,
        comm: Some(comm),
        cmdline,
        exe,
        cgroup,
    }
}

/// Field 22 of /proc/PID/stat (after the parenthesised comm, which may hold spaces).
fn start_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn clock_ticks() -> i64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t
    } else {
        100
    }
}

/// Wall-clock boot time in ns (btime of /proc/stat).
pub fn boot_time_ns() -> Option<i64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("btime "))?;
    let secs: i64 = line[6..].trim().parse().ok()?;
    Some(secs * 1_000_000_000)
}

/// The name of thread `tid` of process `pid`, while it runs.
pub fn thread_comm(pid: u32, tid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_owned())
}

pub fn exists(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

#[cfg(test)]
mod tests {
    #[test]
    fn start_ticks_skips_comm_with_spaces() {
        let stat =
            "123 (my (odd) name) S 1 123 123 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";
        assert_eq!(super::start_ticks(stat), Some(98765));
    }

    #[test]
    fn reads_own_thread_name() {
        let me = std::process::id();
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as u32;
        let name = super::thread_comm(me, tid).unwrap();
        assert!(!name.is_empty());
        assert_eq!(super::thread_comm(me, u32::MAX), None);
    }

    #[test]
    fn reads_own_process() {
        let me = std::process::id();
        let info = super::read(me, 0, "x", super::boot_time_ns());
        assert_eq!(info.pid, me);
        assert!(info.cmdline.is_some());
        assert!(info.start_time_ns.unwrap() > 1_600_000_000_000_000_000);
    }
}
