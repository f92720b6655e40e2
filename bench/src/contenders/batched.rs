//! The transaction of the two batched hand-written contenders (issue 39): the
//! database's ceiling (`database`) and the expert loop (`expert`). One transaction
//! per batch writes the rows idemq-batch writes for it, in as few statements as
//! they take:
//!
//! 1. the dedup rows, one multi-row `INSERT … ON CONFLICT DO NOTHING RETURNING key`
//!    (the batch's distinct keys, sorted, so two batches in flight take their row
//!    locks in one order);
//! 2. for the new payments, the demo's `record_payments` (one multi-row ledger
//!    insert, one upsert of per-account totals, accounts sorted);
//! 3. for the new payments, an outbox row each (one multi-row insert into
//!    `idemq_outbox`, `RETURNING id`);
//! 4. the outbox rows of earlier batches whose events the broker confirmed, deleted
//!    (one statement; none in the expert loop, whose publisher deletes them itself).
//!
//! A delivery whose body does not decode is not a payment: both contenders count it
//! as failed (the workload has none).

use std::collections::{BTreeMap, BTreeSet};

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemq::store::schema::{idemq_dedup, idemq_outbox};
use idemq::Handler;
use idemq_example_payments::{apply_payment, record_payments, PaymentApplied, PaymentRequested};
use sha2::{Digest, Sha256};

/// Payments per transaction: what the expert found best on this machine (256 and
/// 1,000 were within the noise of it; 64, idemq's default, was slower).
pub(super) const BATCH: usize = 500;
/// Transactions in flight, each on a connection of its own: one commits while the
/// next is written.
pub(super) const IN_FLIGHT: usize = 2;
/// A transaction that failed for a reason worth retrying (a deadlock, a
/// serialization failure) is run again this many times before the batch is given back.
const ATTEMPTS: usize = 3;

/// One delivery of a batch, decoded.
pub(super) struct Payment {
    pub(super) msg: PaymentRequested,
    fingerprint: Vec<u8>,
}

impl Payment {
    /// `None`: the body is not a payment.
    pub(super) fn decode(body: &[u8]) -> Option<Self> {
        let msg = serde_json::from_slice(body).ok()?;
        Some(Self { msg, fingerprint: Sha256::digest(body).to_vec() })
    }
}

/// An event to publish once its transaction committed: its outbox row's id, its
/// message id and its body.
pub(super) struct Event {
    pub(super) id: i64,
    pub(super) message_id: String,
    pub(super) body: Vec<u8>,
}

/// What a batch's transaction did: which payments were new (the others were
/// duplicates), and their events.
pub(super) struct Applied {
    pub(super) new: Vec<bool>,
    pub(super) events: Vec<Event>,
}

/// Runs [`write`] in a transaction, again after a deadlock or serialization
/// failure (two batches in flight may still meet on a duplicate's dedup row).
pub(super) async fn apply(
    conn: &mut AsyncPgConnection,
    payments: &[Payment],
    events_queue: &str,
    published: &[i64],
) -> QueryResult<Applied> {
    let mut attempt = 1;
    loop {
        let result = conn
            .transaction(async |conn: &mut AsyncPgConnection| {
                write(conn, payments, events_queue, published).await
            })
            .await;
        match result {
            Err(diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::SerializationFailure,
                _,
            )) if attempt < ATTEMPTS => attempt += 1,
            Err(diesel::result::Error::DatabaseError(_, info))
                if info.message().contains("deadlock") && attempt < ATTEMPTS =>
            {
                attempt += 1;
            }
            other => return other,
        }
    }
}

/// The batch's statements (see the module docs).
async fn write(
    conn: &mut AsyncPgConnection,
    payments: &[Payment],
    events_queue: &str,
    published: &[i64],
) -> QueryResult<Applied> {
    let handler = apply_payment.name();
    // Each key once (a duplicate may sit in the same batch), sorted.
    let mut first: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, payment) in payments.iter().enumerate() {
        first.entry(payment.msg.payment_id.as_str()).or_insert(i);
    }
    let rows: Vec<_> = first
        .iter()
        .map(|(&key, &i)| {
            (
                idemq_dedup::handler.eq(handler),
                idemq_dedup::key.eq(key),
                idemq_dedup::fingerprint.eq(&payments[i].fingerprint),
            )
        })
        .collect();
    let inserted: BTreeSet<String> = if rows.is_empty() {
        BTreeSet::new()
    } else {
        diesel::insert_into(idemq_dedup::table)
            .values(rows)
            .on_conflict_do_nothing()
            .returning(idemq_dedup::key)
            .load::<String>(conn)
            .await?
            .into_iter()
            .collect()
    };
    let new: Vec<bool> = payments
        .iter()
        .enumerate()
        .map(|(i, p)| {
            first.get(p.msg.payment_id.as_str()) == Some(&i) && inserted.contains(&p.msg.payment_id)
        })
        .collect();
    let applied: Vec<PaymentRequested> =
        payments.iter().zip(&new).filter(|&(_, &new)| new).map(|(p, _)| p.msg.clone()).collect();
    record_payments(conn, &applied).await?;
    let mut events = Vec::with_capacity(applied.len());
    if !applied.is_empty() {
        let outbox: Vec<(String, Vec<u8>)> = applied
            .into_iter()
            .map(|msg| {
                let message_id = format!("{handler}/{}/0", msg.payment_id);
                let body = serde_json::to_vec(&PaymentApplied::from(msg)).expect("an event serializes");
                (message_id, body)
            })
            .collect();
        let rows: Vec<_> = outbox
            .iter()
            .map(|(message_id, body)| {
                (
                    idemq_outbox::message_id.eq(message_id),
                    idemq_outbox::exchange.eq(""),
                    idemq_outbox::routing_key.eq(events_queue),
                    idemq_outbox::body.eq(body),
                    idemq_outbox::content_type.eq("application/json"),
                )
            })
            .collect();
        // Matched by message id: PostgreSQL does not promise `RETURNING` in `VALUES` order.
        let ids: BTreeMap<String, i64> = diesel::insert_into(idemq_outbox::table)
            .values(rows)
            .returning((idemq_outbox::message_id, idemq_outbox::id))
            .load::<(String, i64)>(conn)
            .await?
            .into_iter()
            .collect();
        for (message_id, body) in outbox {
            let id = *ids.get(&message_id).ok_or(diesel::result::Error::NotFound)?;
            events.push(Event { id, message_id, body });
        }
    }
    delete_published(conn, published).await?;
    Ok(Applied { new, events })
}

/// Deletes the outbox rows whose events the broker confirmed.
pub(super) async fn delete_published(conn: &mut AsyncPgConnection, ids: &[i64]) -> QueryResult<()> {
    if !ids.is_empty() {
        diesel::delete(idemq_outbox::table.filter(idemq_outbox::id.eq_any(ids))).execute(conn).await?;
    }
    Ok(())
}
