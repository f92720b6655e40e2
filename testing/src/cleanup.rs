//! What a test kit leaves behind, and its removal: [`Leftovers`].
//!
//! A kit makes a database, queues (the test queue, its dead-letter queue, the
//! retry wait queues) and a runtime that uses them. [`TestKit::finish`] removes them
//! gracefully; a test that panics (a failing assertion) never gets there, and a
//! `prepare` that fails part-way returns before a kit exists. [`Leftovers`] is the
//! guard that removes them then: asynchronously where the kit can await
//! ([`Leftovers::remove`]), and on `Drop` otherwise.
//!
//! # Why a thread on `Drop`
//!
//! `Drop` is synchronous, and a test's runtime may be tokio's current-thread one
//! (`#[tokio::test]`'s default): blocking its only thread on a future that needs
//! the same runtime would never finish, and `tokio::task::block_in_place` panics
//! there. So `Drop` runs the removal on a thread of its own with a small
//! current-thread runtime of its own (its own connections to PostgreSQL and
//! RabbitMQ), and joins it: the same on both flavors, inside a runtime or outside
//! one, during a panic or not. It blocks the dropping thread for the removal
//! (tens of milliseconds; at most [`REMOVE_TIMEOUT`]).
//!
//! The kit's runtime is stopped first, so it cannot declare the queues again: its
//! token is cancelled; on a multi-thread runtime, which keeps polling it, the
//! removal waits up to [`STOP_TIMEOUT`] for it to end; on a current-thread one,
//! which cannot run while its thread is blocked here, it is aborted instead (its
//! token cancelled, it ends at its next poll). `DROP DATABASE … WITH (FORCE)` ends
//! whatever connections it still holds.
//!
//! [`TestKit::finish`]: super::TestKit::finish

use std::time::Duration;

use diesel_async::RunQueryDsl;
use lapin::options::QueueDeleteOptions;
use lapin::Connection;
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The longest a removal on `Drop` waits for the kit's runtime to stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest a removal on `Drop` blocks for the queues and the database.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(20);

/// The kit's runtime, as the leftovers stop it.
pub(super) struct RunningRuntime {
    pub(super) shutdown: CancellationToken,
    pub(super) task: JoinHandle<()>,
}

/// What a test kit made and has not removed yet. Empty once removed; removed on
/// `Drop` if not (see the module docs).
pub(super) struct Leftovers {
    admin_url: String,
    amqp_url: String,
    database: Option<String>,
    queues: Vec<String>,
    runtime: Option<RunningRuntime>,
}

impl Leftovers {
    /// Nothing made yet; what is made on these services is added as it is.
    pub(super) fn new(admin_url: String, amqp_url: String) -> Self {
        Self { admin_url, amqp_url, database: None, queues: Vec::new(), runtime: None }
    }

    /// The database `name`, just created.
    pub(super) fn database(&mut self, name: &str) {
        self.database = Some(name.to_owned());
    }

    /// Queues about to be declared (deleting one that was not is no error).
    pub(super) fn queues(&mut self, names: impl IntoIterator<Item = String>) {
        for name in names {
            if !self.queues.contains(&name) {
                self.queues.push(name);
            }
        }
    }

    /// The queues, in the order they were added.
    pub(super) fn queue_names(&self) -> &[String] {
        &self.queues
    }

    /// The kit's runtime, just spawned.
    pub(super) fn runtime(&mut self, runtime: RunningRuntime) {
        self.runtime = Some(runtime);
    }

    /// Stops the runtime (waiting up to `deadline` for its drain), deletes the queues
    /// (on `broker` if it is still open, else on a new connection) and drops the
    /// database. Best effort: what cannot be removed is left, and `Drop` does not try
    /// again.
    pub(super) async fn remove(mut self, broker: Option<&Connection>, deadline: Duration) {
        let work = self.take();
        work.remove(broker, deadline).await;
    }

    /// Everything, leaving `self` empty.
    fn take(&mut self) -> Removal {
        Removal {
            admin_url: self.admin_url.clone(),
            amqp_url: self.amqp_url.clone(),
            database: self.database.take(),
            queues: std::mem::take(&mut self.queues),
            runtime: self.runtime.take(),
        }
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        let work = self.take();
        if work.is_empty() {
            return;
        }
        // A runtime that keeps polling the kit's may wait for it; a current-thread one
        // (this thread, blocked below) cannot run it: abort it, it ends at its next poll.
        let can_wait =
            matches!(Handle::try_current().map(|h| h.runtime_flavor()), Ok(RuntimeFlavor::MultiThread));
        if let Some(runtime) = &work.runtime {
            runtime.shutdown.cancel();
            if !can_wait {
                runtime.task.abort();
            }
        }
        let removal = std::thread::Builder::new().name("idemq-test-kit-cleanup".into()).spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            match runtime {
                Ok(runtime) => runtime.block_on(async move {
                    let stop = if can_wait { STOP_TIMEOUT } else { Duration::ZERO };
                    let _ = tokio::time::timeout(REMOVE_TIMEOUT, work.remove(None, stop)).await;
                }),
                Err(err) => eprintln!("idemq test kit: cannot clean up (no runtime for it: {err})"),
            }
        });
        match removal {
            Ok(thread) => {
                let _ = thread.join();
            }
            Err(err) => eprintln!("idemq test kit: cannot clean up (no thread for it: {err})"),
        }
    }
}

/// What one removal removes (moved to the thread that removes it on `Drop`).
struct Removal {
    admin_url: String,
    amqp_url: String,
    database: Option<String>,
    queues: Vec<String>,
    runtime: Option<RunningRuntime>,
}

impl Removal {
    fn is_empty(&self) -> bool {
        self.database.is_none() && self.queues.is_empty() && self.runtime.is_none()
    }

    /// Stops the runtime (waiting up to `stop` for it; `ZERO`: not at all), then
    /// deletes the queues and drops the database, saying on stderr what is left.
    async fn remove(self, broker: Option<&Connection>, stop: Duration) {
        if let Some(RunningRuntime { shutdown, task }) = self.runtime {
            shutdown.cancel();
            let abort = task.abort_handle();
            if stop.is_zero() || tokio::time::timeout(stop, task).await.is_err() {
                // Not stopped in time: it ends at its next poll, and what it holds with
                // its queues and database.
                abort.abort();
            }
        }
        if !self.queues.is_empty() {
            if let Err(err) = delete_queues(&self.amqp_url, &self.queues, broker).await {
                eprintln!("idemq test kit: queues {:?} left behind: {err}", self.queues);
            }
        }
        if let Some(database) = self.database {
            if let Err(err) = drop_database(&self.admin_url, &database).await {
                eprintln!("idemq test kit: database {database} left behind: {err}");
            }
        }
    }
}

/// Deletes `queues` on `broker` if it is still open, else on a connection of its own.
async fn delete_queues(amqp_url: &str, queues: &[String], broker: Option<&Connection>) -> Result<(), String> {
    let own;
    let connection = match broker.filter(|broker| broker.status().connected()) {
        Some(broker) => broker,
        None => {
            own = idemq_core::connect::broker(amqp_url, "test kit cleanup")
                .await
                .map_err(|err| err.report())?;
            &own
        }
    };
    let deleted = async {
        let channel = connection.create_channel().await?;
        for queue in queues {
            channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
        }
        channel.close(200, "idemq test kit: queues deleted".into()).await
    }
    .await;
    if broker.is_none_or(|broker| !std::ptr::eq(broker, connection)) {
        let _ = connection.close(200, "idemq test kit: queues deleted".into()).await;
    }
    deleted.map_err(|err| err.to_string())
}

/// Drops `database`, ending the connections still on it.
async fn drop_database(admin_url: &str, database: &str) -> Result<(), String> {
    let mut admin = idemq_core::connect::database(admin_url).await.map_err(|err| err.report())?;
    diesel::sql_query(format!("DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .map(drop)
        .map_err(|err| err.to_string())
}
