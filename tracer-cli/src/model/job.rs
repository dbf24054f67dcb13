//! Which job a process belongs to, from what it carries: its kept environment and, in
//! Kubernetes, its pod's owner. One name for every rank of a job on every node, and never the
//! same name for two jobs: torchrun's defaults (run id "none", 127.0.0.1:29500) are every
//! single-node job's, so a rendezvous on loopback names a job of one node only.

use std::collections::HashMap;

/// The job of a process nothing names: a job of its own.
pub const NO_JOB: &str = "no-job";

/// Names of jobs whose rendezvous is on loopback: the same name on two nodes is two jobs.
pub const LOCAL_JOB: &str = "local-";

/// The job's name: torchrun's run id (unless its default "none"), Slurm's job id, the pod's
/// owner (a JobSet, a PyTorchJob, a Job), the rendezvous address where it is not loopback,
/// `local-<port>` where it is (one node's), else "no-job". Every part is made plain (`clean`).
pub fn job_name(env: &HashMap<String, String>, pod_owner: Option<&str>) -> String {
    if let Some(id) = env.get("TORCHELASTIC_RUN_ID").filter(|id| *id != "none") {
        return format!("run-{}", clean(id, 64));
    }
    if let Some(id) = env.get("SLURM_JOB_ID") {
        return format!("slurm-{}", clean(id, 32));
    }
    if let Some(owner) = pod_owner {
        return format!("k8s-{}", clean(owner, 96));
    }
    let loopback = |a: &str| a.starts_with("127.") || a == "localhost" || a == "::1";
    match (env.get("MASTER_ADDR"), env.get("MASTER_PORT")) {
        (Some(addr), Some(port)) if !loopback(addr) => {
            format!("master-{}-{}", clean(addr, 48), clean(port, 8))
        }
        (Some(_), Some(port)) => format!("{LOCAL_JOB}{}", clean(port, 8)),
        _ => NO_JOB.into(),
    }
}

/// The job a name stands for across nodes: a loopback rendezvous's is tied to its node, and a
/// process nothing named is a job of its own.
pub fn job_key(job: &str, node: Option<&str>, pid: u32) -> String {
    let node = node.unwrap_or("?");
    if job == NO_JOB {
        format!("{NO_JOB} (pid {pid} on {node})")
    } else if job.starts_with(LOCAL_JOB) {
        format!("{job} on {node}")
    } else {
        job.to_owned()
    }
}

/// A pod's owner as its job: a JobSet's or Kubeflow training job's label names the whole job
/// (its pods belong to several Jobs or to no Job); else the controller that owns the pod,
/// unless it is one of replicas that are not ranks of one job (ReplicaSet, DaemonSet, the node).
pub fn pod_owner(
    namespace: &str,
    labels: &HashMap<String, String>,
    controller: Option<(&str, &str)>,
) -> Option<String> {
    let labelled = [
        ("jobset.sigs.k8s.io/jobset-name", "JobSet"),
        ("training.kubeflow.org/job-name", "TrainingJob"),
    ];
    for (label, kind) in labelled {
        if let Some(name) = labels.get(label) {
            return Some(format!("{namespace}-{kind}-{name}"));
        }
    }
    let (kind, name) = controller?;
    let replicas = ["ReplicaSet", "DaemonSet", "Node", "ReplicationController"];
    (!replicas.contains(&kind)).then(|| format!("{namespace}-{kind}-{name}"))
}

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

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn names_from_a_process_cannot_climb_or_hide() {
        assert_eq!(clean("../../etc", 64), "_._.._etc");
        assert_eq!(clean(".hidden", 64), "_hidden");
        assert_eq!(clean("job\n\x1b[31mred", 64), "job___31mred");
        assert_eq!(clean("", 8), "_");
        assert_eq!(clean(&"x".repeat(200), 64).len(), 64);
    }

    #[test]
    fn a_job_is_torchruns_run_id_else_a_rendezvous_off_loopback() {
        assert_eq!(
            job_name(&env(&[("TORCHELASTIC_RUN_ID", "abc/1")]), None),
            "run-abc_1"
        );
        // torchrun's defaults: one node's job, tied to the node by its key.
        let defaults = env(&[
            ("TORCHELASTIC_RUN_ID", "none"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]);
        assert_eq!(job_name(&defaults, None), "local-29500");
        assert_ne!(
            job_key("local-29500", Some("node-a"), 1),
            job_key("local-29500", Some("node-b"), 1)
        );
        assert_eq!(
            job_name(
                &env(&[("MASTER_ADDR", "10.0.0.7"), ("MASTER_PORT", "29500")]),
                None
            ),
            "master-10.0.0.7-29500"
        );
        assert_eq!(job_name(&env(&[]), None), NO_JOB);
        assert_ne!(job_key(NO_JOB, Some("n"), 1), job_key(NO_JOB, Some("n"), 2));
        assert_eq!(
            job_key("run-x", Some("a"), 1),
            job_key("run-x", Some("b"), 2)
        );
    }

    #[test]
    fn a_pods_owner_names_its_job_unless_it_is_a_replica() {
        let labels = env(&[("training.kubeflow.org/job-name", "bert")]);
        let owner = pod_owner("ml", &labels, Some(("PyTorchJob", "bert")));
        assert_eq!(owner.as_deref(), Some("ml-TrainingJob-bert"));
        // The pod's own owner: a JobSet's Job names the set, not the Job.
        let set = env(&[("jobset.sigs.k8s.io/jobset-name", "llama")]);
        assert_eq!(
            pod_owner("ml", &set, Some(("Job", "llama-workers-0"))).as_deref(),
            Some("ml-JobSet-llama")
        );
        assert_eq!(
            pod_owner("ml", &env(&[]), Some(("Job", "sweep-7"))).as_deref(),
            Some("ml-Job-sweep-7")
        );
        assert_eq!(
            pod_owner("ml", &env(&[]), Some(("ReplicaSet", "web-5d"))),
            None
        );
        // The pod's owner comes after the run id, before a rendezvous address.
        let rdzv = env(&[("MASTER_ADDR", "bert-master-0"), ("MASTER_PORT", "23456")]);
        assert_eq!(
            job_name(&rdzv, Some("ml-TrainingJob-bert")),
            "k8s-ml-TrainingJob-bert"
        );
        assert_eq!(
            job_name(&env(&[("TORCHELASTIC_RUN_ID", "r1")]), Some("x")),
            "run-r1"
        );
    }
}
