//! `tracer check`: what tracer needs, whether this machine has it, and the fix for each gap.

use std::{io::Write as _, path::Path};

use anyhow::Result;
use clap::Args;

use crate::{discover, exit::Coded, paths, privileges};

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Also list every process using each library.
    #[arg(long)]
    pub verbose: bool,
}

struct Check {
    name: &'static str,
    ok: bool,
    /// A failed required check makes `tracer check` exit non-zero.
    required: bool,
    detail: String,
    fix: Option<String>,
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

pub fn run(args: CheckArgs) -> Result<()> {
    let mut checks = Vec::new();
    let release = kernel_release();
    checks.push(Check {
        name: "kernel",
        ok: kernel_at_least(&release, 5, 15),
        required: true,
        detail: format!("Linux {release} (needs 5.15+: ring buffer, BPF cookies on uprobes)"),
        fix: Some("upgrade the kernel to 5.15 or newer".into()),
    });
    let privileged = privileges::can_trace();
    checks.push(Check {
        name: "privileges",
        ok: privileged.is_ok(),
        required: false,
        detail: privileged.clone().map(str::to_owned).unwrap_or_else(|_| {
            "not root, no CAP_BPF + CAP_PERFMON (query and explain work without)".into()
        }),
        fix: privileged.err(),
    });
    let btf = Path::new("/sys/kernel/btf/vmlinux").exists();
    checks.push(Check {
        name: "BTF",
        ok: btf,
        required: false,
        detail: if btf {
            "/sys/kernel/btf/vmlinux present".into()
        } else {
            "no /sys/kernel/btf/vmlinux".into()
        },
        fix: Some(
            "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (needed by later scheduler tracing)"
                .into(),
        ),
    });
    let uprobe_pmu = Path::new("/sys/bus/event_source/devices/uprobe").exists();
    checks.push(Check {
        name: "uprobes",
        ok: uprobe_pmu,
        required: true,
        detail: if uprobe_pmu {
            "uprobe PMU available".into()
        } else {
            "no uprobe PMU in /sys/bus/event_source/devices".into()
        },
        fix: Some("use a kernel built with CONFIG_UPROBE_EVENTS=y".into()),
    });
    let bpf_disabled =
        std::fs::read_to_string("/proc/sys/kernel/unprivileged_bpf_disabled").unwrap_or_default();
    checks.push(Check {
        name: "bpf syscall",
        ok: Path::new("/proc/sys/kernel/unprivileged_bpf_disabled").exists(),
        required: true,
        detail: format!(
            "BPF enabled (unprivileged_bpf_disabled={})",
            bpf_disabled.trim()
        ),
        fix: Some("use a kernel built with CONFIG_BPF_SYSCALL=y".into()),
    });

    let who = paths::invoker();
    let homes: Vec<_> = who.home.iter().cloned().collect();
    let mut static_cache = Default::default();
    let mapped = discover::scan_processes(&discover::all_pids(), &mut static_cache);
    let installed = discover::scan_installed(&homes);
    let mut libraries: Vec<discover::Candidate> = mapped.clone();
    for c in installed {
        if !libraries.iter().any(|m| m.id == c.id) {
            libraries.push(c);
        }
    }
    checks.push(Check {
        name: "CUDA libraries",
        ok: !libraries.is_empty(),
        required: false,
        detail: format!(
            "{} found ({} in use by running processes)",
            libraries.len(),
            mapped.len()
        ),
        fix: Some("install the CUDA runtime (pip install nvidia-cuda-runtime-cu12) or pass --lib PATH to tracer trace".into()),
    });
    let db = paths::db_path(
        std::env::var_os(paths::DB_ENV)
            .map(std::path::PathBuf::from)
            .as_deref(),
        &who,
    );
    checks.push(Check {
        name: "database",
        ok: db.is_ok(),
        required: false,
        detail: db
            .as_ref()
            .map(|p| {
                format!(
                    "{}{}",
                    p.display(),
                    if p.exists() {
                        ""
                    } else {
                        " (created by the first trace)"
                    }
                )
            })
            .unwrap_or_default(),
        fix: Some("pass --db FILE or set TRACER_DB".into()),
    });

    let mut out = std::io::stdout().lock();
    let mut failed = 0;
    for c in &checks {
        let mark = if c.ok {
            "ok  "
        } else if c.required {
            "FAIL"
        } else {
            "warn"
        };
        writeln!(out, "[{mark}] {:<15} {}", c.name, c.detail)?;
        if !c.ok {
            if let Some(fix) = &c.fix {
                writeln!(out, "       fix: {fix}")?;
            }
            if c.required {
                failed += 1;
            }
        }
    }
    for lib in &libraries {
        let pids: Vec<String> = lib.pids.iter().map(|p| p.to_string()).collect();
        let users = if pids.is_empty() {
            String::new()
        } else if args.verbose || pids.len() <= 5 {
            format!(" used by pid {}", pids.join(", "))
        } else {
            format!(" used by {} processes", pids.len())
        };
        writeln!(out, "       {} ({}){users}", lib.shown, lib.origin.name())?;
    }
    if failed > 0 {
        return Err(Coded {
            code: crate::exit::NO_PRIVILEGE,
            message: format!("{failed} required check(s) failed"),
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_versions() {
        assert!(super::kernel_at_least("6.18.0-1-amd64", 5, 15));
        assert!(super::kernel_at_least("5.15.0", 5, 15));
        assert!(!super::kernel_at_least("5.4.0-100-generic", 5, 15));
    }
}
