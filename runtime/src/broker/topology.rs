//! Exchanges, queues, bindings and dead-letter queues, declared in code.
//!
//! Declaring is idempotent: the runtime declares the whole topology at every start.
//! Queues are **quorum** queues by default: they count deliveries
//! (`x-delivery-count`), which is what bounds poison messages. Each queue gets a
//! dead-letter queue (`<name>.dlq` unless renamed) and the broker-side backstop
//! arguments for at-least-once dead-lettering. Every quorum queue idemq consumes or
//! browses has an explicit `x-delivery-limit` (RabbitMQ 4.0 defaults it to 20), and
//! every queue declared here is durable (RabbitMQ 4.3 refuses transient non-exclusive
//! ones).

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, ExchangeKind};

use crate::base::BoxFuture;
use crate::error::Error;

/// The runtime dead-letters a message itself when its recorded handler starts reach
/// the queue's [`Queue::delivery_limit`]; the broker's own `x-delivery-limit` is set
/// this much higher, as a backstop for a runtime that never gets to decide (e.g. a
/// crash before the start is recorded, or a message lapin cannot parse).
pub(crate) const BROKER_LIMIT_MARGIN: u32 = 5;

/// The default [`Queue::delivery_limit`]: the handler starts without an outcome
/// after which a message is poison.
pub(crate) const DEFAULT_DELIVERY_LIMIT: u32 = 20;

/// A quorum dead-letter queue's `x-delivery-limit`: none in practice. RabbitMQ 4.0
/// gives every quorum queue without one a limit of 20, and a DLQ has no dead-letter
/// exchange: its letters would be *dropped* after 20 returns — and each `idemq dlq
/// list` (a browse closes its channel) or a crash of any consumer of it is one.
/// Not RabbitMQ 4's `-1` ("no limit"): 3.x accepts `-1` and drops a message at its
/// first return (checked on 3.10).
pub(crate) const DEAD_LETTER_DELIVERY_LIMIT: i64 = i32::MAX as i64;

/// Everything the application declares: exchanges, then queues with their bindings.
#[derive(Debug, Clone, Default)]
#[must_use = "a topology does nothing until it is given to the runtime builder"]
pub struct Topology {
    // Seen by the files that extend it: `partitions`, `asyncapi`.
    pub(super) exchanges: Vec<Exchange>,
    pub(super) queues: Vec<Queue>,
    /// The message types named with [`Topology::message`], for the AsyncAPI
    /// document.
    messages: Vec<MessageKind>,
}

/// A message type named with [`Topology::message`]: where it is published and
/// what it says of itself on the wire.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MessageKind {
    pub(crate) rust_type: &'static str,
    pub(crate) exchange: &'static str,
    pub(crate) routing_key: &'static str,
    /// Its AMQP `type` ([`crate::Message::TYPE`]).
    pub(crate) wire_type: Option<&'static str>,
    /// Its version ([`crate::Message::VERSION`]).
    pub(crate) version: Option<u32>,
    /// Its payload's JSON Schema, if it has one (feature `schemars`).
    pub(crate) schema: fn() -> Option<serde_json::Value>,
}

impl Topology {
    /// An empty topology.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an exchange.
    pub fn exchange(mut self, exchange: Exchange) -> Self {
        self.exchanges.push(exchange);
        self
    }

    /// Declares what message type `M` is published to (`#[derive(Message)]` with
    /// `#[message(exchange = "...")]`): its exchange, as a topic exchange (nothing for
    /// the default exchange `""`). Registration is explicit: a type is declared where
    /// you name it here, never through a hidden global registry.
    pub fn message<M: crate::base::outgoing::Message>(mut self) -> Self {
        let kind = MessageKind {
            rust_type: std::any::type_name::<M>(),
            exchange: M::EXCHANGE,
            routing_key: M::ROUTING_KEY,
            wire_type: M::TYPE,
            version: M::VERSION,
            schema: M::payload_schema,
        };
        if !self.messages.iter().any(|known| known.rust_type == kind.rust_type) {
            self.messages.push(kind);
        }
        if M::EXCHANGE.is_empty() || self.exchanges.iter().any(|e| e.name == M::EXCHANGE) {
            return self;
        }
        self.exchange(Exchange::topic(M::EXCHANGE))
    }

    /// Adds a queue (with its dead-letter queue and bindings).
    pub fn queue(mut self, queue: Queue) -> Self {
        self.queues.push(queue);
        self
    }

    /// Whether it names any queue (declared, or [declared
    /// elsewhere](Queue::declared_elsewhere)): then it must name every consumed queue
    /// (see [`RuntimeBuilder::consume`](crate::RuntimeBuilder::consume)).
    pub(crate) fn names_queues(&self) -> bool {
        !self.queues.is_empty()
    }

    /// The queue named `name`, if declared here.
    pub fn find_queue(&self, name: &str) -> Option<&Queue> {
        self.queues.iter().find(|q| q.name == name)
    }

    /// The queue named `name` as declared here, or a default [`Queue::new`] (a
    /// consumed queue the topology does not name).
    pub(crate) fn queue_or_default(&self, name: &str) -> Queue {
        self.find_queue(name).cloned().unwrap_or_else(|| Queue::new(name))
    }

    /// The queues declared here.
    pub(crate) fn queues(&self) -> &[Queue] {
        &self.queues
    }

    /// The exchanges declared here.
    pub(crate) fn exchanges(&self) -> &[Exchange] {
        &self.exchanges
    }

    /// The message types named with [`Topology::message`]: (Rust type, exchange,
    /// routing key).
    pub(crate) fn message_types(&self) -> &[MessageKind] {
        &self.messages
    }

    /// The exchanges declared here, by name.
    pub(crate) fn exchange_names(&self) -> impl Iterator<Item = &str> {
        self.exchanges.iter().map(|exchange| exchange.name.as_str())
    }

    pub(crate) fn merge(&mut self, other: Topology) {
        self.exchanges.extend(other.exchanges);
        self.queues.extend(other.queues);
        self.messages.extend(other.messages);
    }

    /// Declares every exchange, queue, dead-letter queue and binding on `channel`.
    ///
    /// # Errors
    /// [`Error::QueueMismatch`] / [`Error::ExchangeMismatch`] when something exists with
    /// other arguments; [`Error::Amqp`] for any other refusal.
    ///
    /// # Cancel safety
    /// Cancel safe: declarations are idempotent; run it again.
    pub fn declare<'a>(&'a self, channel: &'a Channel) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            for exchange in &self.exchanges {
                exchange.declare(channel).await?;
            }
            for queue in self.queues.iter().filter(|queue| !queue.elsewhere) {
                queue.declare(channel).await?;
            }
            Ok(())
        })
    }

    /// What the runtime declares at every (re)connect: the topology, then `waits`
    /// (wait queues: the queue they belong to, name, delay). On a cluster a classic
    /// queue lives on one node; while that node is down the queue is
    /// [unavailable](Error::QueueUnavailable). Such a queue is skipped with a warning
    /// unless `needed(name)` (the runtime consumes it): a queue this process only
    /// publishes to (an event queue, a dead-letter queue) must not stop it consuming
    /// the others. What is published there meanwhile is not confirmed, so it waits:
    /// outbox rows are postponed, deliveries whose dead-letter copy fails go back to
    /// their queue.
    pub(crate) async fn declare_available(
        &self,
        connection: &lapin::Connection,
        waits: &[(&Queue, String, Duration)],
        needed: impl Fn(&str) -> bool,
    ) -> Result<(), Error> {
        // The exchanges first: the queues' bindings name them.
        let channel = open_channel(connection).await?;
        for exchange in &self.exchanges {
            exchange.declare(&channel).await?;
        }
        let _ = tokio::time::timeout(Duration::from_secs(1), channel.close(200, "declared".into())).await;
        // Then each queue (with its dead-letter queue and bindings) and each wait queue
        // on a channel of its own, [`DECLARING`] at once. One after the other, the
        // bench's new quorum queue, its dead-letter queue and five wait queues took
        // 24–29 ms of a 55 ms start; side by side, and beside the publishing
        // connection's handshake (`engine::session`), the start takes about 45.
        let queues = self.queues.iter().filter(|queue| !queue.elsewhere).map(|queue| (queue, None));
        let waits = waits.iter().map(|(queue, name, delay)| (*queue, Some((name.as_str(), *delay))));
        let all: Vec<(&Queue, Option<(&str, Duration)>)> = queues.chain(waits).collect();
        let mut declared = Vec::with_capacity(all.len());
        for some in all.chunks(DECLARING) {
            let declaring =
                some.iter().map(|(queue, wait)| queue.declare_on_a_channel_of_its_own(connection, *wait));
            declared.extend(futures_util::future::join_all(declaring).await);
        }
        for declared in declared {
            match declared {
                Err(Error::QueueUnavailable { queue, detail }) if !needed(&queue) => {
                    crate::base::log::warn!(
                        queue = %queue,
                        %detail,
                        "queue unavailable (its node is down); consuming the others, what is published to it waits"
                    );
                }
                other => other?,
            }
        }
        Ok(())
    }
}

/// How many queues [`Topology::declare_available`] declares at once, each on a channel
/// of its own.
const DECLARING: usize = 8;

/// An exchange to declare (durable).
#[derive(Debug, Clone)]
pub struct Exchange {
    name: String,
    kind: ExchangeKind,
}

impl Exchange {
    /// A durable exchange of the given kind.
    pub fn new(name: impl Into<String>, kind: ExchangeKind) -> Self {
        Self { name: name.into(), kind }
    }

    /// A durable topic exchange.
    pub fn topic(name: impl Into<String>) -> Self {
        Self::new(name, ExchangeKind::Topic)
    }

    /// A durable direct exchange.
    pub fn direct(name: impl Into<String>) -> Self {
        Self::new(name, ExchangeKind::Direct)
    }

    /// A durable fanout exchange.
    pub fn fanout(name: impl Into<String>) -> Self {
        Self::new(name, ExchangeKind::Fanout)
    }

    /// Its name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Its kind, as AMQP names it (`topic`, `direct`, `fanout`, `headers`).
    pub(crate) fn kind(&self) -> &str {
        match &self.kind {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Headers => "headers",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Custom(kind) => kind,
        }
    }

    async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        let options = ExchangeDeclareOptions { durable: true, ..Default::default() };
        channel
            .exchange_declare(self.name.as_str().into(), self.kind.clone(), options, FieldTable::default())
            .await
            .map_err(|source| match precondition_failed(&source) {
                Some(detail) => Error::ExchangeMismatch { exchange: self.name.clone(), detail },
                None => Error::Amqp { action: format!("declare exchange '{}'", self.name), source },
            })
    }
}

/// Quorum or classic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QueueType {
    /// Replicated, counts deliveries (`x-delivery-count`): poison messages are bounded.
    Quorum,
    /// Classic queue: no delivery count, so a message that crashes the process on
    /// every delivery is not bounded by idemq. Use only where quorum queues are not
    /// available.
    Classic,
    /// A stream (`x-queue-type: stream`): messages stay after they are read; a
    /// consumer starts at an offset (see the crate docs, *Streams*).
    Stream,
}

/// A durable queue, its dead-letter queue and its bindings.
#[derive(Debug, Clone)]
#[must_use = "a queue does nothing until it is added to a Topology"]
pub struct Queue {
    pub(crate) name: String,
    pub(crate) dead_letter: String,
    pub(crate) queue_type: QueueType,
    pub(crate) delivery_limit: u32,
    replicas: Option<u32>,
    bindings: Vec<(String, String)>,
    /// [`Queue::declared_elsewhere`]: described, never declared.
    pub(crate) elsewhere: bool,
    /// A stream's retention: `x-max-age` (whole seconds) and `x-max-length-bytes`.
    max_age: Option<Duration>,
    max_length_bytes: Option<u64>,
}

impl Queue {
    /// The default [`delivery_limit`](Self::delivery_limit): the handler starts
    /// without an outcome after which a message is poison.
    pub const DEFAULT_DELIVERY_LIMIT: u32 = DEFAULT_DELIVERY_LIMIT;

    /// How far above [`delivery_limit`](Self::delivery_limit) the broker's own
    /// `x-delivery-limit` is set: a backstop for a runtime that never gets to decide
    /// (a crash before the start is recorded, a message lapin cannot parse).
    pub const BROKER_LIMIT_MARGIN: u32 = BROKER_LIMIT_MARGIN;

    /// A durable quorum queue named `name` with dead-letter queue `<name>.dlq`.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        Self {
            dead_letter: format!("{name}.dlq"),
            name,
            queue_type: QueueType::Quorum,
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
            replicas: None,
            bindings: Vec::new(),
            elsewhere: false,
            max_age: None,
            max_length_bytes: None,
        }
    }

    /// A durable **stream** named `name` (`x-queue-type: stream`, RabbitMQ 3.9 and
    /// later), with dead-letter queue `<name>.dlq` (a quorum queue). Messages stay in
    /// a stream after they are read, until its retention
    /// ([`max_age`](Self::max_age), [`max_length_bytes`](Self::max_length_bytes))
    /// drops them. A handler consuming it keeps its offset in its own transaction
    /// and resumes after it: see the crate docs, *Streams*.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use idemq::{Queue, Topology};
    /// let topology = Topology::new()
    ///     .queue(Queue::stream("payments.stream").max_age(Duration::from_secs(7 * 86_400)));
    /// # let _ = topology;
    /// ```
    pub fn stream(name: impl Into<String>) -> Self {
        Self { queue_type: QueueType::Stream, ..Self::new(name) }
    }

    /// A stream's retention by age (`x-max-age`, in whole seconds): segments older
    /// than this are dropped. Ignored for queues.
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = Some(age);
        self
    }

    /// A stream's retention by size (`x-max-length-bytes`): the oldest segments are
    /// dropped beyond it. Ignored for queues.
    pub fn max_length_bytes(mut self, bytes: u64) -> Self {
        self.max_length_bytes = Some(bytes);
        self
    }

    /// The same queue under another name, its dead-letter queue `<name>.dlq`.
    pub(crate) fn renamed(&self, name: String) -> Self {
        Self { dead_letter: format!("{name}.dlq"), name, ..self.clone() }
    }

    /// Whether it is a [stream](Self::stream).
    pub(crate) fn is_stream(&self) -> bool {
        self.queue_type == QueueType::Stream
    }

    /// Makes it a classic queue: not replicated, and with no delivery count, so a
    /// message that crashes the process on every delivery is not bounded by the
    /// broker. Use only where quorum queues are not available.
    pub fn classic(mut self) -> Self {
        self.queue_type = QueueType::Classic;
        self
    }

    /// Renames the dead-letter queue.
    pub fn dead_letter_queue(mut self, name: impl Into<String>) -> Self {
        self.dead_letter = name.into();
        self
    }

    /// After its handler *started* this many times without an outcome (it crashed or
    /// hung the consumer; counted in `idemq_started` for redelivered messages, not by
    /// the broker's delivery count) the runtime dead-letters a message (kind `poison`)
    /// without running the handler again. Default [`Queue::DEFAULT_DELIVERY_LIMIT`]. The
    /// queue's `x-delivery-limit` is set [`Queue::BROKER_LIMIT_MARGIN`] above it, as a
    /// backstop.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit.max(1);
        self
    }

    /// On a cluster, how many nodes hold a replica of this quorum queue (and of its
    /// dead-letter and wait queues): `x-quorum-initial-group-size`. Default: the
    /// broker's (every node of the cluster, on RabbitMQ 3.x). A quorum queue stays
    /// available while a majority of its replicas is up: 3 survive the loss of one
    /// node, 5 of two. Applies when the queue is created: RabbitMQ refuses (406, a
    /// [`Error::QueueMismatch`]) a different count for an existing queue; change
    /// one's membership with `rabbitmq-queues add_member` / `grow` / `shrink`.
    /// Ignored for classic queues.
    pub fn replicas(mut self, replicas: u32) -> Self {
        self.replicas = Some(replicas.max(1));
        self
    }

    /// A queue that is declared elsewhere on purpose (by another service, by hand, by
    /// a definitions file) and consumed here: idemq declares nothing of it — neither
    /// the queue, its dead-letter queue nor its bindings — but reads what it is
    /// from this description (its dead-letter queue's name, its type, its
    /// [`delivery_limit`](Self::delivery_limit)), and still declares the retry wait
    /// queues that lead back to it. `run` fails if it does not exist.
    ///
    /// A topology that names any queue must name every consumed queue (see
    /// [`RuntimeBuilder::consume`](crate::RuntimeBuilder::consume)): this is how it
    /// names one it does not declare.
    ///
    /// ```
    /// # use idemq::{Queue, Topology};
    /// let topology = Topology::new()
    ///     .queue(Queue::new("payments"))
    ///     .queue(Queue::new("orders").declared_elsewhere());
    /// # let _ = topology;
    /// ```
    pub fn declared_elsewhere(mut self) -> Self {
        self.elsewhere = true;
        self
    }

    /// Binds the queue to `exchange` with `routing_key`.
    pub fn bind(mut self, exchange: impl Into<String>, routing_key: impl Into<String>) -> Self {
        self.bindings.push((exchange.into(), routing_key.into()));
        self
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The dead-letter queue's name.
    pub fn dead_letter_name(&self) -> &str {
        &self.dead_letter
    }

    /// Its bindings: exchange, routing key.
    pub(crate) fn bindings(&self) -> impl Iterator<Item = (&str, &str)> {
        self.bindings.iter().map(|(exchange, key)| (exchange.as_str(), key.as_str()))
    }

    /// What the queue is declared as, in words.
    pub(crate) fn describe(&self) -> String {
        match self.queue_type {
            QueueType::Quorum => {
                let replicas = self.replicas.map(|n| format!(", {n} replicas")).unwrap_or_default();
                format!(
                    "quorum{replicas}, dead letters to {}, delivery limit {}",
                    self.dead_letter, self.delivery_limit
                )
            }
            QueueType::Stream => format!("stream, dead letters to {}", self.dead_letter),
            QueueType::Classic => format!("classic, dead letters to {}", self.dead_letter),
        }
    }

    fn type_arguments(&self, args: &mut FieldTable) {
        if self.queue_type == QueueType::Quorum {
            args.insert("x-queue-type".into(), long_string("quorum"));
            if let Some(replicas) = self.replicas {
                args.insert("x-quorum-initial-group-size".into(), AMQPValue::LongLongInt(replicas.into()));
            }
        }
    }

    /// Arguments of a queue of this queue's type whose dead letters go, at least
    /// once, to `target` through the default exchange.
    fn dead_lettering_to(&self, target: &str) -> FieldTable {
        let mut args = FieldTable::default();
        self.type_arguments(&mut args);
        args.insert("x-dead-letter-exchange".into(), long_string(""));
        args.insert("x-dead-letter-routing-key".into(), long_string(target));
        if self.queue_type == QueueType::Quorum {
            // Both are needed for at-least-once dead-lettering; without
            // reject-publish RabbitMQ silently falls back to at-most-once.
            args.insert("x-dead-letter-strategy".into(), long_string("at-least-once"));
            args.insert("x-overflow".into(), long_string("reject-publish"));
        }
        args
    }

    /// Arguments of its dead-letter queue: of its type (a stream's is a quorum queue)
    /// and, on a quorum queue, [`DEAD_LETTER_DELIVERY_LIMIT`] unless `limit` is
    /// `false` (a DLQ declared before idemq set one: see
    /// [`declare_keeping_old_dead_letter_queue`](Self::declare_keeping_old_dead_letter_queue)).
    fn dead_letter_queue_arguments(&self, limit: bool) -> FieldTable {
        let mut args = FieldTable::default();
        match self.queue_type {
            QueueType::Stream => {
                args.insert("x-queue-type".into(), long_string("quorum"));
            }
            QueueType::Quorum | QueueType::Classic => self.type_arguments(&mut args),
        }
        let quorum = matches!(self.queue_type, QueueType::Quorum | QueueType::Stream);
        if quorum && limit {
            args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(DEAD_LETTER_DELIVERY_LIMIT));
        }
        args
    }

    /// Declares the wait queue that holds retries of this queue for `delay`, then
    /// dead-letters them back here.
    ///
    /// A quorum wait queue gets no `x-delivery-limit`, and needs none on RabbitMQ 4
    /// (whose default is 20): nothing consumes it — its messages leave by their TTL,
    /// dead-lettered back to the queue — and only deliveries to a consumer count.
    /// (Adding the argument would also make every existing wait queue a 406.)
    pub(crate) async fn declare_wait_queue(
        &self,
        channel: &Channel,
        name: &str,
        delay: Duration,
    ) -> Result<(), Error> {
        let mut args = self.dead_lettering_to(&self.name);
        let ttl = i64::try_from(delay.as_millis()).unwrap_or(i64::MAX);
        args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
        declare_queue(channel, name, args).await
    }

    /// Declares the queue (or stream), its dead-letter queue and its bindings.
    ///
    /// Every quorum queue declared here has its `x-delivery-limit` set (RabbitMQ 4.0
    /// gives one without a default of 20): the queue [`BROKER_LIMIT_MARGIN`] above
    /// idemq's own [`delivery_limit`](Self::delivery_limit), its dead-letter queue
    /// [`DEAD_LETTER_DELIVERY_LIMIT`]. Wait queues need none (see
    /// [`declare_wait_queue`](Self::declare_wait_queue)); a stream has no delivery
    /// count. A dead-letter queue that exists without the limit (declared before idemq
    /// set one) is a [`Error::QueueMismatch`] here: `run` keeps it as it is, with a
    /// warning ([`declare_keeping_old_dead_letter_queue`](Self::declare_keeping_old_dead_letter_queue)).
    pub(crate) async fn declare(&self, channel: &Channel) -> Result<(), Error> {
        self.declare_itself(channel).await?;
        declare_queue(channel, &self.dead_letter, self.dead_letter_queue_arguments(true)).await.map_err(
            |err| match err {
                Error::QueueMismatch { queue, detail, declared } if lacks_delivery_limit(&detail) => {
                    let detail = format!(
                        "{detail} (a dead-letter queue declared by an idemq that set no delivery limit on \
                         them; `run` and `declare --apply` keep it as it is, with a warning)"
                    );
                    Error::QueueMismatch { queue, detail, declared }
                }
                other => other,
            },
        )?;
        self.bind_all(channel).await
    }

    /// [`declare`](Self::declare), but a dead-letter queue that exists without an
    /// `x-delivery-limit` — declared by an idemq that set none — is kept as it is,
    /// with a warning, rather than refused: its letters are all there is of some
    /// messages, and RabbitMQ cannot add an argument to a queue (a 406, which closed
    /// `channel`: it is replaced by one opened on `connection`).
    pub(crate) async fn declare_keeping_old_dead_letter_queue(
        &self,
        connection: &lapin::Connection,
        channel: &mut Channel,
    ) -> Result<(), Error> {
        self.declare_itself(channel).await?;
        match declare_queue(channel, &self.dead_letter, self.dead_letter_queue_arguments(true)).await {
            Err(Error::QueueMismatch { detail, .. }) if lacks_delivery_limit(&detail) => {
                crate::base::log::warn!(
                    dlq = %self.dead_letter,
                    "dead-letter queue declared without x-delivery-limit (by an earlier idemq): kept as it is. \
                     On RabbitMQ 4.0 and later it gets the default limit of 20, and a letter returned 20 times \
                     (each `dlq list` returns every letter once) is dropped. Lift it with a policy \
                     (`delivery-limit`), or move its letters and delete it so that idemq declares it again"
                );
                *channel = open_channel(connection).await?;
                declare_queue(channel, &self.dead_letter, self.dead_letter_queue_arguments(false)).await?;
            }
            other => other?,
        }
        self.bind_all(channel).await
    }

    /// On a channel of its own (closed after): the queue as
    /// [`declare_keeping_old_dead_letter_queue`](Self::declare_keeping_old_dead_letter_queue)
    /// does, or with `wait` its wait queue of that name and delay.
    async fn declare_on_a_channel_of_its_own(
        &self,
        connection: &lapin::Connection,
        wait: Option<(&str, Duration)>,
    ) -> Result<(), Error> {
        let mut channel = open_channel(connection).await?;
        let declared = match wait {
            None => self.declare_keeping_old_dead_letter_queue(connection, &mut channel).await,
            Some((name, delay)) => self.declare_wait_queue(&channel, name, delay).await,
        };
        // (A refusal closed it already.)
        if declared.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(1), channel.close(200, "declared".into())).await;
        }
        declared
    }

    /// The queue (or stream) alone: no dead-letter queue, no bindings.
    async fn declare_itself(&self, channel: &Channel) -> Result<(), Error> {
        if self.is_stream() {
            return self.declare_stream(channel).await;
        }
        let mut args = self.dead_lettering_to(&self.dead_letter);
        if self.queue_type == QueueType::Quorum {
            let limit = i64::from(self.delivery_limit + BROKER_LIMIT_MARGIN);
            args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
        }
        // The queue first: a mismatch there is the one the user is asking about.
        declare_queue(channel, &self.name, args).await
    }

    /// A stream, with its retention. Its dead-letter queue is a quorum queue (a
    /// stream cannot dead-letter; idemq publishes the letters there).
    async fn declare_stream(&self, channel: &Channel) -> Result<(), Error> {
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), long_string("stream"));
        if let Some(age) = self.max_age {
            args.insert("x-max-age".into(), long_string(&format!("{}s", age.as_secs().max(1))));
        }
        if let Some(bytes) = self.max_length_bytes {
            args.insert(
                "x-max-length-bytes".into(),
                AMQPValue::LongLongInt(i64::try_from(bytes).unwrap_or(i64::MAX)),
            );
        }
        declare_queue(channel, &self.name, args).await
    }

    async fn bind_all(&self, channel: &Channel) -> Result<(), Error> {
        for (exchange, routing_key) in &self.bindings {
            channel
                .queue_bind(
                    self.name.as_str().into(),
                    exchange.as_str().into(),
                    routing_key.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|source| Error::Amqp {
                    action: format!(
                        "bind queue '{}' to exchange '{exchange}' with '{routing_key}'",
                        self.name
                    ),
                    source,
                })?;
        }
        Ok(())
    }
}

async fn declare_queue(channel: &Channel, name: &str, args: FieldTable) -> Result<(), Error> {
    let options = QueueDeclareOptions { durable: true, ..Default::default() };
    let declared = describe(&args);
    channel.queue_declare(name.into(), options, args).await.map(drop).map_err(|source| {
        if let Some(detail) = precondition_failed(&source) {
            return Error::QueueMismatch { queue: name.to_owned(), detail, declared };
        }
        match home_node_down(&source) {
            Some(detail) => Error::QueueUnavailable { queue: name.to_owned(), detail },
            None => Error::Amqp { action: format!("declare queue '{name}'"), source },
        }
    })
}

/// A channel on `connection`, for declarations.
async fn open_channel(connection: &lapin::Connection) -> Result<Channel, Error> {
    connection
        .create_channel()
        .await
        .map_err(|source| Error::Amqp { action: "open a channel".into(), source })
}

/// Whether a 406's words say the queue exists without the `x-delivery-limit` declared.
fn lacks_delivery_limit(detail: &str) -> bool {
    detail.contains("'x-delivery-limit'") && detail.contains("current is none")
}

/// `durable, x-queue-type=quorum, ...`: what a declaration asks for, for error messages.
fn describe(args: &FieldTable) -> String {
    let mut parts = vec!["durable".to_owned()];
    for (name, value) in args.inner() {
        let value = match value {
            AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            AMQPValue::LongLongInt(n) => n.to_string(),
            other => format!("{other:?}"),
        };
        parts.push(format!("{name}={value}"));
    }
    parts.join(", ")
}

fn long_string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

/// The broker's reply text of a 406 PRECONDITION_FAILED, if that is what `error` is.
fn precondition_failed(error: &lapin::Error) -> Option<String> {
    refusal(error, 406)
}

/// The broker's reply text of a 404 NOT_FOUND saying a queue's home node is down
/// (a classic queue on a lost cluster node).
fn home_node_down(error: &lapin::Error) -> Option<String> {
    refusal(error, 404).filter(|text| text.contains("home node"))
}

fn refusal(error: &lapin::Error, code: u16) -> Option<String> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == code => {
            let text: &ShortString = amqp.get_message();
            Some(text.as_str().to_owned())
        }
        _ => None,
    }
}
