//! What tracer learned of a traced process (from /proc, at its first call).

/// A traced process, as stored in the `processes` table.
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
    /// The few environment variables tracer reads (JSON object): the allocator's settings
    /// (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF) and the job's rank (RANK, LOCAL_RANK,
    /// WORLD_SIZE). Nothing else of the environment is kept.
    pub env: Option<String>,
}

/// The environment variables [`ProcessInfo::env`] keeps.
pub const KEPT_ENV: [&str; 5] = [
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
];

/// A process's place in a distributed job, from RANK, LOCAL_RANK and WORLD_SIZE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Rank {
    pub rank: Option<u32>,
    pub local_rank: Option<u32>,
    pub world_size: Option<u32>,
}

impl Rank {
    /// The rank a process's kept environment gives, if it names one.
    pub fn from_env<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<Rank> {
        let number = |name: &str| get(name).and_then(|v| v.trim().parse::<u32>().ok());
        let rank = Rank {
            rank: number("RANK"),
            local_rank: number("LOCAL_RANK"),
            world_size: number("WORLD_SIZE"),
        };
        (rank.rank.is_some() || rank.local_rank.is_some()).then_some(rank)
    }

    /// "rank 3/8", "rank 3", or "local rank 1".
    pub fn label(&self) -> String {
        match (self.rank, self.world_size, self.local_rank) {
            (Some(r), Some(w), _) => format!("rank {r}/{w}"),
            (Some(r), None, _) => format!("rank {r}"),
            (None, _, Some(l)) => format!("local rank {l}"),
            (None, _, None) => "no rank".to_owned(),
        }
    }
}

/// The kept environment stored as a JSON object, as a map (empty when absent or unreadable).
pub fn env_map(env: Option<&str>) -> std::collections::HashMap<String, String> {
    env.and_then(|json| serde_json::from_str(json).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_labels_from_the_environment() {
        let env = env_map(Some(r#"{"RANK":"3","WORLD_SIZE":"8","LOCAL_RANK":"3"}"#));
        let rank = Rank::from_env(|k| env.get(k).map(String::as_str)).expect("a rank");
        assert_eq!(rank.label(), "rank 3/8");
        let local = env_map(Some(r#"{"LOCAL_RANK":"1"}"#));
        let rank = Rank::from_env(|k| local.get(k).map(String::as_str)).expect("a local rank");
        assert_eq!(rank.label(), "local rank 1");
        let none = env_map(Some(
            r#"{"PYTORCH_CUDA_ALLOC_CONF":"expandable_segments:True"}"#,
        ));
        assert_eq!(Rank::from_env(|k| none.get(k).map(String::as_str)), None);
        assert!(env_map(Some("not json")).is_empty());
    }
}
