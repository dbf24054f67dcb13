//! `tracer check`'s facts: what tracer needs, whether this machine has it, and the fix for each
//! gap. As root it also proves tracing works: it loads the programs and probes tracer itself.

use std::path::Path;

use serde::Serialize;

use super::{attach, discover, privileges};
use crate::paths;

#[derive(Debug, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    /// A failed required check makes `tracer check` exit non-zero.
    pub required: bool,
    pub detail: String,
    pub fix: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Library {
    pub path: String,
    pub origin: &'static str,
    pub pids: Vec<u32>,
}

#[derive(Debug, Serialize)]
pub struct CheckReport {
    /// Every required check passed (with root, tracing itself was proven).
    pub can_trace: bool,
    /// Required checks that failed.
    pub failed: usize,
    pub checks: Vec<Check>,
    pub libraries: Vec<Library>,
}

fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn kernel_at_least(release: &str, major: u32, minor: u32) -> bool {
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse::<u32>().ok());
    let (a, b) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

fn present(name: &'static str, path: &str, required: bool, what: &str, fix: &str) -> Check {
    let ok = Path::new(path).exists();
    Check {
        name,
        ok,
        required,
        detail: if ok {
            format!("{what}: {path} present")
        } else {
            format!("{what}: no {path}")
        },
        fix: Some(fix.into()),
    }
}

/// What the kernel offers, read from /proc and /sys (no privileges needed).
fn kernel_checks() -> Vec<Check> {
    let release = kernel_release();
    let bpf_disabled =
        std::fs::read_to_string("/proc/sys/kernel/unprivileged_bpf_disabled").unwrap_or_default();
    let bpf = Path::new("/proc/sys/kernel/unprivileged_bpf_disabled").exists();
    vec![
        Check {
            name: "kernel",
            ok: kernel_at_least(&release, 5, 15),
            required: true,
            detail: format!("Linux {release} (needs 5.15+: ring buffer, BPF cookies on uprobes)"),
            fix: Some("upgrade the kernel to 5.15 or newer".into()),
        },
        present(
            "BTF",
            "/sys/kernel/btf/vmlinux",
            false,
            "kernel type information",
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y",
        ),
        present(
            "uprobes",
            "/sys/bus/event_source/devices/uprobe",
            true,
            "uprobe PMU",
            "use a kernel built with CONFIG_UPROBE_EVENTS=y",
        ),
        Check {
            name: "bpf syscall",
            ok: bpf,
            required: true,
            detail: if bpf {
                format!("BPF enabled (unprivileged_bpf_disabled={})", bpf_disabled.trim())
            } else {
                "no /proc/sys/kernel/unprivileged_bpf_disabled: the kernel has no BPF system call"
                    .into()
            },
            fix: Some(
                "use a kernel built with CONFIG_BPF_SYSCALL=y (sandboxed kernels such as gVisor have none)"
                    .into(),
            ),
        },
    ]
}

/// With privileges, tracing itself: the programs load and a uprobe on tracer fires.
fn tracing_checks() -> Vec<Check> {
    let privileged = privileges::can_trace();
    let mut checks = vec![Check {
        name: "privileges",
        ok: privileged.is_ok(),
        required: false,
        detail: privileged.clone().map(str::to_owned).unwrap_or_else(|_| {
            "not root, no CAP_BPF + CAP_PERFMON (query and explain work without)".into()
        }),
        fix: privileged.clone().err(),
    }];
    if privileged.is_ok() {
        let result = attach::self_test();
        checks.push(Check {
            name: "tracing",
            ok: result.is_ok(),
            required: true,
            detail: match &result {
                Ok(ns) => format!(
                    "programs loaded; a uprobe on tracer itself fired and its event came through the ring buffer ({ns} ns call)"
                ),
                Err(e) => format!("tracing does not work here: {e:#}"),
            },
            fix: Some(
                "see the error: the kernel refused the programs or the probe (run `sudo dmesg | tail`)"
                    .into(),
            ),
        });
    }
    checks
}

fn library_check(who: &paths::Invoker) -> (Check, Vec<discover::Candidate>) {
    let homes: Vec<_> = who.home.iter().cloned().collect();
    let mut cache = discover::FileCache::default();
    let mapped = discover::scan_processes(&discover::all_pids(), &mut cache);
    let mut libraries: Vec<discover::Candidate> = mapped.clone();
    for c in discover::scan_installed(&homes) {
        if !libraries.iter().any(|m| m.id == c.id) {
            libraries.push(c);
        }
    }
    let check = Check {
        name: "CUDA libraries",
        ok: !libraries.is_empty(),
        required: false,
        detail: format!(
            "{} found ({} in use by running processes)",
            libraries.len(),
            mapped.len()
        ),
        fix: Some("install the CUDA runtime (pip install nvidia-cuda-runtime-cu12) or pass --lib PATH to tracer trace".into()),
    };
    (check, libraries)
}

fn database_check(who: &paths::Invoker) -> Check {
    let env = std::env::var_os(paths::DB_ENV).map(std::path::PathBuf::from);
    let db = paths::db_path(env.as_deref(), who);
    Check {
        name: "database",
        ok: db.is_ok(),
        required: false,
        detail: db
            .as_ref()
            .map(|p| {
                let note = if p.exists() {
                    ""
                } else {
                    " (created by the first trace)"
                };
                format!("{}{note}", p.display())
            })
            .unwrap_or_default(),
        fix: Some("pass --db FILE or set TRACER_DB".into()),
    }
}

/// Every check, as root including tracing itself.
pub fn run_checks() -> CheckReport {
    let who = paths::invoker();
    let mut checks = kernel_checks();
    // Loading programs on a kernel without BPF or uprobes only repeats what failed above.
    let kernel_ok = checks.iter().all(|c| c.ok || !c.required);
    if kernel_ok {
        checks.extend(tracing_checks());
    } else {
        checks.extend(
            tracing_checks()
                .into_iter()
                .filter(|c| c.name == "privileges"),
        );
    }
    let (libs, found) = library_check(&who);
    checks.push(libs);
    checks.push(database_check(&who));
    let failed = checks.iter().filter(|c| c.required && !c.ok).count();
    CheckReport {
        can_trace: failed == 0 && privileges::can_trace().is_ok(),
        failed,
        checks,
        libraries: found
            .iter()
            .map(|c| Library {
                path: c.shown.clone(),
                origin: c.origin.name(),
                pids: c.pids.iter().copied().collect(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_versions() {
        assert!(super::kernel_at_least("6.18.0-1-amd64", 5, 15));
        assert!(super::kernel_at_least("5.15.0", 5, 15));
        assert!(!super::kernel_at_least("5.4.0-100-generic", 5, 15));
        assert!(!super::kernel_at_least("4.4.0", 5, 15));
    }
}
