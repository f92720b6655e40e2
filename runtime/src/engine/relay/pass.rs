//! One relay pass, in one transaction, in two halves: claim the due rows and publish
//! them pipelined ([`start`]); await the confirms, then delete, postpone or expire
//! each and commit ([`Publishing::finish`]) (the module docs' diagram).

use std::collections::HashMap;
use std::time::Duration;

use diesel::QueryResult;
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, TransactionManager};
use lapin::options::BasicPublishOptions;
use lapin::{Confirmation, PublisherConfirm};

use crate::store::db::{self, OutboxRow};

use super::error::{Refusal, RelayError};
use super::link::Link;
use super::settings::Settings;
use super::CONFIRM_TIMEOUT;

/// What one pass did.
pub(super) struct Pass {
    pub(super) claimed: usize,
    pub(super) published: usize,
    pub(super) postponed: usize,
    /// Replies deleted unpublished.
    pub(super) expired: usize,
    /// The broker nacked a publish: publish on a fresh channel from now on.
    ///
    /// A nack is the broker refusing on *this channel*, and on RabbitMQ 3.10 a channel
    /// that first published to a quorum queue while it was electing a new leader (a
    /// relay that reconnected right after losing the leader's node) is nacked for good
    /// — seen on a cluster: the outbox stopped draining until a restart. The nacked
    /// rows are postponed as usual; the next passes publish on a fresh channel.
    pub(super) nacked: bool,
    /// The broker connection failed during the pass: reconnect.
    pub(super) lost: Option<RelayError>,
}

/// What the broker said of one row: `Some(Ok)` confirmed (and routed, if mandatory),
/// `Some(Err)` refused, `None` unknown (the connection went).
type Published = Option<Result<(), Refusal>>;

/// A pass between its halves: its rows claimed in its open transaction and
/// published; their confirms not yet awaited. [`Publishing::finish`] ends it.
pub(super) struct Publishing {
    /// The pass's connection, in its transaction.
    conn: db::Pooled,
    claimed: usize,
    /// Its rows are deleted already (handed over: see [`Rows`]).
    taken: bool,
    /// Expired replies, deleted unpublished.
    expired: Vec<OutboxRow>,
    /// The rows published, or refused before publishing.
    rows: Vec<OutboxRow>,
    results: Vec<Published>,
    confirms: Vec<(usize, PublisherConfirm)>,
    lost: Option<RelayError>,
}

/// What a pass publishes: the due rows it claims from the table, or rows committed
/// in this process and handed over ([`Wake`](super::listen::Wake)), which it deletes
/// at once by id — those still there and due (one gone was published by a scan) —
/// and publishes from memory: confirmed, its COMMIT is the pass's only other
/// statement; else it rolls back, and the pass records what the broker said in a
/// transaction of its own.
pub(super) enum Rows {
    Scan,
    Fed(Vec<OutboxRow>),
}

/// The first half of a pass: BEGIN, claim the rows (`rows`), publish them (all
/// handed to lapin at once). `None`: nothing was due (the transaction is over).
/// `Err`: the database failed (nothing recorded; the rows stay).
///
/// Only this half needs the link; the second half awaits the broker, so the next
/// pass can claim and publish while it does (see the worker).
pub(super) async fn start(
    pool: &db::Pool,
    settings: Settings,
    link: &mut Link,
    rows: Rows,
) -> Result<Option<Publishing>, RelayError> {
    let mut conn = pool.get().await.map_err(RelayError::Pool)?;
    let limit = i64::try_from(settings.batch_size).unwrap_or(i64::MAX);
    let pg: &mut AsyncPgConnection = &mut conn;
    AnsiTransactionManager::begin_transaction(pg)
        .await
        .map_err(RelayError::database("begin a relay pass"))?;
    let taken = matches!(rows, Rows::Fed(_));
    let claimed = match rows {
        Rows::Scan => db::claim_outbox(pg, limit, settings.reply_ttl).await,
        Rows::Fed(rows) => take_fed(pg, rows).await,
    };
    let claimed = match claimed {
        Ok(claimed) => claimed,
        Err(error) => {
            rollback(pg).await;
            return Err(RelayError::Database { action: "claim outbox rows", source: error });
        }
    };
    if claimed.is_empty() {
        AnsiTransactionManager::commit_transaction(pg)
            .await
            .map_err(RelayError::database("end a relay pass"))?;
        return Ok(None);
    }
    let claimed_count = claimed.len();
    // Expired replies go without a publish: their requester stopped waiting.
    let (expired, rows): (Vec<OutboxRow>, Vec<OutboxRow>) = claimed.into_iter().partition(|row| row.expired);
    let mut results: Vec<Published> = rows.iter().map(|_| None).collect();
    let (confirms, lost) = publish(link, &rows, &mut results).await;
    Ok(Some(Publishing { conn, claimed: claimed_count, taken, expired, rows, results, confirms, lost }))
}

/// Of rows handed over, those this pass deletes (in its transaction): still in the
/// outbox and due.
async fn take_fed(conn: &mut AsyncPgConnection, rows: Vec<OutboxRow>) -> QueryResult<Vec<OutboxRow>> {
    let ids: Vec<i64> = rows.iter().map(|row| row.id).collect();
    let taken: std::collections::HashSet<i64> = db::take_outbox(conn, &ids).await?.into_iter().collect();
    Ok(rows.into_iter().filter(|row| taken.contains(&row.id)).collect())
}

/// Rolls back a pass that failed; a connection left in its transaction is not
/// recycled by the pool (it is closed, which rolls back as well).
async fn rollback(conn: &mut AsyncPgConnection) {
    let _ = AnsiTransactionManager::rollback_transaction(conn).await;
}

impl Publishing {
    /// The rows the pass claimed.
    pub(super) fn claimed(&self) -> usize {
        self.claimed
    }

    /// The ids of the rows the pass holds.
    pub(super) fn ids(&self) -> std::collections::HashSet<i64> {
        self.rows.iter().chain(&self.expired).map(|row| row.id).collect()
    }

    /// The second half of a pass: awaits the confirms, records what the broker said
    /// (delete, postpone, expire) and commits. `Err`: the database failed (nothing
    /// recorded; the rows stay, and those published go out again: at least once).
    pub(super) async fn finish(self, settings: Settings) -> Result<Pass, RelayError> {
        let Self { mut conn, claimed, taken, expired, rows, mut results, confirms, mut lost } = self;
        let nacked = await_confirms(&rows, confirms, &mut results, &mut lost).await;
        // The connection or channel failed: the first row left unknown is postponed
        // (it may be what closed the channel — too large, say — and would otherwise
        // come first in every pass, holding up every row behind it). If the broker
        // had it, it goes out once more under its id: at least once, as always.
        if let Some(reason) = &lost {
            if let Some(first) = results.iter_mut().find(|result| result.is_none()) {
                *first = Some(Err(Refusal::ChannelFailed { reason: reason.report() }));
            }
        }
        let pg: &mut AsyncPgConnection = &mut conn;
        if taken {
            let published = results.iter().filter(|result| matches!(result, Some(Ok(())))).count();
            if published == rows.len() {
                AnsiTransactionManager::commit_transaction(pg)
                    .await
                    .map_err(RelayError::database("commit a relay pass"))?;
                return Ok(Pass { claimed, published, postponed: 0, expired: 0, nacked, lost });
            }
            // Not every row was confirmed: the rows come back, and what the broker
            // said is recorded as a claimed pass records it. (Another relay may claim
            // them in between and publish those confirmed again: at least once.)
            rollback(pg).await;
            AnsiTransactionManager::begin_transaction(pg)
                .await
                .map_err(RelayError::database("begin a relay pass's record"))?;
        }
        let recorded = async {
            let mut recorded = record(pg, &rows, results, settings).await?;
            let published = recorded.sent.len();
            recorded.sent.extend(expired.iter().map(|row| row.id));
            db::delete_outbox(pg, &recorded.sent).await?;
            Ok::<_, diesel::result::Error>((published, recorded))
        }
        .await;
        let (published, Recorded { postponed, first_error, .. }) = match recorded {
            Ok(recorded) => recorded,
            Err(error) => {
                rollback(pg).await;
                return Err(RelayError::Database { action: "run a relay pass", source: error });
            }
        };
        AnsiTransactionManager::commit_transaction(pg)
            .await
            .map_err(RelayError::database("commit a relay pass"))?;
        for row in &expired {
            crate::base::log::debug!(message_id = %row.message_id, reply_to = %row.routing_key, correlation_id = ?row.correlation_id, attempts = row.attempts, last_error = ?row.last_error, "outbox relay: a reply expired before it could be delivered; deleted unpublished");
        }
        if let Some((message_id, error)) = first_error {
            crate::base::log::warn!(postponed, %message_id, %error, "outbox relay: rows could not be published; they stay in the outbox and are retried with backoff (the first's error shown; RUST_LOG=idemq::engine::relay=debug lists each)");
        }
        // Once committed: each reply is deleted, and warned of, once.
        if let Some(first) = expired.first() {
            crate::base::log::warn!(
                expired = expired.len(),
                message_id = %first.message_id,
                reply_to = %first.routing_key,
                correlation_id = ?first.correlation_id,
                attempts = first.attempts,
                last_error = ?first.last_error,
                reply_ttl = %crate::base::duration::human(settings.reply_ttl),
                "outbox relay: replies expired before they could be delivered (older than the reply TTL, or past their request's expiration: the requester stopped waiting); deleted unpublished (the first shown; RUST_LOG=idemq::engine::relay=debug lists each)"
            );
        }
        Ok(Pass { claimed, published, postponed, expired: expired.len(), nacked, lost })
    }
}

/// What [`record`] did with the published rows.
struct Recorded {
    /// Rows to delete: confirmed, or best effort.
    sent: Vec<i64>,
    postponed: usize,
    /// The first postponed row's message id and refusal, for the pass's warning.
    first_error: Option<(String, Refusal)>,
}

/// Postpones each refused row (a best-effort one is dropped instead) and collects
/// the rows to delete; a row left unknown stays as it is, for the next pass.
async fn record(
    conn: &mut AsyncPgConnection,
    rows: &[OutboxRow],
    results: Vec<Published>,
    settings: Settings,
) -> QueryResult<Recorded> {
    let mut recorded = Recorded { sent: Vec::new(), postponed: 0, first_error: None };
    for (row, result) in rows.iter().zip(results) {
        match result {
            Some(Ok(())) => recorded.sent.push(row.id),
            // Best effort (direct reply-to): never retried — but for a requester
            // that is gone, kept to end as every reply nobody can take ends: expired.
            Some(Err(error)) if !row.mandatory && !matches!(error, Refusal::RequesterGone { .. }) => {
                crate::base::log::warn!(message_id = %row.message_id, routing_key = %row.routing_key, %error, "outbox relay: a best-effort reply could not be published; dropped");
                recorded.sent.push(row.id);
            }
            Some(Err(error)) => {
                let delay = retry_delay(row.attempts, settings.max_backoff);
                // One line per row at debug; the pass says it once at warn.
                crate::base::log::debug!(message_id = %row.message_id, exchange = %row.exchange, routing_key = %row.routing_key, attempts = row.attempts + 1, delay = %crate::base::duration::human(delay), %error, "outbox relay: could not publish; it stays in the outbox and is retried");
                db::postpone_outbox(conn, row.id, delay, &error.to_string(), settings.reply_ttl).await?;
                recorded.postponed += 1;
                recorded.first_error.get_or_insert_with(|| (row.message_id.clone(), error));
            }
            // Unknown (the connection went): left for the next pass.
            None => {}
        }
    }
    Ok(recorded)
}

/// The prefix of the addresses RabbitMQ gives direct reply-to requesters
/// (`amq.rabbitmq.reply-to.<channel and key>`), on the default exchange.
const DIRECT_REPLY_TO: &str = "amq.rabbitmq.reply-to.";

/// Publishes each row whose exchange exists and, for a reply to a direct reply-to
/// address, whose requester is still there (the others are refused at once), until
/// the connection fails. The confirms to await, by row index, and the fault.
///
/// A requester that is gone is asked of the broker ([`Link::requester_present`],
/// once per address and pass), never left to the publish: the broker confirms a
/// reply to one and drops it, or (with `mandatory`) returns it on 3.x whether the
/// requester is there or not, and on 4.2 and later never. So such a reply is
/// postponed like one returned unroutable, and ends the same way: deleted
/// unpublished once it expires (`idemq_outbox_replies_expired_total`), without
/// holding up the rows behind it.
///
/// The exchanges are checked first (once per connection each), then every publish
/// is handed to lapin at once: each `basic_publish` queues its frames (and takes its
/// confirm's delivery tag) when first polled, in row order, and resolves once
/// lapin's I/O loop has written them — awaited one by one, every row would cost a
/// wake-up of that loop; together, one wake-up writes them all.
async fn publish(
    link: &mut Link,
    rows: &[OutboxRow],
    results: &mut [Published],
) -> (Vec<(usize, PublisherConfirm)>, Option<RelayError>) {
    let mut publishable = Vec::with_capacity(rows.len());
    let mut lost = None;
    let mut requesters: HashMap<&str, bool> = HashMap::new();
    for (index, row) in rows.iter().enumerate() {
        match link.exchange_exists(&row.exchange).await {
            Ok(true) => {}
            Ok(false) => {
                results[index] = Some(Err(Refusal::NoExchange { exchange: row.exchange.clone() }));
                continue;
            }
            Err(reason) => {
                lost = Some(reason);
                break;
            }
        }
        if row.exchange.is_empty() && row.routing_key.starts_with(DIRECT_REPLY_TO) {
            let present = match requesters.get(row.routing_key.as_str()) {
                Some(&present) => present,
                None => match link.requester_present(&row.routing_key).await {
                    Ok(present) => *requesters.entry(row.routing_key.as_str()).or_insert(present),
                    Err(reason) => {
                        lost = Some(reason);
                        break;
                    }
                },
            };
            if !present {
                results[index] = Some(Err(Refusal::RequesterGone { reply_to: row.routing_key.clone() }));
                continue;
            }
        }
        publishable.push(index);
    }
    let channel = &link.channel;
    let publishes = publishable.iter().map(|&index| {
        let row = &rows[index];
        let options = BasicPublishOptions { mandatory: row.mandatory, ..BasicPublishOptions::default() };
        channel.basic_publish(
            row.exchange.as_str().into(),
            row.routing_key.as_str().into(),
            options,
            &row.body,
            properties(row),
        )
    });
    let published = futures_util::future::join_all(publishes).await;
    let mut confirms = Vec::with_capacity(published.len());
    for (index, published) in publishable.into_iter().zip(published) {
        match published {
            Ok(confirm) => confirms.push((index, confirm)),
            // The rows after it may have gone out: they stay unknown (`None`), as
            // rows whose confirm never came do, and are published again next pass.
            Err(source) => {
                lost.get_or_insert(RelayError::Broker { action: "publish", source });
            }
        }
    }
    (confirms, lost)
}

/// Awaits each confirm (at most [`CONFIRM_TIMEOUT`]) into `results`; a failure sets
/// `lost` if nothing did before. `true`: the broker nacked one.
async fn await_confirms(
    rows: &[OutboxRow],
    confirms: Vec<(usize, PublisherConfirm)>,
    results: &mut [Published],
    lost: &mut Option<RelayError>,
) -> bool {
    let mut nacked = false;
    for (index, confirm) in confirms {
        let row = &rows[index];
        results[index] = match tokio::time::timeout(CONFIRM_TIMEOUT, confirm).await {
            Ok(Ok(Confirmation::Ack(None) | Confirmation::NotRequested)) => Some(Ok(())),
            Ok(Ok(Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)))) => {
                Some(Err(Refusal::Unroutable {
                    exchange: row.exchange.clone(),
                    routing_key: row.routing_key.clone(),
                }))
            }
            Ok(Ok(Confirmation::Nack(None))) => {
                nacked = true;
                Some(Err(Refusal::Nacked))
            }
            Ok(Err(source)) => {
                lost.get_or_insert(RelayError::Broker { action: "await a confirm", source });
                None
            }
            Err(_) => {
                lost.get_or_insert(RelayError::ConfirmTimeout(CONFIRM_TIMEOUT));
                None
            }
        };
    }
    nacked
}

fn properties(row: &OutboxRow) -> lapin::BasicProperties {
    let headers =
        row.headers.as_deref().and_then(|headers| serde_json::from_str(headers).ok()).unwrap_or_default();
    crate::base::outgoing::properties(
        &row.message_id,
        row.content_type.as_deref(),
        row.correlation_id.as_deref(),
        row.message_type.as_deref(),
        &headers,
    )
}

/// 100 ms, doubling per failure, at most `max`.
fn retry_delay(attempts: i32, max: Duration) -> Duration {
    let exponent = u32::try_from(attempts.clamp(0, 20)).unwrap_or(20);
    Duration::from_millis(100).saturating_mul(2_u32.saturating_pow(exponent)).min(max)
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
}
