//! The consumers measured, each started the same way in a child process and fed
//! to the same [`Recorder`].

mod baseline;
mod batched;
mod broker;
mod database;
mod expert;
mod raw;
mod runtime;

pub(crate) use runtime::events_queue;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics::Recorder;
use crate::urls::Urls;
use crate::BenchError;

/// Subscribes to `queue` with manual acks (the default `no_ack: false`).
async fn subscribe(channel: &lapin::Channel, queue: &str, tag: &str) -> lapin::Result<lapin::Consumer> {
    let options = lapin::options::BasicConsumeOptions::default();
    channel.basic_consume(queue.into(), tag.into(), options, lapin::types::FieldTable::default()).await
}

/// Two connections: one consuming (a channel with `prefetch`), one publishing (a
/// channel with confirms on), for the contenders that publish an event per delivery.
struct Pair {
    consuming: lapin::Connection,
    channel: lapin::Channel,
    publishing: lapin::Connection,
    publisher: lapin::Channel,
}

impl Pair {
    async fn connect(urls: &Urls, prefetch: u16) -> Result<Self, BenchError> {
        use lapin::options::{BasicQosOptions, ConfirmSelectOptions};
        use lapin::{Connection, ConnectionProperties};
        let consuming = Connection::connect(&urls.amqp, ConnectionProperties::default()).await?;
        let channel = consuming.create_channel().await?;
        channel.basic_qos(prefetch, BasicQosOptions { global: false }).await?;
        let publishing = Connection::connect(&urls.amqp, ConnectionProperties::default()).await?;
        let publisher = publishing.create_channel().await?;
        publisher.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(Self { consuming, channel, publishing, publisher })
    }

    /// Closes both connections.
    async fn close(&self) {
        let _ = self.publishing.close(200, "done".into()).await;
        let _ = self.consuming.close(200, "done".into()).await;
    }
}

/// A consumer the bench measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Contender {
    /// lapin with manual acks and no database: the broker's ceiling.
    Raw,
    /// The hand-written per-message transaction loop.
    Baseline,
    /// idemq, one transaction per delivery (`batch_size(1)`), the baseline's concurrency.
    IdemqPerMessage,
    /// idemq with its defaults (group commit), a handler without a lane.
    IdemqGroup,
    /// idemq with its defaults and the payment effect laned by account, as the demo's `apply_payment`.
    IdemqLanes,
    /// idemq-lanes whose handler also publishes an event per payment through the
    /// transactional outbox (the demo's `apply_payment`, to a queue of the run's).
    IdemqOutbox,
    /// idemq-lanes with the payment effect as a batch handler (the demo's
    /// `record_payments`: one multi-row ledger insert and one upsert per transaction).
    IdemqBatch,
    /// lapin, no database: consume, publish an event per delivery with confirms, ack
    /// — the broker's ceiling for the demo's messaging.
    BrokerEvents,
    /// No broker: idemq-batch's rows written by a batched, pipelined loop — the
    /// database's ceiling.
    Database,
    /// The best hand-written loop for this workload with idemq's guarantees, batched
    /// and pipelined: what an expert would write instead of using idemq.
    Expert,
    /// idemq-batch with the expert loop's batch size and transactions in flight.
    IdemqTuned,
}

impl Contender {
    pub(crate) const ALL: [Self; 11] = [
        Self::Raw,
        Self::BrokerEvents,
        Self::Database,
        Self::Expert,
        Self::Baseline,
        Self::IdemqPerMessage,
        Self::IdemqGroup,
        Self::IdemqLanes,
        Self::IdemqOutbox,
        Self::IdemqBatch,
        Self::IdemqTuned,
    ];

    /// The name on the command line (`bench --child <name>`) and in the tables.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw",
            Self::Baseline => "baseline",
            Self::IdemqPerMessage => "idemq-per-message",
            Self::IdemqGroup => "idemq-group",
            Self::IdemqLanes => "idemq-lanes",
            Self::IdemqOutbox => "idemq-outbox",
            Self::IdemqBatch => "idemq-batch",
            Self::BrokerEvents => "broker-events",
            Self::Database => "database",
            Self::Expert => "expert",
            Self::IdemqTuned => "idemq-tuned",
        }
    }

    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.name() == name)
    }

    /// What it is, in a line.
    pub(crate) fn describe(self) -> String {
        match self {
            Self::Raw => format!(
                "lapin, manual acks (one `multiple` ack per {} deliveries and when idle), prefetch {}, no database",
                raw::ACK_EVERY,
                raw::PREFETCH
            ),
            Self::Baseline => {
                "hand-written lapin + diesel-async loop: dedup row + effect in one transaction, ack after COMMIT"
                    .to_owned()
            }
            Self::IdemqPerMessage => "idemq, .batch_size(1) (per-message mode), handler without a lane".to_owned(),
            Self::IdemqGroup => {
                "idemq, Runtime::builder() defaults (group commit), handler without a lane".to_owned()
            }
            Self::IdemqLanes => {
                "idemq, Runtime::builder() defaults (group commit), the payment effect with lane = \"account\"".to_owned()
            }
            Self::IdemqOutbox => "idemq-lanes, and the handler publishes a PaymentApplied event per payment through \
                                  the outbox (relay in-process; the run waits until every event is published)"
                .to_owned(),
            Self::IdemqBatch => "idemq-outbox with the demo's apply_payment as it is, a batch handler: one call per \
                                 transaction, one multi-row ledger insert and one upsert of per-account totals \
                                 (record_payments), an event per payment through the outbox"
                .to_owned(),
            Self::BrokerEvents => format!(
                "lapin, no database: an event per delivery to the run's events queue (persistent, mandatory, \
                 confirms pipelined), one `multiple` ack per {} deliveries (and when idle) once their events \
                 are confirmed; prefetch {}",
                raw::ACK_EVERY,
                raw::PREFETCH
            ),
            Self::Database => format!(
                "no broker (the backlog drained into memory before the clock starts): per batch of {} \
                 payments one transaction — dedup rows, ledger rows, balances, outbox rows, and the \
                 previous batch's outbox rows deleted — {} in flight",
                batched::BATCH,
                batched::IN_FLIGHT
            ),
            Self::Expert => format!(
                "hand-written lapin + diesel-async, batched: prefetch {}, batches of up to {} deliveries, \
                 one transaction each (dedup rows, ledger, balances, outbox rows), {} in flight, one \
                 `multiple` ack per batch after COMMIT, events published after COMMIT with pipelined \
                 confirms, their outbox rows then deleted",
                expert::PREFETCH,
                batched::BATCH,
                batched::IN_FLIGHT
            ),
            Self::IdemqTuned => format!(
                "idemq-batch with .batch_size({}).concurrency({}): the expert loop's batch size and \
                 transactions in flight (prefetch their product, as the builder derives it)",
                batched::BATCH,
                batched::IN_FLIGHT
            ),
        }
    }

    /// Whether it writes the ledger (everything but the broker-only consumers).
    pub(crate) fn uses_database(self) -> bool {
        !matches!(self, Self::Raw | Self::BrokerEvents)
    }

    /// Whether it is an idemq runtime, which declares the retry policy's wait queues.
    pub(crate) fn is_idemq(self) -> bool {
        matches!(
            self,
            Self::IdemqPerMessage
                | Self::IdemqGroup
                | Self::IdemqLanes
                | Self::IdemqOutbox
                | Self::IdemqBatch
                | Self::IdemqTuned
        )
    }

    /// Whether its handler publishes an event per payment through the outbox (the run
    /// declares an events queue and waits for the relay to empty the outbox).
    pub(crate) fn publishes_events(self) -> bool {
        matches!(self, Self::IdemqOutbox | Self::IdemqBatch | Self::IdemqTuned | Self::Expert)
    }

    /// Whether its run has an events queue, and how many events it must hold: one per
    /// payment (the outbox contenders, whose duplicates publish nothing), or one per
    /// delivery (the broker's ceiling, which has no dedup).
    pub(crate) fn events(self) -> Option<Events> {
        match self {
            Self::IdemqOutbox | Self::IdemqBatch | Self::IdemqTuned | Self::Expert => {
                Some(Events::PerPayment)
            }
            Self::BrokerEvents => Some(Events::PerDelivery),
            _ => None,
        }
    }

    /// Whether it takes a concurrency (the others run with their defaults).
    pub(crate) fn takes_concurrency(self) -> bool {
        matches!(self, Self::Baseline | Self::IdemqPerMessage)
    }

    /// What it does before the clock starts: the database's ceiling takes the
    /// backlog's `expect` messages off `queue` into memory.
    pub(crate) async fn prepare(self, urls: &Urls, queue: &str, expect: u64) -> Result<Prepared, BenchError> {
        Ok(match self {
            Self::Database => Prepared(Some(database::drain(urls, queue, expect).await?)),
            _ => Prepared(None),
        })
    }

    /// Starts consuming `queue`; every delivery it settles goes to `recorder`.
    pub(crate) async fn start(
        self,
        urls: &Urls,
        queue: &str,
        concurrency: Option<usize>,
        prepared: Prepared,
        recorder: Arc<Recorder>,
    ) -> Result<Consumer, BenchError> {
        let concurrency = concurrency.unwrap_or(idemq::RuntimeBuilder::DEFAULT_CONCURRENCY);
        match self {
            Self::Raw => raw::start(urls, queue, recorder).await,
            Self::BrokerEvents => broker::start(urls, queue, recorder).await,
            Self::Database => {
                let bodies = prepared.0.ok_or("database: started without its backlog (prepare first)")?;
                database::start(urls, queue, bodies, recorder).await
            }
            Self::Expert => expert::start(urls, queue, recorder).await,
            Self::Baseline => baseline::start(urls, queue, concurrency, recorder).await,
            Self::IdemqPerMessage => {
                runtime::start(runtime::Flavor::PerMessage(concurrency), urls, queue, recorder)
            }
            Self::IdemqGroup => runtime::start(runtime::Flavor::Group, urls, queue, recorder),
            Self::IdemqLanes => runtime::start(runtime::Flavor::Lanes, urls, queue, recorder),
            Self::IdemqOutbox => runtime::start(runtime::Flavor::Outbox, urls, queue, recorder),
            Self::IdemqBatch => runtime::start(runtime::Flavor::Batch, urls, queue, recorder),
            Self::IdemqTuned => runtime::start(runtime::Flavor::Tuned, urls, queue, recorder),
        }
    }
}

/// What [`Contender::prepare`] took before the clock started: the database ceiling's
/// backlog bodies.
pub(crate) struct Prepared(Option<Vec<Vec<u8>>>);

/// How many events a run's events queue must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Events {
    /// One per distinct payment.
    PerPayment,
    /// One per delivery.
    PerDelivery,
}

/// A running consumer.
pub(crate) struct Consumer {
    stop: CancellationToken,
    task: JoinHandle<Result<(), BenchError>>,
    /// Transactions the consumer retried in-process after a database fault (idemq).
    infrastructure_retries: Box<dyn Fn() -> u64 + Send + Sync>,
}

impl Consumer {
    /// Whether it has stopped by itself (an error, or the broker cancelled it).
    pub(crate) fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    pub(crate) fn infrastructure_retries(&self) -> u64 {
        (self.infrastructure_retries)()
    }

    /// Stops it and waits for it to drain and close. `Ok(false)` if it had not
    /// finished after `timeout` and was aborted.
    pub(crate) async fn shutdown(mut self, timeout: Duration) -> Result<bool, BenchError> {
        self.stop.cancel();
        match tokio::time::timeout(timeout, &mut self.task).await {
            Ok(joined) => {
                joined??;
                Ok(true)
            }
            Err(_elapsed) => {
                self.task.abort();
                Ok(false)
            }
        }
    }
}
