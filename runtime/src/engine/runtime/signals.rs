//! The process's shutdown signals, as tokens. Nothing here exits the process: that
//! is a binary's decision (`idemq::cli` returns exit status 130 on a second signal).

use tokio_util::sync::CancellationToken;

/// The process's shutdown signals, as tokens: the first SIGINT or SIGTERM cancels
/// `graceful` (drain, then exit), a second one `immediate` (exit now: safe, the
/// broker redelivers whatever was unacked). Nothing here exits the process — that is
/// the binary's decision (`idemq::cli` returns exit status 130 on `immediate`):
///
/// ```no_run
/// # async fn example(runtime: idemq::Runtime) -> std::process::ExitCode {
/// let signals = idemq::shutdown_signals();
/// tokio::select! {
///     result = runtime.run(signals.graceful.clone()) => match result {
///         Ok(()) => std::process::ExitCode::SUCCESS,
///         Err(_) => std::process::ExitCode::FAILURE,
///     },
///     // Dropping `run` drops the connections: the broker requeues what was unacked.
///     () = signals.immediate.cancelled() => std::process::ExitCode::from(130),
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ShutdownSignals {
    /// Cancelled by the first signal: give it to [`Runtime::run`](crate::Runtime::run).
    pub graceful: CancellationToken,
    /// Cancelled by the second signal.
    pub immediate: CancellationToken,
}

/// Listens for SIGINT and SIGTERM; see [`ShutdownSignals`]. Must be called inside a
/// Tokio runtime.
pub fn shutdown_signals() -> ShutdownSignals {
    let signals = ShutdownSignals { graceful: CancellationToken::new(), immediate: CancellationToken::new() };
    let (graceful, immediate) = (signals.graceful.clone(), signals.immediate.clone());
    // Each token is cancelled before the line that tells it: whatever becomes of the
    // log (a closed or full stderr), the signal is heeded.
    tokio::spawn(async move {
        wait_for_signal().await;
        graceful.cancel();
        crate::base::log::info!("shutting down: finishing in-flight deliveries (signal again to exit now)");
        wait_for_signal().await;
        immediate.cancel();
        crate::base::log::warn!("second signal: exiting now; unacked deliveries will be redelivered");
    });
    signals
}

/// A token cancelled by the first SIGINT or SIGTERM: give it to
/// [`Runtime::run`](crate::Runtime::run), which then drains and returns. It never
/// exits the process, and a later signal does nothing more (the drain is bounded by
/// the [shutdown deadline](crate::RuntimeBuilder::shutdown_deadline)); a binary that
/// wants a second signal to exit at once takes [`shutdown_signals`] and exits on
/// [`ShutdownSignals::immediate`].
///
/// Must be called inside a Tokio runtime.
pub fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        cancel.cancel();
        crate::base::log::info!("shutting down: finishing in-flight deliveries");
    });
    token
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
