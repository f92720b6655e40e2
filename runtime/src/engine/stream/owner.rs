//! The stream's owner: the process holding a session-level advisory lock, on a
//! connection of its own, for one (handler, stream). Only the owner consumes; the
//! others try every second and take over once its session ends. With several
//! streams per handler ([`Share`]), a process tries only while it owns fewer than
//! its share, and gives one up when it owns more.

use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncPgConnection, SimpleAsyncConnection};
use tokio_util::sync::CancellationToken;

use super::share::Share;
use super::StreamSpec;
use crate::store::db;

/// How often a waiting consumer tries the lock, and waits after a failed connection.
const RETRY: Duration = Duration::from_secs(1);

/// How long the lock's connection may take to answer a check.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The held lock: released when this is dropped (its connection closes).
pub(super) struct Owner {
    conn: AsyncPgConnection,
    /// The handler's share this stream counts in, while it does.
    share: Option<Arc<Share>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(share) = self.share.take() {
            share.released();
        }
    }
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
        if let Some(share) = &spec.share {
            tokio::select! {
                () = stop.cancelled() => return None,
                () = share.counted() => {}
            }
        }
        loop {
            let attempt = async {
                let mut conn = db::connect(url).await.map_err(|err| err.report())?;
                loop {
                    let reserved = match &spec.share {
                        Some(share) if !share.reserve() => {
                            if !std::mem::replace(&mut said, true) {
                                crate::base::log::info!(stream = spec.stream(), handler = spec.handler.name(), streams = share.streams(), "this process owns its share of the handler's streams; waiting for that to change");
                            }
                            tokio::time::sleep(RETRY).await;
                            continue;
                        }
                        share => Reserved(share.clone()),
                    };
                    match db::try_lock(&mut conn, lock).await {
                        Ok(true) => return Ok(Self { conn, share: reserved.keep() }),
                        Ok(false) => {
                            drop(reserved);
                            if !std::mem::replace(&mut said, true) {
                                crate::base::log::info!(stream = spec.stream(), handler = spec.handler.name(), "another process consumes this stream for this handler; waiting to take over");
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
                        crate::base::log::info!(stream = spec.stream(), handler = spec.handler.name(), "this process owns the stream for this handler");
                        return Some(owner);
                    }
                    Err(reason) => reason,
                },
            };
            crate::base::log::warn!(stream = spec.stream(), handler = spec.handler.name(), reason = %failed, "cannot take the stream's lock (database unreachable); trying again");
            tokio::select! {
                () = stop.cancelled() => return None,
                () = tokio::time::sleep(RETRY) => {}
            }
        }
    }

    /// Whether this stream should go to another process (this one owns more than
    /// its share): if so, it no longer counts in the share, and the caller drops
    /// the owner once its subscription has ended.
    pub(super) fn give_way(&mut self) -> bool {
        match &self.share {
            Some(share) if share.give_up_one() => {
                self.share = None;
                true
            }
            _ => false,
        }
    }

    /// Whether the lock's connection still answers (and so its session holds the
    /// lock).
    pub(super) async fn alive(&mut self) -> bool {
        matches!(tokio::time::timeout(CHECK_TIMEOUT, self.conn.batch_execute("SELECT 1")).await, Ok(Ok(())))
    }
}

/// A place in the handler's share, taken for one try of a stream's lock: given back
/// when dropped, unless the lock was got and the owner [keeps](Self::keep) it.
struct Reserved(Option<Arc<Share>>);

impl Reserved {
    fn keep(mut self) -> Option<Arc<Share>> {
        self.0.take()
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(share) = self.0.take() {
            share.released();
        }
    }
}
