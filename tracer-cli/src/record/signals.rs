//! SIGINT, SIGTERM and SIGHUP as stop requests: caught from the moment they are installed, so a
//! Ctrl-C during set-up still ends in a flushed session.

use std::sync::mpsc::Sender;

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
    let (mut int, mut term, mut hup) = {
        let _entered = runtime.enter();
        (
            signal(SignalKind::interrupt()).context("install the SIGINT handler")?,
            signal(SignalKind::terminate()).context("install the SIGTERM handler")?,
            signal(SignalKind::hangup()).context("install the SIGHUP handler")?,
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
