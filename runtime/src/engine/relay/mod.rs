//! The outbox relay: publishes committed outbox rows, at least once, each with one
//! stable `message_id`.
//!
//! ```text
//! wake (in-process signal | NOTIFY idemq_outbox | poll interval)
//!   └─ BEGIN ─ SELECT … FOR UPDATE SKIP LOCKED (due rows, oldest first, ≤ batch)
//!        ├─ an expired reply?  → DELETE, never published (counted, one warning per pass)
//!        ├─ exchange missing?  → postponed with backoff (never published: a publish to a
//!        │                        missing exchange would close the channel)
//!        ├─ publish all, pipelined (mandatory unless best effort), await the confirms
//!        │    ├─ confirmed and routed → DELETE
//!        │    ├─ returned (unroutable) / nacked → postponed with backoff, error kept
//!        │    │    (after a nack the next pass publishes on a fresh channel; a reply
//!        │    │    no later than it expires)
//!        │    └─ channel lost → left as they are (the transaction's end unlocks them)
//!        └─ COMMIT
//! ```
//!
//! A reply expires ([`RelayBuilder::reply_ttl`]); an event never does. A reply to a
//! `reply_to` queue that is gone — auto-delete and exclusive reply queues go away with
//! their client — is returned (312 NO_ROUTE) on every publish and would otherwise be
//! retried for ever, every `max_backoff`, with a warning each time.
//!
//! A crash after the broker confirmed and before COMMIT publishes the row again: the
//! downstream dedup (keyed on the message id, or on the body's key) absorbs it.
//! Several relays may run at once (one per runtime process, or on their own): `SKIP
//! LOCKED` hands each row to one of them at a time. No order is promised, not even per
//! aggregate: rows are claimed in id order, and ids are assigned at insert, not at
//! commit; a postponed row goes out after later ones.
//!
//! Wake-ups never cost the handlers' transactions a `NOTIFY`: the runtime's own relay
//! is woken in-process after each COMMIT that wrote rows; a runtime whose relay is
//! off sends `NOTIFY idemq_outbox` at most once per [`NOTIFY_INTERVAL`], outside any
//! transaction. A relay listens on a dedicated connection; a silently dead socket
//! would leave it waiting forever, so it polls as well.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use futures_util::StreamExt;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation, Connection, ExchangeKind};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::base::backoff::Backoff;
use crate::base::observe::{Observe, Observers, RelayPass};
use crate::config::EnvUrls;
use crate::config::{DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL};
use crate::error::{redact, Error};
use crate::store::db::{self, OutboxRow, SessionLimits};

use crate::store::db::CHANNEL;

/// The shortest time between two `NOTIFY`s of one runtime.
pub(crate) const NOTIFY_INTERVAL: Duration = Duration::from_millis(50);

/// How long a relay waits for the broker to confirm a publish.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a stopping relay keeps publishing what is due.
const FINAL_PASS: Duration = Duration::from_secs(5);

/// How long a reply may wait in the outbox by default (see [`RelayBuilder::reply_ttl`]).
const DEFAULT_REPLY_TTL: Duration = Duration::from_secs(3600);

/// Configures a [`Relay`] run on its own (a runtime runs one by default; see
/// [`RuntimeBuilder::relay`](crate::RuntimeBuilder::relay)).
///
/// [`build`](Self::build) is infallible, unlike
/// [`RuntimeBuilder::build`](crate::RuntimeBuilder::build): a relay's settings are
/// few and independent, and [`Relay::run`] checks them before it connects, with the
/// same [`Error::Config`] (as it checks the environment's URLs).
#[derive(Clone)]
#[must_use = "a RelayBuilder does nothing until `.build()` and `Relay::run`: a setting whose result is dropped is lost"]
pub struct RelayBuilder {
    amqp_url: String,
    database_url: String,
    /// A problem reading `AMQP_URL(_FILE)` or `DATABASE_URL(_FILE)`, for `run()`.
    env_urls: EnvUrls,
    settings: Settings,
    observers: Observers,
}

impl std::fmt::Debug for RelayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("amqp_url", &redact(&self.amqp_url))
            .field("database_url", &redact(&self.database_url))
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// What a relay's loop needs besides its connections.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) poll_interval: Duration,
    pub(crate) batch_size: usize,
    pub(crate) max_backoff: Duration,
    /// How long a reply row may wait before it is deleted unpublished.
    pub(crate) reply_ttl: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(1),
            batch_size: 256,
            max_backoff: Duration::from_secs(60),
            reply_ttl: DEFAULT_REPLY_TTL,
        }
    }
}

impl Settings {
    /// Refuses what the relay's loop cannot run with.
    fn check(&self) -> Result<(), Error> {
        if self.batch_size == 0 {
            return Err(Error::Config(
                "the relay's batch_size must be at least 1, not 0: give `.batch_size(1)` or more (default 256)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Sets the reply TTL, at least [`MIN_REPLY_WINDOW`](crate::base::outgoing::MIN_REPLY_WINDOW).
    pub(crate) fn set_reply_ttl(&mut self, ttl: Duration) {
        self.reply_ttl = ttl.max(crate::base::outgoing::MIN_REPLY_WINDOW);
    }
}

impl RelayBuilder {
    /// The broker (default: `AMQP_URL`, or the file `AMQP_URL_FILE` names, else
    /// [`DEFAULT_AMQP_URL`]).
    pub fn amqp_url(mut self, url: impl Into<String>) -> Self {
        self.amqp_url = url.into();
        self.env_urls.overridden("AMQP_URL");
        self
    }

    /// The database holding `idemq_outbox` (default: `DATABASE_URL`, or the file
    /// `DATABASE_URL_FILE` names, else [`DEFAULT_DATABASE_URL`]).
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.database_url = url.into();
        self.env_urls.overridden("DATABASE_URL");
        self
    }

    /// How often the relay looks for rows without being woken (default 1 s).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.settings.poll_interval = interval;
        self
    }

    /// The most rows one pass claims and publishes (default 256; at least 1:
    /// [`Relay::run`] refuses 0).
    pub fn batch_size(mut self, size: usize) -> Self {
        self.settings.batch_size = size;
        self
    }

    /// The longest a row that failed to publish waits before the next try (default
    /// 60 s; the wait doubles per failure from 100 ms).
    pub fn max_backoff(mut self, max: Duration) -> Self {
        self.settings.max_backoff = max;
        self
    }

    /// How long the reply to a request may wait in the outbox before it is deleted
    /// unpublished (default 1 h; at least 1 s; `Duration::MAX`: never), counted from
    /// when its transaction wrote it. A request with an AMQP `expiration` expires its
    /// reply sooner: that long after the request was consumed, when its requester has
    /// stopped waiting. Events never expire.
    ///
    /// A reply that cannot be delivered — its `reply_to` queue is gone, as auto-delete
    /// and exclusive reply queues go with their client — would otherwise stay in the
    /// outbox for ever, retried every [`max_backoff`](Self::max_backoff) with a
    /// warning each time. The default outlasts the timeouts requesters wait with
    /// (seconds to minutes) and a broker outage or relay restart a reply should ride
    /// out, and bounds a stuck reply to about 70 tries (the backoff doubles from
    /// 100 ms to 60 s). Each expired reply is counted ([`RelayPass::expired`], the
    /// metric `idemq_outbox_replies_expired_total`), and a pass that deletes some logs
    /// one warning. Several relays on one outbox each apply their own: give them the
    /// same.
    pub fn reply_ttl(mut self, ttl: Duration) -> Self {
        self.settings.set_reply_ttl(ttl);
        self
    }

    /// Adds a subscriber told of every pass that claimed rows ([`Observe::relay`]).
    pub fn observe(mut self, observer: impl Observe) -> Self {
        self.observers.push(std::sync::Arc::new(observer));
        self
    }

    /// The relay. Infallible: [`Relay::run`] checks the settings (see the type's docs).
    pub fn build(self) -> Relay {
        Relay { builder: self }
    }
}

/// Publishes the outbox (see the module docs): runs inside every
/// [`Runtime`](crate::Runtime) unless turned off, or on its own:
///
/// ```no_run
/// # async fn example() -> Result<(), idemq::Error> {
/// idemq::Relay::builder().build().run(idemq::shutdown_signal()).await
/// # }
/// ```
#[derive(Debug)]
pub struct Relay {
    builder: RelayBuilder,
}

impl Relay {
    /// A builder reading `AMQP_URL` and `DATABASE_URL` (or the files `AMQP_URL_FILE`
    /// and `DATABASE_URL_FILE` name, see [`env_url`](crate::env_url); a problem with
    /// them is reported by [`Relay::run`]).
    pub fn builder() -> RelayBuilder {
        let mut env_urls = EnvUrls::default();
        RelayBuilder {
            amqp_url: env_urls.read("AMQP_URL", DEFAULT_AMQP_URL),
            database_url: env_urls.read("DATABASE_URL", DEFAULT_DATABASE_URL),
            env_urls,
            settings: Settings::default(),
            observers: Observers::default(),
        }
    }

    /// Publishes until `shutdown` is cancelled, then publishes what is due for a
    /// few more seconds and closes its connections. Broker and database faults are
    /// retried with backoff.
    ///
    /// # Errors
    /// Start-up failures: the database unreachable, idemq's migrations not applied;
    /// [`Error::Config`] for a URL the environment gave twice or in an unreadable file,
    /// or a [`batch_size`](RelayBuilder::batch_size) of 0 (checked before connecting).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let RelayBuilder { amqp_url, database_url, env_urls, settings, observers } = self.builder;
        env_urls.check()?;
        settings.check()?;
        let pool = relay_pool(&database_url)?;
        let connect_error = |message: String| Error::DatabaseConnect { url: redact(&database_url), message };
        let mut conn = pool.get().await.map_err(|err| connect_error(err.to_string()))?;
        if let Some(problem) = crate::store::migrate::check_schema(&mut conn)
            .await
            .map_err(|err| connect_error(err.to_string()))?
        {
            return Err(problem.into());
        }
        drop(conn);
        let brokers = crate::broker::brokers::Brokers::parse(&amqp_url)?;
        let worker =
            Worker { pool, brokers, database_url, settings, wake: Arc::new(Notify::new()), observers };
        worker.run(shutdown).await;
        Ok(())
    }
}

/// The relay's own small pool: one connection for passes, one spare.
pub(crate) fn relay_pool(database_url: &str) -> Result<Pool<AsyncPgConnection>, Error> {
    db::build_pool(database_url, 2, SessionLimits::for_handler_timeout(CONFIRM_TIMEOUT))
        .map_err(|err| Error::DatabaseConnect { url: redact(database_url), message: err.to_string() })
}

/// How a runtime tells relays that rows were committed.
pub(crate) struct OutboxSignal {
    /// Its own relay's wake-up, if it runs one.
    pub(crate) wake: Option<Arc<Notify>>,
    /// Set after a commit that wrote rows; sent as one `NOTIFY` per interval when
    /// there is no relay in-process.
    pending: AtomicBool,
}

impl OutboxSignal {
    pub(crate) fn new(wake: Option<Arc<Notify>>) -> Self {
        Self { wake, pending: AtomicBool::new(false) }
    }

    /// Rows were committed.
    pub(crate) fn committed(&self) {
        match &self.wake {
            Some(wake) => wake.notify_one(),
            None => self.pending.store(true, Ordering::Relaxed),
        }
    }

    /// Sends the pending `NOTIFY`s (at most one per [`NOTIFY_INTERVAL`]) until `stop`.
    pub(crate) async fn notify_elsewhere(&self, pool: Pool<AsyncPgConnection>, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(NOTIFY_INTERVAL) => {}
                () = stop.cancelled() => return,
            }
            if self.pending.swap(false, Ordering::Relaxed) {
                let notified = async {
                    let mut conn = pool.get().await.map_err(|err| err.to_string())?;
                    db::notify_relays(&mut conn).await.map_err(|err| err.to_string())
                };
                if let Err(error) = notified.await {
                    // The relays poll as well: a lost wake-up only delays.
                    tracing::debug!(%error, "could not notify the outbox relays");
                }
            }
        }
    }
}

/// A relay's loop and what it needs.
pub(crate) struct Worker {
    pub(crate) pool: Pool<AsyncPgConnection>,
    /// The broker addresses, tried in turn (the one last lost, last).
    pub(crate) brokers: crate::broker::brokers::Brokers,
    pub(crate) database_url: String,
    pub(crate) settings: Settings,
    pub(crate) wake: Arc<Notify>,
    pub(crate) observers: Observers,
}

/// The relay's broker connection and what it learned on it.
struct Link {
    connection: Connection,
    /// The broker address it is connected to.
    node: usize,
    channel: Channel,
    /// For passive exchange checks (a failed one closes its channel).
    probe: Option<Channel>,
    /// Exchanges known to exist on this connection.
    exchanges: HashSet<String>,
}

/// A channel on `connection` in confirm mode, for publishing.
async fn confirm_channel(connection: &Connection) -> Result<Channel, String> {
    let channel = connection.create_channel().await.map_err(|err| err.to_string())?;
    channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(|err| err.to_string())?;
    Ok(channel)
}

impl Link {
    /// Replaces the publishing channel with a fresh one in confirm mode; the old one
    /// is closed (bounded). `Err`: the connection failed.
    async fn reopen_channel(&mut self) -> Result<(), String> {
        let channel = confirm_channel(&self.connection).await?;
        let old = std::mem::replace(&mut self.channel, channel);
        let _ =
            tokio::time::timeout(Duration::from_secs(2), old.close(200, "nacked: reopening".into())).await;
        tracing::debug!("outbox relay: publishes were nacked; publishing on a fresh channel");
        Ok(())
    }
}

/// A fault the relay waits out.
struct Fault {
    what: &'static str,
    error: String,
}

impl Fault {
    /// Logs it (once per change of fault) and waits out the backoff or `stop`.
    /// `false`: the relay is finishing (stopping), give up now.
    async fn wait(
        self,
        last_error: &mut Option<String>,
        backoff: &mut Backoff,
        stop: &CancellationToken,
        finishing: bool,
    ) -> bool {
        if last_error.as_deref() != Some(self.error.as_str()) {
            tracing::warn!(error = %self.error, "outbox relay: {}; retrying", self.what);
            *last_error = Some(self.error);
        }
        if finishing {
            return false;
        }
        tokio::select! {
            () = backoff.wait() => {}
            () = stop.cancelled() => {}
        }
        true
    }
}

/// What one pass did.
struct Pass {
    claimed: usize,
    published: usize,
    postponed: usize,
    /// Replies deleted unpublished, and the first's details (logged once committed).
    expired: usize,
    first_expired: Option<Expired>,
    /// The broker connection failed during the pass: reconnect.
    lost: Option<String>,
}

/// An expired reply, as its warning shows it.
struct Expired {
    message_id: String,
    reply_to: String,
    correlation_id: Option<String>,
    attempts: i32,
    last_error: Option<String>,
}

impl Pass {
    fn empty() -> Self {
        Self { claimed: 0, published: 0, postponed: 0, expired: 0, first_expired: None, lost: None }
    }
}

impl Worker {
    /// Publishes until `stop`, then for at most [`FINAL_PASS`] more.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let listening = CancellationToken::new();
        let listener =
            tokio::spawn(listen(self.database_url.clone(), Arc::clone(&self.wake), listening.clone()));
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        let mut last_error: Option<String> = None;
        let mut link: Option<Link> = None;
        let mut final_until: Option<Instant> = None;
        loop {
            if final_until.is_none() && stop.is_cancelled() {
                final_until = Some(Instant::now() + FINAL_PASS);
            }
            if final_until.is_some_and(|until| Instant::now() >= until) {
                break;
            }
            // Once stopping, nothing may take longer than what is left of the final pass.
            let left =
                final_until.map_or(Duration::MAX, |until| until.saturating_duration_since(Instant::now()));
            let current = match &mut link {
                Some(current) => current,
                None => match self.connect_until(left, &stop, final_until.is_some()).await {
                    // Stop came first: the final pass begins (and may connect again).
                    None => continue,
                    Some(Ok(connected)) => {
                        backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
                        last_error = None;
                        link.insert(connected)
                    }
                    Some(Err(error)) => {
                        let fault = Fault { what: "cannot reach the broker", error };
                        if !fault.wait(&mut last_error, &mut backoff, &stop, final_until.is_some()).await {
                            break;
                        }
                        continue;
                    }
                },
            };
            let Ok(pass) = tokio::time::timeout(left, self.pass(current)).await else {
                // Cut off while stopping: the pass's transaction rolls back when the
                // relay's pool closes; its rows stay for the next relay.
                break;
            };
            if let Ok(Pass { claimed, published, postponed, expired, .. }) = &pass {
                if *claimed > 0 {
                    self.observers.relay(&RelayPass {
                        claimed: *claimed,
                        published: *published,
                        postponed: *postponed,
                        expired: *expired,
                    });
                }
            }
            let claimed = match pass {
                Ok(Pass { lost: Some(reason), .. }) => {
                    tracing::warn!(reason = %redact(&reason), "outbox relay: broker connection lost; reconnecting");
                    if let Some(old) = link.take() {
                        // The next connection starts with the next address.
                        self.brokers.lost(old.node);
                        let _ = tokio::time::timeout(
                            Duration::from_secs(2),
                            old.connection.close(200, "reconnecting".into()),
                        )
                        .await;
                    }
                    continue;
                }
                Ok(Pass { claimed, lost: None, .. }) => claimed,
                Err(error) => {
                    let fault = Fault { what: "database fault", error: redact(&error) };
                    if !fault.wait(&mut last_error, &mut backoff, &stop, final_until.is_some()).await {
                        break;
                    }
                    continue;
                }
            };
            if claimed >= self.settings.batch_size {
                continue;
            }
            if final_until.is_some() {
                break;
            }
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(self.settings.poll_interval) => {}
                () = stop.cancelled() => {}
            }
        }
        listening.cancel();
        let _ = listener.await;
        if let Some(link) = link {
            let _ = tokio::time::timeout(Duration::from_secs(2), link.channel.close(200, "shutdown".into()))
                .await;
            let _ =
                tokio::time::timeout(Duration::from_secs(2), link.connection.close(200, "shutdown".into()))
                    .await;
        }
    }

    /// [`Self::connect`], for at most `left`; before the final pass, also cut short
    /// by `stop` (`None`: the loop then starts the final pass, bounded by
    /// [`FINAL_PASS`]) — a broker that does not answer must not hold a shutdown for
    /// the connect timeout.
    async fn connect_until(
        &self,
        left: Duration,
        stop: &CancellationToken,
        stopping: bool,
    ) -> Option<Result<Link, String>> {
        let connect = async {
            tokio::time::timeout(left, self.connect()).await.unwrap_or_else(|_| Err("stopping".into()))
        };
        if stopping {
            return Some(connect.await);
        }
        tokio::select! {
            connected = connect => Some(connected),
            () = stop.cancelled() => None,
        }
    }

    async fn connect(&self) -> Result<Link, String> {
        let connect = async {
            let (connection, node) =
                self.brokers.connect("relay").await.map_err(|err| redact(&err.to_string()))?;
            let channel = confirm_channel(&connection).await?;
            Ok(Link { connection, node, channel, probe: None, exchanges: HashSet::new() })
        };
        tokio::time::timeout(Duration::from_secs(30), connect)
            .await
            .unwrap_or_else(|_| Err("connecting took over 30 s".to_owned()))
    }

    /// Claims due rows, publishes them and records what the broker said, in one
    /// transaction. `Err`: the database failed (nothing recorded; the rows stay).
    async fn pass(&self, link: &mut Link) -> Result<Pass, String> {
        let mut conn = self.pool.get().await.map_err(|err| err.to_string())?;
        let limit = i64::try_from(self.settings.batch_size).unwrap_or(i64::MAX);
        let Settings { max_backoff, reply_ttl, .. } = self.settings;
        let result = conn
            .transaction::<Pass, diesel::result::Error, _>(async |conn| {
                let claimed = db::claim_outbox(conn, limit, reply_ttl).await?;
                if claimed.is_empty() {
                    return Ok(Pass::empty());
                }
                let claimed_count = claimed.len();
                // Expired replies go without a publish: their requester stopped waiting.
                let (expired, rows): (Vec<OutboxRow>, Vec<OutboxRow>) =
                    claimed.into_iter().partition(|row| row.expired);
                let (results, lost) = publish_all(link, &rows).await;
                let (mut sent, mut postponed) = (Vec::new(), 0);
                let mut first_error: Option<(String, String)> = None;
                for (row, result) in rows.iter().zip(&results) {
                    match result {
                        Some(Ok(())) => sent.push(row.id),
                        Some(Err(error)) if !row.mandatory => {
                            // Best effort (direct reply-to): never retried.
                            tracing::warn!(message_id = %row.message_id, routing_key = %row.routing_key, %error, "outbox relay: a best-effort reply could not be published; dropped");
                            sent.push(row.id);
                        }
                        Some(Err(error)) => {
                            let delay = retry_delay(row.attempts, max_backoff);
                            // One line per row at debug; the pass says it once at warn.
                            tracing::debug!(message_id = %row.message_id, exchange = %row.exchange, routing_key = %row.routing_key, attempts = row.attempts + 1, ?delay, %error, "outbox relay: could not publish; it stays in the outbox and is retried");
                            if first_error.is_none() {
                                first_error = Some((row.message_id.clone(), error.clone()));
                            }
                            db::postpone_outbox(conn, row.id, delay, error, reply_ttl).await?;
                            postponed += 1;
                        }
                        // Unknown (the connection went): left for the next pass.
                        None => {}
                    }
                }
                let published = sent.len();
                for row in &expired {
                    tracing::debug!(message_id = %row.message_id, reply_to = %row.routing_key, correlation_id = ?row.correlation_id, attempts = row.attempts, last_error = ?row.last_error, "outbox relay: a reply expired before it could be delivered; deleted unpublished");
                }
                sent.extend(expired.iter().map(|row| row.id));
                db::delete_outbox(conn, &sent).await?;
                if let Some((message_id, error)) = first_error {
                    tracing::warn!(postponed, %message_id, %error, "outbox relay: rows could not be published; they stay in the outbox and are retried with backoff (the first's error shown; RUST_LOG=idemq::relay=debug lists each)");
                }
                let first_expired = expired.first().map(|row| Expired {
                    message_id: row.message_id.clone(),
                    reply_to: row.routing_key.clone(),
                    correlation_id: row.correlation_id.clone(),
                    attempts: row.attempts,
                    last_error: row.last_error.clone(),
                });
                Ok(Pass {
                    claimed: claimed_count,
                    published,
                    postponed,
                    expired: expired.len(),
                    first_expired,
                    lost,
                })
            })
            .await;
        let pass = result.map_err(|err| err.to_string())?;
        // Once committed: each reply is deleted, and warned of, once.
        if let Some(first) = &pass.first_expired {
            tracing::warn!(
                expired = pass.expired,
                message_id = %first.message_id,
                reply_to = %first.reply_to,
                correlation_id = ?first.correlation_id,
                attempts = first.attempts,
                last_error = ?first.last_error,
                reply_ttl = ?reply_ttl,
                "outbox relay: replies expired before they could be delivered (older than the reply TTL, or past their request's expiration: the requester stopped waiting); deleted unpublished (the first shown; RUST_LOG=idemq::relay=debug lists each)"
            );
        }
        Ok(pass)
    }
}

/// Publishes `rows` pipelined and awaits their confirms. Per row: `Some(Ok)` confirmed
/// (and routed, if mandatory), `Some(Err)` refused, `None` unknown (connection lost,
/// then also the reason).
async fn publish_all(
    link: &mut Link,
    rows: &[OutboxRow],
) -> (Vec<Option<Result<(), String>>>, Option<String>) {
    let mut results: Vec<Option<Result<(), String>>> = rows.iter().map(|_| None).collect();
    let mut confirms = Vec::with_capacity(rows.len());
    let mut lost = None;
    let mut nacked = false;
    for (index, row) in rows.iter().enumerate() {
        match exchange_exists(link, &row.exchange).await {
            Ok(true) => {}
            Ok(false) => {
                results[index] = Some(Err(format!(
                    "exchange '{}' does not exist; declare it (the message stays in the outbox)",
                    row.exchange
                )));
                continue;
            }
            Err(reason) => {
                lost = Some(reason);
                break;
            }
        }
        let properties = properties(row);
        let options = BasicPublishOptions { mandatory: row.mandatory, ..BasicPublishOptions::default() };
        match link
            .channel
            .basic_publish(
                row.exchange.as_str().into(),
                row.routing_key.as_str().into(),
                options,
                &row.body,
                properties,
            )
            .await
        {
            Ok(confirm) => confirms.push((index, confirm)),
            Err(err) => {
                lost = Some(err.to_string());
                break;
            }
        }
    }
    for (index, confirm) in confirms {
        let row = &rows[index];
        results[index] = match tokio::time::timeout(CONFIRM_TIMEOUT, confirm).await {
            Ok(Ok(Confirmation::Ack(None) | Confirmation::NotRequested)) => Some(Ok(())),
            Ok(Ok(Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => Some(Err(format!(
                "unroutable: no queue is bound to exchange '{}' with routing key '{}' (returned, mandatory)",
                row.exchange, row.routing_key
            ))),
            Ok(Ok(Confirmation::Nack(None))) => {
                nacked = true;
                Some(Err("the broker refused it (nack)".to_owned()))
            }
            Ok(Err(err)) => {
                lost.get_or_insert_with(|| err.to_string());
                None
            }
            Err(_) => {
                lost.get_or_insert_with(|| format!("no confirm within {CONFIRM_TIMEOUT:?}"));
                None
            }
        };
    }
    // A nack is the broker refusing on *this channel*, and on RabbitMQ 3.10 a channel
    // that first published to a quorum queue while it was electing a new leader
    // (a relay that reconnected right after losing the leader's node) is nacked for
    // good — seen on a cluster: the outbox stopped draining until a restart. The
    // nacked rows are postponed as usual; the next pass publishes on a fresh channel.
    if nacked && lost.is_none() {
        if let Err(reason) = link.reopen_channel().await {
            lost = Some(reason);
        }
    }
    // The connection or channel failed: the first row left unknown is postponed (it
    // may be what closed the channel — too large, say — and would otherwise come
    // first in every pass, holding up every row behind it). If the broker had it,
    // it goes out once more under its id: at least once, as always.
    if let Some(reason) = &lost {
        if let Some(first) = results.iter_mut().find(|result| result.is_none()) {
            *first = Some(Err(format!("the channel failed while it was being published: {reason}")));
        }
    }
    (results, lost)
}

/// Whether `exchange` exists (the default exchange always does), checked passively
/// on a probe channel once per connection. `Err`: the connection failed.
async fn exchange_exists(link: &mut Link, exchange: &str) -> Result<bool, String> {
    if exchange.is_empty() || link.exchanges.contains(exchange) {
        return Ok(true);
    }
    let probe = match &link.probe {
        Some(probe) if probe.status().connected() => probe.clone(),
        _ => {
            let probe = link.connection.create_channel().await.map_err(|err| err.to_string())?;
            link.probe = Some(probe.clone());
            probe
        }
    };
    let passive = ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() };
    match probe.exchange_declare(exchange.into(), ExchangeKind::Direct, passive, FieldTable::default()).await
    {
        Ok(()) => {
            link.exchanges.insert(exchange.to_owned());
            Ok(true)
        }
        Err(_) if link.connection.status().connected() => {
            // 404: the probe channel is closed; the next check opens another.
            link.probe = None;
            Ok(false)
        }
        Err(err) => Err(err.to_string()),
    }
}

fn properties(row: &OutboxRow) -> lapin::BasicProperties {
    let headers =
        row.headers.as_deref().and_then(|headers| serde_json::from_str(headers).ok()).unwrap_or_default();
    crate::base::outgoing::properties(
        &row.message_id,
        row.content_type.as_deref(),
        row.correlation_id.as_deref(),
        &headers,
    )
}

/// 100 ms, doubling per failure, at most `max`.
fn retry_delay(attempts: i32, max: Duration) -> Duration {
    let exponent = u32::try_from(attempts.clamp(0, 20)).unwrap_or(20);
    Duration::from_millis(100).saturating_mul(2_u32.saturating_pow(exponent)).min(max)
}

/// Forwards `NOTIFY idemq_outbox` to `wake`, on a dedicated connection (never a
/// pooled one: a pool would hand the listening session to a handler), reconnecting
/// with backoff. Polling covers the gaps.
async fn listen(database_url: String, wake: Arc<Notify>, stop: CancellationToken) {
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
    loop {
        let listening = async {
            let mut conn = db::establish(&database_url).await.map_err(|err| err.to_string())?;
            conn.batch_execute(&format!("LISTEN {CHANNEL}")).await.map_err(|err| err.to_string())?;
            let mut notifications = std::pin::pin!(conn.notifications_stream());
            while let Some(notification) = notifications.next().await {
                notification.map_err(|err| err.to_string())?;
                wake.notify_one();
            }
            Err::<(), String>("the notification stream ended".to_owned())
        };
        tokio::select! {
            result = listening => {
                if let Err(error) = result {
                    tracing::debug!(error = %redact(&error), "outbox relay: LISTEN connection lost; polling meanwhile");
                }
            }
            () = stop.cancelled() => return,
        }
        tokio::select! {
            () = backoff.wait() => {}
            () = stop.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_rows_back_off_doubling_up_to_the_bound() {
        let max = Duration::from_secs(60);
        assert_eq!(retry_delay(0, max), Duration::from_millis(100));
        assert_eq!(retry_delay(3, max), Duration::from_millis(800));
        assert_eq!(retry_delay(30, max), max);
    }

    #[tokio::test]
    async fn a_batch_size_of_zero_is_refused_with_the_fix_before_connecting() {
        // Nothing listens on port 1: the refusal must come before any connection.
        let relay = Relay::builder()
            .amqp_url("amqp://guest:guest@127.0.0.1:1/%2f")
            .database_url("postgres://postgres@127.0.0.1:1/idemq")
            .batch_size(0)
            .build();
        match relay.run(CancellationToken::new()).await {
            Err(Error::Config(message)) => {
                assert!(message.contains("not 0") && message.contains(".batch_size(1)"), "{message}");
            }
            other => panic!("expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn debug_redacts_the_urls() {
        let builder = Relay::builder()
            .amqp_url("amqp://guest:secret@127.0.0.1:5672/%2f")
            .database_url("postgres://postgres:secret@127.0.0.1:5432/idemq");
        let printed = format!("{builder:?}");
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("127.0.0.1:5672"), "{printed}");
    }
}
