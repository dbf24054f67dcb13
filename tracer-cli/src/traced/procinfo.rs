//! What /proc says about a process, read once when its first event arrives.

use std::path::Path;

use crate::model::{ProcessInfo, VisibleGpus, KEPT_ENV, NVIDIA_MAJOR};

/// Bytes of /proc/PID/environ read at most (the variables kept come early in practice).
const ENVIRON_LIMIT: u64 = 1 << 20;

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
    let start_time_ns = start_time(&dir, boot_time_ns);
    ProcessInfo {
        pid,
        start_time_ns,
        first_seen_ns,
        comm: Some(comm),
        cmdline,
        exe,
        cgroup,
        env: kept_env(&dir),
        gpus: serde_json::to_string(&visible_gpus(&dir)).ok(),
        owner: owner(&dir),
    }
}

/// The real user and group ids of process `pid`, while it runs.
pub fn owner_of(pid: u32) -> Option<(u32, u32)> {
    owner(&Path::new("/proc").join(pid.to_string()))
}

/// The process's real user and group ids (/proc/PID/status).
fn owner(dir: &Path) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let real = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<u32>().ok())
    };
    Some((real("Uid:")?, real("Gid:")?))
}

/// The NVIDIA GPUs the process's root shows it: character devices of major 195 under its
/// /dev, by their host minor numbers (a file that is not such a device, or a link, counts for
/// nothing: never followed), and its mount namespace.
fn visible_gpus(dir: &Path) -> VisibleGpus {
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _};
    // Its /dev, opened without following a link there: an absolute link in its root would
    // resolve in tracer's.
    let dev = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir.join("root/dev"))
        .ok();
    let listed = dev.as_ref().map(|f| {
        use std::os::fd::AsRawFd as _;
        Path::new("/proc/self/fd").join(f.as_raw_fd().to_string())
    });
    let mut minors: Vec<u32> = listed
        .iter()
        .flat_map(std::fs::read_dir)
        .flatten()
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("nvidia")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|entry| std::fs::symlink_metadata(entry.path()).ok())
        .filter(|m| m.file_type().is_char_device() && libc::major(m.rdev()) == NVIDIA_MAJOR)
        .map(|m| libc::minor(m.rdev()))
        .collect();
    minors.sort_unstable();
    minors.dedup();
    let mount_ns = std::fs::read_link(dir.join("ns/mnt")).ok().and_then(|l| {
        let l = l.to_string_lossy().into_owned();
        l.strip_prefix("mnt:[")?.strip_suffix(']')?.parse().ok()
    });
    VisibleGpus { minors, mount_ns }
}

/// When the process started (wall clock, ns; the same figure on every read, which names the
/// process apart from another that later reuses its pid).
pub fn start_time_ns(pid: u32) -> Option<i64> {
    start_time(&Path::new("/proc").join(pid.to_string()), boot_time_ns())
}

fn start_time(dir: &Path, boot_time_ns: Option<i64>) -> Option<i64> {
    std::fs::read_to_string(dir.join("stat"))
        .ok()
        .and_then(|s| start_ticks(&s))
        .zip(boot_time_ns)
        .map(|(ticks, boot)| boot + (ticks as i64) * (1_000_000_000 / clock_ticks()))
}

/// The kept variables of the process's environment, as a JSON object (None when it has none
/// of them or cannot be read). A bounded read: the environment is the process's to make huge.
fn kept_env(dir: &Path) -> Option<String> {
    use std::io::Read as _;
    let mut bytes = Vec::new();
    std::fs::File::open(dir.join("environ"))
        .ok()?
        .take(ENVIRON_LIMIT)
        .read_to_end(&mut bytes)
        .ok()?;
    let kept = parse_kept_env(&bytes);
    (!kept.is_empty()).then(|| serde_json::to_string(&kept).unwrap_or_default())
}

/// The kept variables of a NUL-separated environment block.
pub fn parse_kept_env(block: &[u8]) -> std::collections::BTreeMap<String, String> {
    block
        .split(|&b| b == 0)
        .filter_map(|kv| {
            let kv = std::str::from_utf8(kv).ok()?;
            let (k, v) = kv.split_once('=')?;
            KEPT_ENV.contains(&k).then(|| (k.to_owned(), v.to_owned()))
        })
        .collect()
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

    #[test]
    fn only_the_kept_variables_are_read() {
        let block = b"HOME=/root\0PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\0RANK=3\0SECRET_TOKEN=x\0WORLD_SIZE=8\0";
        let kept = super::parse_kept_env(block);
        assert_eq!(kept.len(), 3);
        assert_eq!(kept["PYTORCH_CUDA_ALLOC_CONF"], "expandable_segments:True");
        assert_eq!(kept["RANK"], "3");
        assert!(!kept.contains_key("SECRET_TOKEN"));
    }
}

/// The threads of `pid` and of all its descendant processes (from /proc/PID/task/TID/children),
/// Processes that exit while being read are skipped.
/// Whether a thread still runs (not exited, not a zombie).
pub fn thread_alive(tid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{tid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s.rsplit_once(')')?.1.split_whitespace().next()?.to_owned();
            Some(state != "Z" && state != "X")
        })
        .unwrap_or(false)
}

pub fn thread_tree(pid: u32) -> Vec<u32> {
    let mut tids = Vec::new();
    let mut pending = vec![pid];
    let mut seen = std::collections::HashSet::new();
    while let Some(p) = pending.pop() {
        if !seen.insert(p) || seen.len() > 4096 {
            continue;
        }
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Some(tid) = task
                .file_name()
                .to_str()
                .and_then(|t| t.parse::<u32>().ok())
            else {
                continue;
            };
            tids.push(tid);
            if let Ok(children) = std::fs::read_to_string(task.path().join("children")) {
                pending.extend(
                    children
                        .split_whitespace()
                        .filter_map(|c| c.parse::<u32>().ok()),
                );
            }
        }
    }
    tids
}

/// Online CPUs of this machine, from /sys/devices/system/cpu/online ("0-3,6").
pub fn online_cpus() -> Option<u32> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
    count_cpu_list(text.trim())
}

fn count_cpu_list(list: &str) -> Option<u32> {
    list.split(',').try_fold(0u32, |n, part| {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u32, u32) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        Some(n + b.checked_sub(a)? + 1)
    })
}

#[cfg(test)]
mod cpu_list_tests {
    #[test]
    fn counts_ranges_and_singles() {
        assert_eq!(super::count_cpu_list("0-1"), Some(2));
        assert_eq!(super::count_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(super::count_cpu_list("0"), Some(1));
        assert_eq!(super::count_cpu_list("x"), None);
    }
}
