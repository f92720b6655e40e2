//! The stream's owner: the process holding a session-level advisory lock, on a
//! connection of its own, for one (handler, stream). Only the owner consumes; the
//! others try every second and take over once its session ends.

use std::time::Duration;

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use tokio_util::sync::CancellationToken;

use super::StreamSpec;
use crate::store::db;

/// How often a waiting consumer tries the lock, and waits after a failed connection.
const RETRY: Duration = Duration::from_secs(1);

/// How long the lock's connection may take to answer a check.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The held lock: released when this is dropped (its connection closes).
pub(super) struct Owner {
    conn: AsyncPgConnection,
}

impl Owner {
    /// Waits until this process holds `lock`; `None` if `stop` came first.
    pub(super) async fn acquire(
        url: &str,
        lock: i64,
        spec: &StreamSpec,
        stop: &CancellationToken,
    ) -> Option<Self> {
        let mut said = false;
        loop {
            let attempt = async {
                let mut conn = db::connect(url).await.map_err(|err| err.report())?;
                loop {
                    match db::try_lock(&mut conn, lock).await {
                        Ok(true) => return Ok(Self { conn }),
                        Ok(false) => {
                            if !std::mem::replace(&mut said, true) {
                                tracing::info!(stream = spec.stream(), handler = spec.handler.name(), "another process consumes this stream for this handler; waiting to take over");
                            }
                            tokio::time::sleep(RETRY).await;
                        }
                        Err(err) => return Err(err.to_string()),
                    }
                }
            };
            let failed = tokio::select! {
                () = stop.cancelled() => return None,
                attempt = attempt => match attempt {
                    Ok(owner) => {
                        tracing::info!(stream = spec.stream(), handler = spec.handler.name(), "this process owns the stream for this handler");
                        return Some(owner);
                    }
                    Err(reason) => reason,
                },
            };
            tracing::warn!(stream = spec.stream(), handler = spec.handler.name(), reason = %failed, "cannot take the stream's lock (database unreachable); trying again");
            tokio::select! {
                () = stop.cancelled() => return None,
                () = tokio::time::sleep(RETRY) => {}
            }
        }
    }

    /// Whether the lock's connection still answers (and so its session holds the
    /// lock).
    pub(super) async fn alive(&mut self) -> bool {
        matches!(tokio::time::timeout(CHECK_TIMEOUT, self.conn.batch_execute("SELECT 1")).await, Ok(Ok(())))
    }
}
