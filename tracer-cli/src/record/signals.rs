//! SIGINT, SIGTERM and SIGHUP as stop requests: caught from the moment they are installed, so a
//! Ctrl-C during set-up still ends in a flushed session. SIGUSR1 and SIGUSR2: root asking
//! `--allocator auto` to arm PyTorch's allocator probes in every traced process, and to stop
//! asking (only root, or tracer's own user, may signal it).

use std::sync::{atomic::Ordering, mpsc::Sender};

use anyhow::{Context as _, Result};

use super::session::Stop;

/// Catches the three signals on a thread of its own; each one becomes a [`Stop`] sent to `tx`.
pub fn stop_on_signals(tx: Sender<Stop>) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the signal handler's event loop")?;
    // Registered here, before any set-up, not on the thread (which might start late).
    let (mut int, mut term, mut hup, mut usr1, mut usr2) = {
        let _entered = runtime.enter();
        (
            signal(SignalKind::interrupt()).context("install the SIGINT handler")?,
            signal(SignalKind::terminate()).context("install the SIGTERM handler")?,
            signal(SignalKind::hangup()).context("install the SIGHUP handler")?,
            signal(SignalKind::user_defined1()).context("install the SIGUSR1 handler")?,
            signal(SignalKind::user_defined2()).context("install the SIGUSR2 handler")?,
        )
    };
    std::thread::Builder::new()
        .name("tracer-signals".into())
        .spawn(move || {
            runtime.block_on(async move {
                loop {
                    let stop = tokio::select! {
                        _ = int.recv() => Stop::signal("interrupted (SIGINT)"),
                        _ = term.recv() => Stop::signal("terminated (SIGTERM)"),
                        _ = hup.recv() => Stop::signal("terminated (SIGHUP)"),
                        _ = usr1.recv() => {
                            super::arming::ON_DEMAND.store(1, Ordering::SeqCst);
                            continue;
                        }
                        _ = usr2.recv() => {
                            super::arming::ON_DEMAND.store(2, Ordering::SeqCst);
                            continue;
                        }
                    };
                    if tx.send(stop).is_err() {
                        return;
                    }
                }
            })
        })
        .context("start the signal thread")?;
    Ok(())
}
