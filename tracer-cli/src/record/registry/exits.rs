//! Processes' ends, held back a moment. A call can be read after its process's end (it waited
//! in another CPU's stage, or its vCPU was held off by the host: `events_late`); had the end
//! been acted on, the call would find its process forgotten and start a new one under the
//! dead pid: a phantom in the live figures for the rest of the trace, holding a call-site table
//! that a later process reusing the pid would inherit. So an end is acted on once
//! [`EXIT_GRACE_NS`] have passed on the calls' clock (or at once when a later process reuses the
//! pid); a call read later still is told apart by the remembered end.

use std::collections::{HashMap, VecDeque};

/// How long an end waits before the process is forgotten (monotonic ns, the calls' clock).
pub const EXIT_GRACE_NS: u64 = 250_000_000;
/// Ends remembered after they were acted on, at most.
const RECENT_KEPT: usize = 16_384;

#[derive(Default)]
pub struct Exits {
    /// Ends not acted on yet, in the order read, with their times.
    pending: VecDeque<(u32, u64)>,
    pending_at: HashMap<u32, u64>,
    /// Ends acted on, most recent last.
    recent: VecDeque<u32>,
    recent_at: HashMap<u32, u64>,
}

impl Exits {
    /// Holds back `pid`'s end at `ts`; returns the time of an earlier end of the same pid still
    /// held (a process that reused it and ended too), to be acted on first.
    pub fn hold(&mut self, pid: u32, ts: u64) -> Option<u64> {
        let earlier = self.release(pid);
        self.pending.push_back((pid, ts));
        self.pending_at.insert(pid, ts);
        earlier
    }

    /// The held end of `pid`, when a call made after it shows a new process under that pid.
    pub fn reused(&mut self, pid: u32, call_ts: u64) -> Option<u64> {
        if self.pending_at.is_empty() {
            return None;
        }
        match self.pending_at.get(&pid) {
            Some(&ts) if call_ts > ts => self.release(pid),
            _ => None,
        }
    }

    /// Takes `pid`'s held end out of the queue.
    fn release(&mut self, pid: u32) -> Option<u64> {
        let ts = self.pending_at.remove(&pid)?;
        self.pending.retain(|&(p, _)| p != pid);
        Some(ts)
    }

    /// The held ends whose grace has passed by `now` (all of them with `u64::MAX`).
    pub fn due(&mut self, now: u64) -> Vec<(u32, u64)> {
        let mut due = Vec::new();
        while let Some(&(pid, ts)) = self.pending.front() {
            if ts.saturating_add(EXIT_GRACE_NS) > now {
                break;
            }
            self.pending.pop_front();
            self.pending_at.remove(&pid);
            due.push((pid, ts));
        }
        due
    }

    /// Notes an end acted on.
    pub fn acted(&mut self, pid: u32, ts: u64) {
        if self.recent_at.insert(pid, ts).is_none() {
            self.recent.push_back(pid);
        }
        while self.recent.len() > RECENT_KEPT {
            if let Some(old) = self.recent.pop_front() {
                self.recent_at.remove(&old);
            }
        }
    }

    /// Whether a call at `call_ts` from a pid not seen since is its ended process's, read
    /// after its end was acted on.
    pub fn after_end(&self, pid: u32, call_ts: u64) -> bool {
        self.recent_at.get(&pid).is_some_and(|&ts| call_ts <= ts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_waits_out_its_grace_and_a_reused_pid_releases_it_early() {
        let mut e = Exits::default();
        assert_eq!(e.hold(7, 1_000), None);
        assert_eq!(e.hold(8, 2_000), None);
        // A call made before the end: the ended process's own, read late.
        assert_eq!(e.reused(7, 900), None);
        assert!(e.due(1_000 + EXIT_GRACE_NS - 1).is_empty());
        assert_eq!(e.due(1_000 + EXIT_GRACE_NS), vec![(7, 1_000)]);
        // A call made after 8's end: a new process under the pid.
        assert_eq!(e.reused(8, 2_001), Some(2_000));
        assert!(e.pending.is_empty() && e.pending_at.is_empty());
        assert!(e.due(u64::MAX).is_empty());
    }

    #[test]
    fn a_call_read_after_the_end_was_acted_on_is_told_from_a_new_process() {
        let mut e = Exits::default();
        e.acted(7, 1_000);
        assert!(e.after_end(7, 999));
        assert!(!e.after_end(7, 1_001));
        assert!(!e.after_end(9, 5));
        for pid in 0..RECENT_KEPT as u32 + 10 {
            e.acted(100 + pid, 1);
        }
        assert!(!e.after_end(7, 999), "the oldest ends are forgotten");
        assert!(e.recent.len() <= RECENT_KEPT);
    }

    #[test]
    fn a_second_end_under_a_held_pid_returns_the_first() {
        let mut e = Exits::default();
        e.hold(7, 1_000);
        assert_eq!(e.hold(7, 3_000), Some(1_000));
        assert_eq!(e.due(u64::MAX), vec![(7, 3_000)]);
    }
}
