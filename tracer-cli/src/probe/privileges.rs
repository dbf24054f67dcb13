//! Whether this process may load BPF programs and create uprobes.

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Effective capability bits from /proc/self/status.
fn effective_caps() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("CapEff:"))?;
            u64::from_str_radix(line["CapEff:".len()..].trim(), 16).ok()
        })
        .unwrap_or(0)
}

/// Ok when root, or holding CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN); else what is missing.
pub fn can_trace() -> Result<&'static str, String> {
    if nix::unistd::Uid::effective().is_root() {
        return Ok("running as root");
    }
    let caps = effective_caps();
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
        return Ok("CAP_BPF and CAP_PERFMON held");
    }
    let mut missing = Vec::new();
    if !has(CAP_BPF) {
        missing.push("CAP_BPF");
    }
    if !has(CAP_PERFMON) {
        missing.push("CAP_PERFMON");
    }
    Err(format!(
        "tracing needs root or {}: run it with sudo (sudo tracer trace ...), or grant the binary \
         the capabilities: sudo setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep \"$(command -v tracer)\"",
        missing.join(" and ")
    ))
}
