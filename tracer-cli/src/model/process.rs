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
    /// (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF), the job's rank (RANK, LOCAL_RANK,
    /// WORLD_SIZE) and rendezvous (MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, SLURM_JOB_ID), the GPUs it
    /// may use (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES). Nothing else is kept.
    pub env: Option<String>,
    /// The GPUs its root shows it (JSON of [`VisibleGpus`]).
    pub gpus: Option<String>,
    /// Its user and group (real ids), read with the rest: whose files its OOM evidence is
    /// (`--dump-on-oom`). Not stored.
    pub owner: Option<(u32, u32)>,
}

/// The environment variables [`ProcessInfo::env`] keeps.
pub const KEPT_ENV: [&str; 11] = [
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
];

/// NVIDIA's character devices (/dev/nvidiaN: major 195, minor N, the GPU's number on the host).
pub const NVIDIA_MAJOR: u32 = 195;

/// The GPUs a process's root shows it, as tracer read them at its first call: the host minor
/// numbers of the /dev/nvidiaN character devices there, in order (a container sees only those
/// it was given, under their host numbers), and its mount namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VisibleGpus {
    pub minors: Vec<u32>,
    pub mount_ns: Option<u64>,
}

/// Where a process runs: the job it belongs to and the physical GPU behind each device number.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Placement {
    /// "torchelastic run abc", "job at 10.0.0.1:29500", or "pid 812" (a process named by no
    /// rendezvous is a job of its own).
    pub job: String,
    visible: VisibleGpus,
    /// CUDA_VISIBLE_DEVICES's entries, when set.
    cuda_visible: Option<Vec<String>>,
    /// The host GPUs NVIDIA's container runtime gave the container (NVIDIA_VISIBLE_DEVICES:
    /// host indices in their order, or UUIDs), when it names them.
    nvidia_visible: Option<Vec<String>>,
}

/// The physical GPU behind a device number: `label` as shown ("GPU 3", "GPU-8f3a..."), `key`
/// to compare processes by (the label where it names a host GPU; else tied to the mount
/// namespace, so two containers that both say "device 0" are never taken for one GPU).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Gpu {
    pub label: String,
    pub key: String,
}

impl Placement {
    pub fn new(
        pid: u32,
        env: &std::collections::HashMap<String, String>,
        gpus: Option<&str>,
    ) -> Placement {
        let get = |k: &str| env.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
        let job = match (
            get("TORCHELASTIC_RUN_ID"),
            get("MASTER_ADDR"),
            get("MASTER_PORT"),
        ) {
            (Some(id), _, _) => format!("torchelastic run {id}"),
            (None, Some(addr), Some(port)) => format!("job at {addr}:{port}"),
            _ => format!("pid {pid}"),
        };
        Placement {
            job,
            visible: gpus
                .and_then(|g| serde_json::from_str(g).ok())
                .unwrap_or_default(),
            cuda_visible: get("CUDA_VISIBLE_DEVICES")
                .map(|v| v.split(',').map(|e| e.trim().to_owned()).collect()),
            nvidia_visible: get("NVIDIA_VISIBLE_DEVICES").and_then(container_gpus),
        }
    }

    /// `pid`'s placement in `placements`, else one from nothing known (its device numbers its
    /// own, a job of its own).
    pub fn of(placements: &std::collections::HashMap<u32, Placement>, pid: u32) -> Placement {
        placements
            .get(&pid)
            .cloned()
            .unwrap_or_else(|| Placement::new(pid, &std::collections::HashMap::new(), None))
    }

    /// The physical GPU behind device number `ordinal` (CUDA's, in this process).
    pub fn gpu(&self, ordinal: i32) -> Gpu {
        let unknown = |what: String| Gpu {
            key: format!(
                "{what} (mount namespace {})",
                self.visible.mount_ns.unwrap_or(0)
            ),
            label: what,
        };
        let Ok(d) = usize::try_from(ordinal) else {
            return unknown("an unknown GPU".into());
        };
        // CUDA_VISIBLE_DEVICES picks, by index or UUID, among the devices the root shows.
        let index = match &self.cuda_visible {
            None => d,
            Some(list) => match list.get(d) {
                Some(e) if e.starts_with("GPU-") || e.starts_with("MIG-") => {
                    return Gpu {
                        label: e.clone(),
                        key: e.clone(),
                    }
                }
                Some(e) => match e.parse::<usize>() {
                    Ok(i) => i,
                    Err(_) => return unknown(format!("GPU {d}")),
                },
                None => return unknown(format!("GPU {d}")),
            },
        };
        match self.visible.minors.get(index) {
            Some(minor) => {
                let label = format!("GPU {minor}");
                Gpu {
                    key: label.clone(),
                    label,
                }
            }
            None => match self.nvidia_visible.as_ref().and_then(|l| l.get(index)) {
                // Its root was not read (it ended first): the container runtime's list.
                Some(e) if e.starts_with("GPU-") || e.starts_with("MIG-") => Gpu {
                    label: e.clone(),
                    key: e.clone(),
                },
                Some(host) => {
                    let label = format!("GPU {host}");
                    Gpu {
                        key: label.clone(),
                        label,
                    }
                }
                // No NVIDIA device in its root (the simulated runtime): its numbers are its own.
                None => unknown(format!("GPU {index}")),
            },
        }
    }
}

/// NVIDIA_VISIBLE_DEVICES's host GPUs, in the order CUDA numbers them in the container (host
/// indices ascending; UUIDs as listed), or None where it names none ("all", "none", "void").
fn container_gpus(value: &str) -> Option<Vec<String>> {
    let entries: Vec<String> = value.split(',').map(|e| e.trim().to_owned()).collect();
    if entries
        .iter()
        .any(|e| e.is_empty() || matches!(e.as_str(), "all" | "none" | "void"))
    {
        return None;
    }
    let mut indices: Vec<u32> = entries.iter().filter_map(|e| e.parse().ok()).collect();
    if indices.len() == entries.len() {
        indices.sort_unstable();
        return Some(indices.iter().map(u32::to_string).collect());
    }
    Some(entries)
}

/// What NVIDIA's management library said of one GPU at a moment (traced/nvml.rs): its memory
/// and the processes using it with their bytes (each one's CUDA context included).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GpuSample {
    pub ts_ns: i64,
    /// "GPU 3": the device's minor number, as model/process.rs `Gpu` labels host GPUs.
    pub gpu: String,
    pub total: u64,
    pub used: u64,
    pub processes: Vec<(u32, u64)>,
}

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

    fn placement(pid: u32, env: &str, gpus: &str) -> Placement {
        Placement::new(pid, &env_map(Some(env)), Some(gpus))
    }

    #[test]
    fn a_device_number_is_the_gpu_its_root_and_cuda_visible_devices_name() {
        // A container given host GPUs 3 and 5 sees them as devices 0 and 1.
        let p = placement(7, "{}", r#"{"minors":[3,5],"mount_ns":11}"#);
        assert_eq!(p.gpu(1).label, "GPU 5");
        let q = placement(
            8,
            r#"{"CUDA_VISIBLE_DEVICES":"1"}"#,
            r#"{"minors":[3,5],"mount_ns":12}"#,
        );
        assert_eq!(q.gpu(0), p.gpu(1), "the same GPU from two containers");
        let uuid = placement(9, r#"{"CUDA_VISIBLE_DEVICES":"GPU-8f3a"}"#, "{}");
        assert_eq!(uuid.gpu(0).key, "GPU-8f3a");
        // No device nodes: "device 0" of two mount namespaces are not one GPU.
        let a = placement(10, "{}", r#"{"minors":[],"mount_ns":1}"#);
        let b = placement(11, "{}", r#"{"minors":[],"mount_ns":2}"#);
        assert_eq!(a.gpu(0).label, b.gpu(0).label);
        assert_ne!(a.gpu(0).key, b.gpu(0).key);
        assert_eq!(a.gpu(-1).label, "an unknown GPU");
        // A container whose root was not read: the container runtime's list names the host
        // GPUs (indices in order, UUIDs as listed); "all" names none.
        let listed = placement(12, r#"{"NVIDIA_VISIBLE_DEVICES":"5,3"}"#, "{}");
        assert_eq!(
            (listed.gpu(0).key, listed.gpu(1).label),
            ("GPU 3".into(), "GPU 5".into())
        );
        let by_uuid = placement(13, r#"{"NVIDIA_VISIBLE_DEVICES":"GPU-aa,GPU-bb"}"#, "{}");
        assert_eq!(by_uuid.gpu(1).key, "GPU-bb");
        let all = placement(
            14,
            r#"{"NVIDIA_VISIBLE_DEVICES":"all"}"#,
            r#"{"minors":[],"mount_ns":3}"#,
        );
        assert_eq!(
            all.gpu(0).key,
            a.gpu(0).key.replace("namespace 1", "namespace 3")
        );
        // The root's device nodes come first.
        let both = placement(
            15,
            r#"{"NVIDIA_VISIBLE_DEVICES":"1"}"#,
            r#"{"minors":[2],"mount_ns":4}"#,
        );
        assert_eq!(both.gpu(0).label, "GPU 2");
    }

    #[test]
    fn a_job_is_its_rendezvous_else_the_process_alone() {
        let elastic = placement(1, r#"{"TORCHELASTIC_RUN_ID":"r1","RANK":"0"}"#, "{}");
        assert_eq!(elastic.job, "torchelastic run r1");
        let master = placement(
            2,
            r#"{"MASTER_ADDR":"10.0.0.1","MASTER_PORT":"29500"}"#,
            "{}",
        );
        assert_eq!(master.job, "job at 10.0.0.1:29500");
        assert_eq!(placement(3, r#"{"RANK":"1"}"#, "{}").job, "pid 3");
    }

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
