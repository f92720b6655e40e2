//! Contender 2, the consumer a competent engineer would write by hand for the same
//! core guarantee: one channel with `basic_qos(C)`, a task per delivery bounded by a
//! `Semaphore(C)`, a deadpool diesel-async pool of `C` connections with
//! `RecyclingMethod::Fast`. Per delivery: `serde_json` decode, BEGIN, `INSERT INTO
//! idemq_dedup … ON CONFLICT DO NOTHING RETURNING key`, if new
//! `record_payment` (ledger row + balance upsert), COMMIT, ack; a duplicate
//! commits the empty transaction. On an error it nacks with requeue.
//!
//! What it skips is what idemq adds: dead-lettering of bad input, conflict
//! detection (a duplicate's stored fingerprint is read and compared), delayed
//! retries and poison detection, in-process retry of database faults, handler
//! timeouts, reconnects, graceful shutdown.

use std::sync::Arc;
use std::time::Instant;

use diesel::prelude::*;
use diesel_async::pooled_connection::deadpool::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig, RecyclingMethod};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use futures_util::StreamExt;
use idemq::Handler;
use idemq_example_payments::{apply_payment, record_payment, PaymentRequested};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicQosOptions};
use lapin::{Connection, ConnectionProperties};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Consumer;
use crate::metrics::{Recorder, Settle};
use crate::urls::Urls;
use crate::BenchError;

use idemq::store::schema::idemq_dedup;

pub(super) async fn start(
    urls: &Urls,
    queue: &str,
    concurrency: usize,
    recorder: Arc<Recorder>,
) -> Result<Consumer, BenchError> {
    let connection = Connection::connect(&urls.amqp, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let prefetch = u16::try_from(concurrency).unwrap_or(u16::MAX);
    channel.basic_qos(prefetch, BasicQosOptions { global: false }).await?;
    let mut config = ManagerConfig::default();
    config.recycling_method = RecyclingMethod::Fast;
    // The same transport as idemq's: TLS as the URL's `sslmode` says (`prefer` by
    // default, so encrypted to a server that offers it), or the comparison would
    // charge idemq for encryption the baseline skips.
    config.custom_setup = Box::new(|url| {
        let url = url.to_owned();
        Box::pin(async move {
            idemq::connect::database(&url)
                .await
                .map_err(|err| diesel::ConnectionError::BadConnection(err.to_string()))
        })
    });
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(&urls.database, config);
    let pool = Pool::builder(manager).max_size(concurrency).runtime(deadpool::Runtime::Tokio1).build()?;
    drop(pool.get().await?);
    let deliveries = super::subscribe(&channel, queue, "idemq-bench-baseline").await?;

    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let consumed = consume(deliveries, pool, concurrency, &recorder, &stop).await;
            let _ = connection.close(200, "done".into()).await;
            consumed
        }
    });
    Ok(Consumer { stop, task, infrastructure_retries: Box::new(|| 0) })
}

/// Takes deliveries until `stop`, each in a task of its own once a slot is free;
/// then waits for the tasks.
async fn consume(
    mut deliveries: lapin::Consumer,
    pool: Pool<AsyncPgConnection>,
    concurrency: usize,
    recorder: &Arc<Recorder>,
    stop: &CancellationToken,
) -> Result<(), BenchError> {
    let permits = Arc::new(Semaphore::new(concurrency));
    let tracker = TaskTracker::new();
    let result = loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break Ok(()),
            next = deliveries.next() => match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(err)) => break Err(err.into()),
                None => break Ok(()),
            },
        };
        let received = Instant::now();
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let (pool, recorder) = (pool.clone(), Arc::clone(recorder));
        tracker.spawn(async move {
            handle_delivery(&pool, delivery, received, &recorder).await;
            drop(permit);
        });
    };
    tracker.close();
    tracker.wait().await;
    result
}

/// One delivery: the transaction, then the ack; on any error, back to the queue.
async fn handle_delivery(
    pool: &Pool<AsyncPgConnection>,
    delivery: Delivery,
    received: Instant,
    recorder: &Recorder,
) {
    match apply_once(pool, &delivery.data).await {
        Ok(applied) => match delivery.ack(BasicAckOptions::default()).await {
            Ok(true) => {
                let how = if applied { Settle::Applied } else { Settle::Duplicate };
                recorder.settle(how, received, Instant::now());
            }
            Ok(false) => {
                eprintln!("baseline: the ack was not sent (channel gone)");
                recorder.returned();
            }
            Err(err) => {
                eprintln!("baseline: ack failed: {}", idemq::connect::redact(&err.to_string()));
                recorder.returned();
            }
        },
        Err(err) => {
            eprintln!("baseline: {}; requeueing", idemq::connect::redact(&err.to_string()));
            recorder.returned();
            let _ = delivery.nack(BasicNackOptions { requeue: true, ..Default::default() }).await;
        }
    }
}

/// Decode, then BEGIN; dedup row; effect if new; COMMIT. `Ok(false)`: a duplicate.
async fn apply_once(pool: &Pool<AsyncPgConnection>, body: &[u8]) -> Result<bool, BenchError> {
    let message: PaymentRequested = serde_json::from_slice(body)?;
    let fingerprint = Sha256::digest(body).to_vec();
    let mut conn = pool.get().await?;
    let conn: &mut AsyncPgConnection = &mut conn;
    let applied = conn
        .transaction(async move |conn: &mut AsyncPgConnection| {
            let new = diesel::insert_into(idemq_dedup::table)
                .values((
                    idemq_dedup::handler.eq(apply_payment.name()),
                    idemq_dedup::key.eq(&message.payment_id),
                    idemq_dedup::fingerprint.eq(&fingerprint),
                ))
                .on_conflict_do_nothing()
                .returning(idemq_dedup::key)
                .get_result::<String>(conn)
                .await
                .optional()?
                .is_some();
            if new {
                record_payment(conn, &message).await?;
            }
            Ok::<bool, diesel::result::Error>(new)
        })
        .await?;
    Ok(applied)
}
