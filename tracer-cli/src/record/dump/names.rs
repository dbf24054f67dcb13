//! What a dump folder is called and may name: the job's name from the process's environment,
//! names made plain from a traced process's own strings, and other users' processes taken out
//! of what is written in a user's folder.

use std::collections::HashMap;

/// Another user's process is named in a user's folder by its bytes only: every object of the
/// report or layout naming a process (a `pid` beside a `comm`) that is not the user's loses
/// both, and every text that named it says "another process" instead.
pub(super) fn redact_others(report: &mut serde_json::Value, mine: &impl Fn(u32) -> bool) {
    let mut named: Vec<(u32, Option<String>)> = Vec::new();
    unname(report, mine, &mut named);
    if !named.is_empty() {
        scrub(report, &named);
    }
}

fn unname(
    v: &mut serde_json::Value,
    mine: &impl Fn(u32) -> bool,
    named: &mut Vec<(u32, Option<String>)>,
) {
    use serde_json::Value;
    match v {
        Value::Object(map) => {
            let pid = map.get("pid").and_then(Value::as_u64);
            if let (Some(pid), true) = (pid, map.contains_key("comm")) {
                if !mine(pid as u32) {
                    let comm = map.get("comm").and_then(Value::as_str).map(str::to_owned);
                    named.push((pid as u32, comm));
                    map.insert("pid".into(), Value::Null);
                    map.insert("comm".into(), Value::Null);
                }
            }
            map.values_mut().for_each(|x| unname(x, mine, named));
        }
        Value::Array(items) => items.iter_mut().for_each(|x| unname(x, mine, named)),
        _ => {}
    }
}

fn scrub(v: &mut serde_json::Value, named: &[(u32, Option<String>)]) {
    use serde_json::Value;
    match v {
        Value::String(text) => {
            for (pid, comm) in named {
                if let Some(c) = comm {
                    *text = text.replace(&format!("pid {pid} ({c})"), "another process");
                    *text = text.replace(&format!("{c} (pid {pid})"), "another process");
                }
                *text = text.replace(&format!("pid {pid}"), "another process");
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|x| scrub(x, named)),
        Value::Object(map) => map.values_mut().for_each(|x| scrub(x, named)),
        _ => {}
    }
}

pub(super) fn parse_env(env: Option<&str>) -> HashMap<String, String> {
    env.and_then(|e| serde_json::from_str(e).ok())
        .unwrap_or_default()
}

/// The job's name from its environment: torchrun's run id (unless its default "none"), Slurm's
/// job id, the rendezvous address where it is not loopback, else "no-job" (torchrun's defaults,
/// run id "none" at 127.0.0.1:29500, would make every single-node job on the node one).
pub(super) fn job_name(env: &HashMap<String, String>) -> String {
    if let Some(id) = env.get("TORCHELASTIC_RUN_ID").filter(|id| *id != "none") {
        return format!("run-{}", clean(id, 64));
    }
    if let Some(id) = env.get("SLURM_JOB_ID") {
        return format!("slurm-{}", clean(id, 32));
    }
    let loopback = |a: &str| a.starts_with("127.") || a == "localhost" || a == "::1";
    match (env.get("MASTER_ADDR"), env.get("MASTER_PORT")) {
        (Some(addr), Some(port)) if !loopback(addr) => {
            format!("master-{}-{}", clean(addr, 48), clean(port, 8))
        }
        _ => NO_JOB.into(),
    }
}

/// The job of a process no run id or rendezvous names: its folder, never a peer of another's.
pub(super) const NO_JOB: &str = "no-job";

/// A name from a traced process's own string: letters, digits, '.', '-' and '_' (anything else
/// '_'), no leading '.', at most `max` bytes; never empty.
pub fn clean(s: &str, max: usize) -> String {
    let mut out: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(max)
        .collect();
    if out.starts_with('.') {
        out.replace_range(..1, "_");
    }
    if out.is_empty() {
        out.push('_');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_a_process_cannot_climb_or_hide() {
        assert_eq!(clean("../../etc", 64), "_._.._etc");
        assert_eq!(clean(".hidden", 64), "_hidden");
        assert_eq!(clean("job\n\x1b[31mred", 64), "job___31mred");
        assert_eq!(clean("", 8), "_");
        assert_eq!(clean(&"x".repeat(200), 64).len(), 64);
    }

    #[test]
    fn another_users_process_is_told_by_its_bytes_only() {
        let mut report = serde_json::json!({
            "holders": [{"pid": 10, "others": [
                {"pid": 77, "comm": "secret-model", "bytes": 5},
                {"pid": 11, "comm": "rank1", "bytes": 6}
            ]}],
            "chains": [{"compounding": ["pid 77 (secret-model) held 5 B", "pid 11 (rank1) held 6 B"]}]
        });
        redact_others(&mut report, &|pid| pid == 10 || pid == 11);
        let others = &report["holders"][0]["others"];
        assert_eq!(
            others[0],
            serde_json::json!({"pid": null, "comm": null, "bytes": 5})
        );
        assert_eq!(others[1]["comm"], "rank1");
        assert_eq!(
            report["chains"][0]["compounding"],
            serde_json::json!(["another process held 5 B", "pid 11 (rank1) held 6 B"])
        );
        assert!(!report.to_string().contains("secret-model"));
    }

    #[test]
    fn a_job_is_torchruns_run_id_else_a_rendezvous_off_loopback() {
        let env = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            job_name(&env(&[("TORCHELASTIC_RUN_ID", "abc/1")])),
            "run-abc_1"
        );
        // torchrun's defaults name every single-node job alike: no job.
        assert_eq!(
            job_name(&env(&[
                ("TORCHELASTIC_RUN_ID", "none"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500")
            ])),
            "no-job"
        );
        assert_eq!(
            job_name(&env(&[
                ("MASTER_ADDR", "10.0.0.7"),
                ("MASTER_PORT", "29500")
            ])),
            "master-10.0.0.7-29500"
        );
    }
}
