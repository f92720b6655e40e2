//! What a [`RuntimeBuilder`] would do, read without running it: its URLs, policies
//! and declarations, for the CLI (`declare`, `status`, `dlq`, `run --queue`) and the
//! test kit.

use super::builder::Registration;
use super::RuntimeBuilder;
use crate::base::duration::human;
use crate::base::observe::Observers;
use std::time::Duration;

use crate::base::retry::RetryPolicy;
use crate::broker::asyncapi::Receiver;
use crate::engine::startup::Startup;
use crate::error::Error;

impl RuntimeBuilder {
    /// The broker URL this builder holds.
    pub(crate) fn configured_amqp_url(&self) -> &str {
        &self.amqp_url
    }

    /// The database URL this builder holds.
    pub(crate) fn configured_database_url(&self) -> &str {
        &self.database_url
    }

    /// A start-up wait with this builder's timeout and backoff, for what the CLI
    /// does before `run` (its set-up and migrations need the database).
    pub(crate) fn startup(&self) -> Startup {
        Startup::new(self.startup_timeout, self.reconnect_max, Observers::default())
    }

    /// Keeps only the consumers of `queues`; a queue nobody consumes is an error.
    pub(crate) fn only_queues(mut self, queues: &[String]) -> Result<Self, Error> {
        for queue in queues {
            if !self.consumers.iter().any(|r| &r.queue == queue || r.handler.queue() == Some(queue.as_str()))
            {
                let known: Vec<&str> = self.consumers.iter().map(|r| r.queue.as_str()).collect();
                return Err(Error::Config(format!(
                    "--queue {queue}: no handler consumes it; the consumed queues are {}",
                    known.join(", ")
                )));
            }
        }
        self.consumers.retain(|r| queues.contains(&r.queue));
        Ok(self)
    }

    /// Whether `queue` is declared as a [stream](crate::Queue::stream): its consumer
    /// is a stream consumer (see `engine::stream`).
    pub(crate) fn is_stream(&self, queue: &str) -> bool {
        self.topology.find_queue(queue).is_some_and(crate::broker::topology::Queue::is_stream)
    }

    /// The retry wait queues of `queue` under `retry`: none for a stream, whose
    /// consumer retries in place (nothing can be taken out of a stream to wait).
    pub(crate) fn wait_queues_of(&self, queue: &str, retry: &RetryPolicy) -> Vec<(String, Duration)> {
        if self.is_stream(queue) {
            return Vec::new();
        }
        retry.wait_queues(queue)
    }

    /// Every consumer's retry policy, as `run` uses it.
    pub(crate) fn retry_policies(&self) -> Vec<RetryPolicy> {
        self.consumers.iter().map(|r| r.retry_policy(&self.retry)).collect()
    }

    /// Every queue `declare` and `status` show, grouped: the topology's queues in its
    /// order, then the consumed queues it does not name (`run` declares those with
    /// the defaults), each with its dead-letter queue, its consumers' retry wait
    /// queues (none for a stream) and the names of the handlers that consume it.
    pub(crate) fn queue_plans(&self) -> Vec<QueuePlan> {
        let mut plans: Vec<QueuePlan> = self
            .topology
            .queues()
            .iter()
            .map(|queue| QueuePlan {
                declared_here: !queue.elsewhere,
                queue: queue.clone(),
                waits: Vec::new(),
                handlers: Vec::new(),
            })
            .collect();
        for (registration, retry) in self.consumers.iter().zip(self.retry_policies()) {
            let queue = &registration.queue;
            let at = match plans.iter().position(|plan| plan.queue.name() == queue) {
                Some(at) => at,
                None => {
                    let queue = self.topology.queue_or_default(queue);
                    plans.push(QueuePlan {
                        queue,
                        declared_here: true,
                        waits: Vec::new(),
                        handlers: Vec::new(),
                    });
                    plans.len() - 1
                }
            };
            let plan = &mut plans[at];
            plan.handlers.push(registration.handler.name().to_owned());
            // Two handlers of one queue with one policy share its wait queues.
            for wait in self.wait_queues_of(queue, &retry) {
                if !plan.waits.iter().any(|(name, _)| *name == wait.0) {
                    plan.waits.push(wait);
                }
            }
        }
        plans
    }

    /// The application's contract as an AsyncAPI 3.0 document (JSON; the CLI's
    /// `asyncapi` prints it): the topology's queues and exchanges as channels with
    /// their AMQP bindings, a `receive` operation per handler (its key and dedup in
    /// `x-idemq-*` extensions), a `send` operation per message type the topology
    /// names ([`Topology::message`](crate::Topology::message)). Payloads are named
    /// by their Rust type; their fields are not described yet.
    pub fn asyncapi(&self, title: &str, version: &str) -> serde_json::Value {
        let receivers: Vec<Receiver<'_>> = self
            .consumers
            .iter()
            .map(|registration| Receiver {
                queue: &registration.queue,
                handler: registration.handler.name(),
                key: registration.handler.key_path(),
                dedup: registration.handler.dedup(),
                reply: registration.handler.reply_type(),
                saga: registration.handler.saga(),
                message: crate::broker::asyncapi::Shown {
                    schema: registration.handler.payload_schema(),
                    rust_type: registration.handler.message_type(),
                    wire_type: registration.handler.amqp_type(),
                    version: registration
                        .handler
                        .versions()
                        .and_then(|chain| chain.ok()?.first().map(|step| step.0)),
                },
            })
            .collect();
        crate::broker::asyncapi::document(&self.topology, &receivers, title, version)
    }

    /// The bindings the topology declares: queue, exchange, routing key.
    pub(crate) fn bindings(&self) -> Vec<(&str, &str, &str)> {
        self.topology
            .queues()
            .iter()
            .filter(|queue| !queue.elsewhere)
            .flat_map(|queue| queue.bindings().map(move |(exchange, key)| (queue.name(), exchange, key)))
            .collect()
    }

    /// The exchanges the topology declares, by name.
    pub(crate) fn exchange_names(&self) -> Vec<String> {
        self.topology.exchange_names().map(str::to_owned).collect()
    }

    /// The exchanges the topology declares: name and kind.
    pub(crate) fn exchanges(&self) -> Vec<(String, String)> {
        self.topology.exchanges().iter().map(|e| (e.name().to_owned(), e.kind().to_owned())).collect()
    }

    /// Declares what `run` declares — the topology and the consumers' wait queues —
    /// through the runtime's own declaration, strictly: a queue that is unavailable
    /// (its node down) is an error here, not skipped.
    pub(crate) async fn declare_all(&self, connection: &lapin::Connection) -> Result<(), Error> {
        let declared: Vec<_> =
            self.consumers.iter().map(|r| self.topology.queue_or_default(&r.queue)).collect();
        // A consumed queue the topology does not name is declared by `run` with the
        // defaults (its consumer declares it): here too.
        let mut topology = self.topology.clone();
        for queue in &declared {
            if topology.find_queue(queue.name()).is_none() {
                topology = topology.queue(queue.clone());
            }
        }
        let waits: Vec<_> = self
            .consumers
            .iter()
            .zip(self.retry_policies())
            .zip(&declared)
            .flat_map(|((Registration { queue, .. }, retry), declared)| {
                self.wait_queues_of(queue, &retry)
                    .into_iter()
                    .map(move |(name, delay)| (declared, name, delay))
            })
            .collect();
        topology.declare_available(connection, &waits, |_| true).await
    }

    /// Every consumed or declared queue with its dead-letter queue.
    pub(crate) fn consumed_queues(&self) -> Vec<(String, String)> {
        let mut queues: Vec<(String, String)> = self
            .topology
            .queues()
            .iter()
            .map(|queue| (queue.name().to_owned(), queue.dead_letter_name().to_owned()))
            .collect();
        for Registration { queue, .. } in &self.consumers {
            if !queues.iter().any(|(name, _)| name == queue) {
                let declared = self.topology.queue_or_default(queue);
                queues.push((queue.clone(), declared.dead_letter_name().to_owned()));
            }
        }
        queues
    }
}

/// One queue as `declare` and `status` show it, with what belongs to it.
pub struct QueuePlan {
    /// The queue as declared: the topology's, or the defaults `run` gives a
    /// consumed queue the topology does not name.
    pub queue: crate::broker::topology::Queue,
    /// Whether idemq declares it (`declare --apply`, `run`): not when it is
    /// [declared elsewhere](crate::broker::topology::Queue::declared_elsewhere).
    pub declared_here: bool,
    /// Its retry wait queues (name, delay), each once.
    pub waits: Vec<(String, Duration)>,
    /// The names of the handlers consuming it, in registration order.
    pub handlers: Vec<String>,
}

impl QueuePlan {
    /// Its name, its dead-letter queue's and its wait queues'.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        [self.queue.name(), self.queue.dead_letter_name()]
            .into_iter()
            .chain(self.waits.iter().map(|(name, _)| name.as_str()))
    }

    /// Its wait queues' delays, in words: `1s, 5s, 30s, 2m, 10m`.
    pub fn wait_delays(&self) -> String {
        self.waits.iter().map(|(_, delay)| human(*delay).to_string()).collect::<Vec<_>>().join(", ")
    }
}
