//! The writer's side of `--dump-on-oom`: which stored events are an OOM, and whose job it is.
//! An OOM is PyTorch's message, or, where no message came (PyTorch's probes not attached, a
//! program that is not PyTorch), the failed device allocation no retry, rescue or later
//! allocation of the process followed within PyTorch's retry time. Each is handed to the dump
//! thread without waiting (a full queue is counted).

use std::{
    collections::HashMap,
    path::Path,
    sync::mpsc::{SyncSender, TrySendError},
};

use tracer_common::{Library, Op, OpClass};

use super::{OomStored, Peer, PodJob, Seen, Whose};
use crate::{
    decode::{Call, Message},
    model::{
        attempts::{is_device_alloc, OUT_OF_MEMORY, RETRY_WITHIN_NS},
        env_map,
        job::{job_name, NO_JOB},
        ProcessInfo,
    },
    record::shared::Shared,
};

/// Each process's user, kept environment, start and pod as read, its failed attempt not yet
/// settled, and where its OOMs go.
pub struct OomWatch {
    tx: SyncSender<OomStored>,
    pod_job: Option<PodJob>,
    owners: HashMap<u32, Whose>,
    started: HashMap<u32, i64>,
    /// Each process's Kubernetes pod uid, where its cgroup names one.
    pods: HashMap<u32, String>,
    /// A process's latest failed device allocation (monotonic ns) that nothing has settled yet.
    failed: HashMap<u32, u64>,
}

impl OomWatch {
    pub(super) fn new(tx: SyncSender<OomStored>, pod_job: Option<PodJob>) -> OomWatch {
        OomWatch {
            tx,
            pod_job,
            owners: HashMap::new(),
            started: HashMap::new(),
            pods: HashMap::new(),
            failed: HashMap::new(),
        }
    }

    pub fn note(&mut self, processes: &[ProcessInfo]) {
        for p in processes {
            self.owners.insert(p.pid, (p.owner, p.env.clone()));
            if let Some(start) = p.start_time_ns {
                self.started.insert(p.pid, start);
            }
            if let Some(pod) = p.cgroup.as_deref().and_then(crate::traced::pods::pod_of) {
                self.pods.insert(p.pid, pod.pod_uid);
            }
        }
    }

    /// The calls and messages the writer has just stored: PyTorch's OOM messages go to the
    /// dump thread now; a failed attempt waits for what follows it.
    pub fn stored(
        &mut self,
        calls: &[Call],
        messages: &[Message],
        wall_offset_ns: i64,
        shared: &Shared,
    ) {
        for c in calls {
            if failed_attempt(c) {
                self.failed.insert(c.pid, c.ts_mono_ns);
            } else if settles(c) && self.failed.get(&c.pid).is_some_and(|&t| c.ts_mono_ns > t) {
                self.failed.remove(&c.pid);
            }
        }
        for m in messages.iter().filter(|m| m.op == Op::TorchOom) {
            self.failed.remove(&m.pid);
            self.send(m.pid, m.ts_mono_ns, Seen::Message, wall_offset_ns, shared);
        }
    }

    /// Failed attempts nothing settled within PyTorch's retry time (or all of them, at the
    /// end: `now_mono_ns` u64::MAX) are OOMs raised without a message.
    pub fn due(&mut self, now_mono_ns: u64, wall_offset_ns: i64, shared: &Shared) {
        let due: Vec<(u32, u64)> = self
            .failed
            .iter()
            .filter(|(_, &t)| now_mono_ns.saturating_sub(t) > RETRY_WITHIN_NS as u64)
            .map(|(&pid, &t)| (pid, t))
            .collect();
        for (pid, ts) in due {
            self.failed.remove(&pid);
            self.send(pid, ts, Seen::FailedAttempt, wall_offset_ns, shared);
        }
    }

    /// The job a process belongs to: its environment's, else its pod's owner's.
    fn job_of(&self, pid: u32, env: Option<&str>) -> String {
        let owner = self
            .pods
            .get(&pid)
            .zip(self.pod_job.as_ref())
            .and_then(|(uid, f)| (f.0)(uid));
        job_name(&env_map(env), owner.as_deref())
    }

    fn send(&self, pid: u32, ts_mono_ns: u64, seen: Seen, wall_offset_ns: i64, shared: &Shared) {
        let (owner, env) = self.owners.get(&pid).cloned().unwrap_or_default();
        let job = self.job_of(pid, env.as_deref());
        let peers = if job == NO_JOB {
            Vec::new()
        } else {
            self.owners
                .iter()
                .filter(|(p, (_, e))| {
                    **p != pid
                        && self.job_of(**p, e.as_deref()) == job
                        && Path::new("/proc").join(p.to_string()).exists()
                })
                .map(|(p, w)| Peer {
                    pid: *p,
                    whose: w.clone(),
                    started_ns: self.started.get(p).copied(),
                })
                .collect()
        };
        let same_user = self
            .owners
            .iter()
            .filter(|(_, (o, _))| o.is_some() && o.map(|x| x.0) == owner.map(|x| x.0))
            .map(|(p, _)| *p)
            .collect();
        let oom = OomStored {
            pid,
            ts_ns: ts_mono_ns as i64 + wall_offset_ns,
            seen,
            owner,
            env,
            job,
            started_ns: self.started.get(&pid).copied(),
            peers,
            same_user,
            pod_uid: self.pods.get(&pid).cloned(),
        };
        if let Err(TrySendError::Full(_)) = self.tx.try_send(oom) {
            shared
                .dumps_skipped
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// The device refused an allocation for want of memory.
fn failed_attempt(c: &Call) -> bool {
    is_device_alloc(c.op) && c.ret == OUT_OF_MEMORY
}

/// A call that shows the process got its memory after all: an allocation the device granted
/// (the retry), or a block PyTorch handed out (a use_on_oom pool's rescue, or a later request
/// after the OOM was caught).
fn settles(c: &Call) -> bool {
    let spec = c.op.spec();
    spec.class == OpClass::Alloc && (spec.library == Library::Torch || c.ret == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(op: Op, pid: u32, ts: u64, ret: i32) -> Call {
        Call {
            ts_mono_ns: ts,
            pid,
            tid: pid,
            op,
            device: Some(0),
            ret,
            duration_ns: 1_000,
            size: Some(1 << 20),
            ptr: None,
            aux0: 0,
            aux1: 0,
            flags: 0,
            comm: "t".into(),
            site: None,
            stack: None,
        }
    }

    fn watch() -> (OomWatch, std::sync::mpsc::Receiver<OomStored>, Shared) {
        let (tx, rx) = std::sync::mpsc::sync_channel(8);
        (OomWatch::new(tx, None), rx, Shared::default())
    }

    #[test]
    fn a_failed_attempt_nothing_followed_is_an_oom_once_the_retry_time_is_past() {
        let (mut w, rx, shared) = watch();
        let s = 1_000_000_000;
        w.stored(
            &[
                call(Op::CudaMalloc, 7, s, OUT_OF_MEMORY),
                call(Op::CudaFree, 7, s + 10, 0),
                // The retry fails too: the OOM is raised at it.
                call(Op::CudaMalloc, 7, s + 20, OUT_OF_MEMORY),
                // Another process's failure, then its successful retry.
                call(Op::CudaMalloc, 8, s, OUT_OF_MEMORY),
                call(Op::CudaMalloc, 8, s + 30, 0),
            ],
            &[],
            5,
            &shared,
        );
        w.due(s + 1_000_000_000, 5, &shared);
        assert!(rx.try_recv().is_err(), "within the retry time");
        w.due(s + 3_000_000_000, 5, &shared);
        let oom = rx.try_recv().unwrap();
        assert_eq!(
            (oom.pid, oom.ts_ns, oom.seen),
            (7, (s + 25) as i64, Seen::FailedAttempt)
        );
        assert!(rx.try_recv().is_err(), "pid 8's retry succeeded");
    }

    #[test]
    fn pytorchs_message_is_the_oom_and_settles_the_failure() {
        let (mut w, rx, shared) = watch();
        w.stored(
            &[call(Op::CudaMalloc, 7, 100, OUT_OF_MEMORY)],
            &[Message {
                ts_mono_ns: 200,
                pid: 7,
                tid: 7,
                op: Op::TorchOom,
                text: "CUDA out of memory".into(),
                truncated: false,
            }],
            0,
            &shared,
        );
        assert_eq!(rx.try_recv().unwrap().seen, Seen::Message);
        w.due(u64::MAX, 0, &shared);
        assert!(rx.try_recv().is_err(), "one OOM, not two");
    }
}
