//! What a dump folder may name: other users' processes are taken out of what is written in a
//! user's folder (the job's name and plain names are model/job.rs's).

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
