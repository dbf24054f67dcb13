//! The ring-buffer reader: drains, decodes and hands over, nothing else, so the kernel's ring
//! is emptied as fast as it fills. What is slow to learn about a call (its process, its call
//! site) is the registry's work, on its own thread.

use std::{
    os::fd::AsFd as _,
    sync::{atomic::Ordering, mpsc::SyncSender},
};

use anyhow::{anyhow, Result};
use aya::maps::{MapData, RingBuf};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::{registry::Inbound, shared::Shared};
use crate::decode::{self, Record};

/// How long events may wait in the ring before the reader looks (the delivery bound).
const POLL_INTERVAL_MS: u16 = 10;
/// The look after one that found events: a burst's tail (a process's last calls, whose call
/// sites must be read while it lives) is not left for a whole interval.
const BUSY_POLL_INTERVAL_MS: u16 = 1;
/// Records handed over at most at once.
const BATCH: usize = 8192;

/// Drains the ring until the session stops: wakes on the kernel's signal (a batch is waiting)
/// or every POLL_INTERVAL_MS, whichever comes first, so delivery latency stays bounded. After
/// the stop flag is set it drains once more, so every record submitted before is handed over.
pub fn read_loop(
    mut ring: RingBuf<MapData>,
    tx: SyncSender<Inbound>,
    shared: &Shared,
) -> Result<()> {
    let result = (|| -> Result<()> {
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            let stopping = shared.stop.load(Ordering::SeqCst);
            let mut decode_errors = 0;
            let mut found = false;
            while let Some(item) = ring.next() {
                found = true;
                match decode::decode(&item) {
                    Ok(record) => batch.push(record),
                    Err(_) => decode_errors += 1,
                }
                if batch.len() >= BATCH {
                    hand_over(&mut batch, &tx)?;
                }
            }
            shared
                .decode_errors
                .fetch_add(decode_errors, Ordering::SeqCst);
            if !batch.is_empty() {
                hand_over(&mut batch, &tx)?;
            }
            if stopping {
                return Ok(());
            }
            let mut fds = [PollFd::new(ring.as_fd(), PollFlags::POLLIN)];
            let wait = if found {
                BUSY_POLL_INTERVAL_MS
            } else {
                POLL_INTERVAL_MS
            };
            match poll(&mut fds, PollTimeout::from(wait)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(anyhow!("poll the event ring buffer: {e}")),
            }
        }
    })();
    if result.is_err() {
        shared.stop.store(true, Ordering::SeqCst);
    }
    result
}

fn hand_over(batch: &mut Vec<Record>, tx: &SyncSender<Inbound>) -> Result<()> {
    tx.send(Inbound::Ring(std::mem::replace(
        batch,
        Vec::with_capacity(BATCH),
    )))
    .map_err(|_| anyhow!("the process registry stopped"))
}
