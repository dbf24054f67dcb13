//! The registry's delivery: each batch of calls read applied, in one order, to the live
//! table's statistics, the layouts, the figures, the arming decisions and the whole-run
//! series, then handed to the writer with what is kept beside it. The layouts' lock is taken
//! before the figures' (`Shared::lock_allocators`, `Shared::lock_figures`); the figures are
//! released before a keyframe is made, so that scrapes go on meanwhile.

use std::sync::{atomic::Ordering, mpsc::SyncSender};

use anyhow::{anyhow, Result};

use super::{out_of_memory_in, wall_now_ns, Registry};
use crate::{
    decode::{Call, Message},
    model::{
        env_map,
        figures::{oom_device, Figures},
        layout::AllocConf,
        live::LiveAllocators,
        ProcessInfo, Rank,
    },
    record::{
        shared::{thread_cpu_ns, Shared},
        writer::Delivery,
    },
    traced::pods,
};

impl Registry {
    /// Counts the delivery, updates the live figures (firing --on-warning's command on an
    /// early warning) and hands it to the writer.
    pub(super) fn deliver(
        &mut self,
        mut delivery: Delivery,
        tx: &SyncSender<Delivery>,
        shared: &Shared,
    ) -> Result<()> {
        self.count(&delivery, shared);
        let mut allocators = shared.lock_allocators()?;
        let now = {
            let mut figures = shared.lock_figures()?;
            self.take_processes(&delivery.processes, &mut allocators, &mut figures);
            self.apply_calls(&delivery.calls, &mut allocators, &mut figures, shared);
            self.apply_messages(&delivery.messages, &mut figures);
            std::time::Instant::now()
            // The figures are free again: scrapes go on while a keyframe is made.
        };
        // The keyframe holds the exited processes' last states: it precedes their exit.
        if self.keyframes.due(
            shared.keyframe_wanted.load(Ordering::SeqCst),
            allocators.blocks_held(),
            self.ended.len(),
        ) {
            delivery.keyframe = Some(self.keyframe(&allocators, shared)?);
            shared.keyframe_wanted.store(false, Ordering::SeqCst);
        }
        self.end_processes(&delivery.exited, &mut allocators, shared, now);
        drop(allocators);
        delivery.series = self.series.take_closed(wall_now_ns());
        delivery.gaps = std::mem::take(&mut self.gaps);
        if let Some(watch) = self.nvml.as_mut() {
            if out_of_memory_in(&delivery) {
                delivery.gpu_samples = watch.sample(false);
            }
        }
        tx.send(delivery)
            .map_err(|_| anyhow!("the database writer stopped"))
    }

    /// Counts what arrived, and the live table's per-op statistics.
    fn count(&self, delivery: &Delivery, shared: &Shared) {
        shared.events_read.fetch_add(
            (delivery.calls.len() + delivery.after_end.len() + delivery.messages.len()) as u64,
            Ordering::SeqCst,
        );
        shared
            .calls_before_interpreter
            .store(self.before_interpreter, Ordering::SeqCst);
        if let Ok(mut live) = shared.live.lock() {
            for c in &delivery.calls {
                live.add_one(c.pid, c.op, c.ret, c.size, c.duration_ns);
            }
            for &pid in &delivery.exited {
                live.exited(pid);
            }
        }
    }

    /// Processes seen for the first time: their settings, rank, placement and start.
    fn take_processes(
        &mut self,
        processes: &[ProcessInfo],
        allocators: &mut LiveAllocators,
        figures: &mut Figures,
    ) {
        for p in processes {
            let env = env_map(p.env.as_deref());
            let get = |k: &str| env.get(k).map(String::as_str);
            let rank = Rank::from_env(get);
            allocators.describe(p.pid, AllocConf::from_env(get), rank);
            if self.arming.decides() {
                let placement = crate::model::Placement::new(p.pid, &env, p.gpus.as_deref());
                self.arming.placed(p.pid, placement);
            }
            allocators.started(p.pid, p.start_time_ns);
            if let Some(gap) = self.before_trace(p) {
                self.gaps.push(gap);
            }
            figures.describe(
                p.pid,
                p.comm.as_deref().unwrap_or_default(),
                rank.map(|r| r.label()),
                p.cgroup.as_deref().and_then(pods::pod_of),
                crate::model::Placement::new(p.pid, &env, p.gpus.as_deref()),
            );
        }
    }

    /// Each call into the figures, the layouts, the arming decisions and the whole-run series;
    /// an early warning into the series, the figures and --on-warning's command.
    fn apply_calls(
        &mut self,
        calls: &[Call],
        allocators: &mut LiveAllocators,
        figures: &mut Figures,
        shared: &Shared,
    ) {
        self.keyframes.events += calls.len() as u64;
        for c in calls {
            let event = crate::store::blocks::event_of(c, self.wall_offset_ns);
            self.keyframes.latest_ns = self.keyframes.latest_ns.max(event.ts_ns);
            figures.apply(&event);
            let (alarm, series_figures, device_free) = allocators.apply_for_series(&event);
            if self.arming.decides() {
                self.arming.observe(&event);
            }
            self.series.apply(&event, series_figures, device_free);
            let Some(alarm) = alarm else {
                continue;
            };
            self.series.warned(c.pid, alarm.device, alarm.ts_ns);
            figures.warned(c.pid, alarm.device);
            if let Some(hook) = self.hook.as_mut() {
                hook.fire(c.pid, allocators.rank(c.pid), &alarm, alarm.ts_ns);
                shared
                    .on_warning_skipped
                    .store(hook.skipped, Ordering::SeqCst);
            }
        }
    }

    /// PyTorch's out-of-memory messages: into the figures, the arming decisions and the series.
    fn apply_messages(&mut self, messages: &[Message], figures: &mut Figures) {
        for m in messages {
            if m.op.spec().class != tracer_common::OpClass::Oom {
                continue;
            }
            figures.oom(m.pid, &m.text);
            let ts = m.ts_mono_ns as i64 + self.wall_offset_ns;
            if self.arming.decides() {
                let oom = crate::model::Event {
                    ts_ns: ts,
                    duration_ns: 0,
                    size: 0,
                    ptr: 0,
                    aux0: 0,
                    aux1: 0,
                    pid: m.pid,
                    tid: m.tid,
                    ret: 0,
                    device: oom_device(&m.text),
                    stack: None,
                    op: m.op,
                };
                self.arming.observe(&oom);
            }
            self.series.oom(m.pid, oom_device(&m.text), ts);
        }
    }

    /// Processes that ended: their last states kept for the next keyframe, then dropped from
    /// the layouts, the series and the figures (`now`: when they were last applied).
    fn end_processes(
        &mut self,
        exited: &[u32],
        allocators: &mut LiveAllocators,
        shared: &Shared,
        now: std::time::Instant,
    ) {
        for &pid in exited {
            let join = self.ended_joins.remove(&pid);
            if let Some(state) = allocators.state(pid).filter(|_| self.keyframes.on) {
                let started = thread_cpu_ns();
                let mut state = state.clone();
                if let Some(join) = join {
                    state.take_join(join.live, join.devices);
                }
                self.ended.push(state);
                shared.keyframe_cpu_since(started);
            }
            allocators.exited(pid);
            self.series.exited(pid);
            self.taken_up.remove(&pid);
        }
        if let Ok(mut figures) = shared.figures.lock() {
            for &pid in exited {
                figures.exited(pid, now);
            }
        }
    }
}
