//! [`RuntimeBuilder::build`]: every check made before anything connects — the
//! settings alone, the settings against each other, and the handlers it was given
//! (each queue consumed once, by a handler that agrees on its name, and handler
//! names that can scope dedup rows).

use std::sync::Arc;

use super::builder::Registration;
use super::{Runtime, RuntimeBuilder, DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE};
use crate::error::Error;

impl RuntimeBuilder {
    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::Config`] naming the setting to fix, including a URL the environment
    /// gave twice (`DATABASE_URL` and `DATABASE_URL_FILE`); [`Error::ConfigIo`] for a
    /// URL in a file that cannot be read; [`Error::UnpatchedAmqpParser`] for a program
    /// built with upstream's AMQP parser (see
    /// [`allow_unpatched_amqp_parser`](Self::allow_unpatched_amqp_parser)).
    pub fn build(self) -> Result<Runtime, Error> {
        self.env_urls.check()?;
        if self.consumers.is_empty() {
            return Err(Error::Config("no consumers: add one with `.consume(queue, handler)`".into()));
        }
        // Unreadable URLs fail every attempt alike: refused here, never waited on.
        crate::broker::brokers::Brokers::parse(&self.amqp_url)?;
        // The database URL too, its TLS settings and files included.
        crate::tls::postgres::Target::parse(&self.database_url)?;
        if self.concurrency == 0 || self.concurrency > usize::from(u16::MAX) {
            return Err(Error::Config(format!("concurrency must be 1..=65535, not {}", self.concurrency)));
        }
        if self.prefetch == Some(0) {
            return Err(Error::Config(
                "prefetch must be 1..=65535 (0 would be unlimited: the broker would send the whole queue)"
                    .into(),
            ));
        }
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return Err(Error::Config(format!(
                "batch_size must be 1..={MAX_BATCH_SIZE}, not {}: give `.batch_size(1)` for per-message mode, \
                 or more for group commit (default {DEFAULT_BATCH_SIZE})",
                self.batch_size
            )));
        }
        self.check_handler_queues()?;
        self.check_declared_queues()?;
        if let Some(retention) = &self.retention {
            retention.check(&self.retry_policies())?;
        }
        let holding = crate::broker::consumer_timeout::Holding {
            handler_timeout: self.handler_timeout,
            database_retry_limit: self.database_retry_limit,
            shutdown_deadline: self.shutdown_deadline,
        };
        crate::broker::consumer_timeout::check(holding, self.consumer_timeout)?;
        self.check_unique_queues()?;
        self.check_version_chains()?;
        for warning in self.short_idempotency_keys() {
            crate::base::log::warn!("{warning}");
        }
        if let Some(namespace) = &self.namespace {
            if namespace.is_empty() || namespace.contains('/') {
                return Err(Error::Config(format!(
                    "namespace {namespace:?} must be non-empty and hold no '/' (it is joined to handler names with one)"
                )));
            }
        }
        self.check_handler_names()?;
        self.check_kill_switches()?;
        self.check_handler_limits()?;
        if self.relay.is_none() && self.relay_poll_interval.is_some() {
            return Err(Error::Config(
                "relay_poll_interval is set but the relay is off (`.relay(false)`): drop one of the two"
                    .into(),
            ));
        }
        if self.relay.is_none() && self.reply_ttl.is_some() {
            return Err(Error::Config(
                "reply_ttl is set but the relay is off (`.relay(false)`): the relays that run on their own \
                 take theirs (RelayBuilder::reply_ttl); drop one of the two"
                    .into(),
            ));
        }
        // Last, once the settings are right: the program itself. Cheap (five bytes
        // parsed); the variable is read only for a parser that needs it.
        let parser = crate::broker::parser::parser();
        if parser != crate::broker::parser::Parser::Patched {
            let allowed = self.allow_unpatched_amqp_parser
                || crate::config::env_switch("IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER")?.unwrap_or(false);
            crate::broker::parser::check(&parser, allowed)?;
        }
        Ok(Runtime { builder: self, stats: Arc::default() })
    }

    /// Each handler's queue: named by the handler or at registration, not both
    /// differently.
    pub(super) fn check_handler_queues(&self) -> Result<(), Error> {
        for Registration { queue, handler, .. } in &self.consumers {
            match handler.queue() {
                None if queue.is_empty() => {
                    return Err(Error::Config(format!(
                        "handler `{}` names no queue: register it with `.consume(queue, handler)`",
                        handler.type_path()
                    )));
                }
                Some(own) if own != queue => {
                    return Err(Error::Config(format!(
                        "handler `{}` consumes queue '{own}' (its `queue = ...`), but is registered for '{queue}'; \
                         register it with `.consume(\"{own}\", {})`, or drop its `queue` option",
                        handler.type_path(),
                        handler.name()
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A warning per handler whose provider keeps its idempotency keys for less
    /// than the handler's retry horizon: a retry after that makes the outbound call
    /// again under a key the provider has forgotten.
    pub(super) fn short_idempotency_keys(&self) -> Vec<String> {
        let mut warned = std::collections::HashSet::new();
        let mut warnings = Vec::new();
        for registration in &self.consumers {
            let Some(lifetime) = registration.handler.idempotency_key_lifetime() else { continue };
            let horizon = registration.retry_policy(&self.retry).horizon();
            if horizon > lifetime && warned.insert(registration.handler.name()) {
                let human = crate::base::duration::human;
                warnings.push(format!(
                    "handler `{}` retries for up to {} but its provider keeps an idempotency key for {}: a \
                     retry after that makes the call again unprotected; shorten its retry delays \
                     (`retry(delays = [..])`) to within the key's lifetime",
                    registration.handler.type_path(),
                    human(horizon),
                    human(lifetime),
                ));
            }
        }
        warnings
    }

    /// A topology that names any queue names every consumed queue (see
    /// [`RuntimeBuilder::consume`]).
    pub(super) fn check_declared_queues(&self) -> Result<(), Error> {
        if !self.topology.names_queues() {
            return Ok(());
        }
        for Registration { queue, .. } in &self.consumers {
            if self.topology.find_queue(queue).is_none() {
                return Err(Error::Config(format!(
                    "queue '{queue}' is consumed but the topology does not declare it, so `run` would fail with \
                     the broker's NOT_FOUND; declare it: `.topology(Topology::new().queue(Queue::new(\"{queue}\")))`, \
                     or, if it is declared elsewhere on purpose: `Queue::new(\"{queue}\").declared_elsewhere()`"
                )));
            }
        }
        Ok(())
    }

    /// One handler per queue — or several, one per message type: each handler's
    /// message type has a name on the wire (`#[message(type = "...")]`), a name of
    /// its own on that queue, and the queue is not a stream.
    pub(super) fn check_unique_queues(&self) -> Result<(), Error> {
        let mut queues: Vec<(&str, Vec<&Registration>)> = Vec::new();
        for registration in &self.consumers {
            match queues.iter_mut().find(|(queue, _)| *queue == registration.queue) {
                Some((_, handlers)) => handlers.push(registration),
                None => queues.push((registration.queue.as_str(), vec![registration])),
            }
        }
        for (queue, handlers) in queues.iter().filter(|(_, handlers)| handlers.len() > 1) {
            if self.is_stream(queue) {
                return Err(Error::Config(format!(
                    "stream '{queue}' has {} handlers; a stream is consumed by one handler (routing by message \
                     type is for queues): give each message type a stream of its own",
                    handlers.len()
                )));
            }
            let mut types: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
            for Registration { handler, .. } in handlers {
                let Some(name) = handler.amqp_type() else {
                    return Err(Error::Config(format!(
                        "queue '{queue}' has {} handlers, so each delivery goes to the handler of its message \
                         type, but `{}` takes `{}`, which has no name on the wire: add \
                         `#[message(type = \"...\")]` beside its `#[derive(idemq::Message)]`, or give each queue \
                         one handler",
                        handlers.len(),
                        handler.type_path(),
                        handler.message_type(),
                    )));
                };
                if let Some(other) = types.insert(name, handler.type_path()) {
                    return Err(Error::Config(format!(
                        "queue '{queue}': handlers `{other}` and `{}` both take message type '{name}'; a type goes \
                         to one handler: give one queue to each, or one type to each",
                        handler.type_path()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Each versioned message type's chain goes down one version per step.
    pub(super) fn check_version_chains(&self) -> Result<(), Error> {
        for Registration { handler, .. } in &self.consumers {
            if let Some(Err(gap)) = handler.versions() {
                return Err(Error::Config(format!(
                    "handler `{}`: the versions of its message type have a gap: {gap}",
                    handler.type_path()
                )));
            }
        }
        Ok(())
    }

    /// Handler names: usable as a dedup scope, and one per handler type.
    pub(super) fn check_handler_names(&self) -> Result<(), Error> {
        // The name scopes dedup rows: two handlers sharing one would share rows, and
        // the second's messages would be acked as duplicates without ever running.
        // The same handler on two queues is one handler (its rows are shared on
        // purpose: a key applied from either queue is applied).
        let mut names: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
        for Registration { handler, .. } in &self.consumers {
            let (name, path) = (handler.name(), handler.type_path());
            if name.is_empty() || name.contains('/') {
                return Err(Error::Config(format!(
                    "handler `{path}` is named {name:?}; a handler name must be non-empty and hold no '/': \
                     set another with #[idempotent_handler(name = \"...\")]"
                )));
            }
            match names.insert(name, path) {
                Some(other) if other != path => {
                    return Err(Error::Config(format!(
                        "handlers `{other}` and `{path}` are both named `{name}`, so they would share one dedup \
                         namespace and one's messages would be acked as duplicates of the other's; give each a \
                         stable name of its own with #[idempotent_handler(name = \"...\")]"
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

impl RuntimeBuilder {
    /// Each `handler_kill_switch` names a handler consuming a queue of its own (see
    /// [`crate::engine::flow`]: pausing a shared queue would pause its other handlers).
    fn check_kill_switches(&self) -> Result<(), Error> {
        for (name, _) in &self.handler_kill_switches {
            self.check_consumes_a_queue(
                "handler_kill_switch",
                name,
                "streams have no kill switch: a stream consumer retries in place",
            )?;
            let queues =
                self.consumers.iter().filter(|r| r.handler.name() == name && !self.is_stream(&r.queue));
            for queue in queues.map(|r| r.queue.as_str()) {
                let sharing = self.handlers_of(queue);
                if sharing > 1 {
                    return Err(Error::Config(format!(
                        "handler_kill_switch for {name:?}: its queue '{queue}' is consumed by {sharing} handlers, \
                         and pausing it would pause them all; give the handler a queue of its own"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Each `rate_limit` and `handler_concurrency` names a handler consuming a queue,
    /// with a value that can hold.
    fn check_handler_limits(&self) -> Result<(), Error> {
        for (name, per_second) in &self.rate_limits {
            self.check_consumes_a_queue("rate_limit", name, "a stream consumer has no rate limit")?;
            if *per_second == 0 {
                return Err(Error::Config(format!(
                    "rate_limit for {name:?} is 0: nothing would ever run; give at least 1 per second"
                )));
            }
        }
        for (name, n) in &self.handler_concurrency {
            self.check_consumes_a_queue("handler_concurrency", name, "a stream consumer has none")?;
            if *n == 0 || *n > self.concurrency {
                return Err(Error::Config(format!(
                    "handler_concurrency for {name:?} must be 1..={} (the runtime's concurrency), not {n}",
                    self.concurrency
                )));
            }
        }
        Ok(())
    }

    /// `setting` names `name`: a handler consuming a queue (not only streams: `why`),
    /// else an error that lists the names it may give.
    fn check_consumes_a_queue(&self, setting: &str, name: &str, why: &str) -> Result<(), Error> {
        let queue_handlers =
            || self.consumers.iter().filter(|r| !self.is_stream(&r.queue)).map(|r| r.handler.name());
        if queue_handlers().any(|handler| handler == name) {
            return Ok(());
        }
        let mut names: Vec<&str> = queue_handlers().collect();
        names.sort_unstable();
        names.dedup();
        Err(Error::Config(format!(
            "{setting} names {name:?}, but no handler of that name consumes a queue ({why}); \
             the handlers consuming queues are: {}",
            names.join(", ")
        )))
    }

    /// How many handlers consume `queue` (one per message type when several do).
    pub(super) fn handlers_of(&self, queue: &str) -> usize {
        self.consumers.iter().filter(|r| r.queue == queue).count()
    }

    /// `handler`'s rate limit, if it has one (the last given).
    pub(super) fn rate_limit_of(&self, handler: &str) -> Option<u32> {
        last_given(&self.rate_limits, handler)
    }

    /// `handler`'s concurrency: its own, else the runtime's.
    pub(super) fn concurrency_of(&self, handler: &str) -> usize {
        last_given(&self.handler_concurrency, handler).unwrap_or(self.concurrency)
    }

    /// The kill switch of `handler` on `queue`: its own, else the runtime's; none
    /// on a queue several handlers share.
    pub(super) fn kill_switch_of(
        &self,
        handler: &str,
        queue: &str,
    ) -> Option<crate::engine::flow::KillSwitch> {
        if self.handlers_of(queue) > 1 {
            return None;
        }
        last_given(&self.handler_kill_switches, handler).unwrap_or(self.kill_switch)
    }
}

/// The value last given for `handler` in a per-handler setting's list.
fn last_given<T: Copy>(given: &[(String, T)], handler: &str) -> Option<T> {
    given.iter().rev().find(|(name, _)| name == handler).map(|(_, value)| *value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::context::{Context, HandlerOutput};
    use crate::handler::key::{Key, KeyError, Metadata};
    use crate::handler::Handler;
    use crate::handler::{BoxFuture, HandlerError};
    use diesel_async::AsyncPgConnection;
    use std::time::Duration;

    /// A handler that does nothing (the checks read only its options).
    struct Noop;

    impl Handler for Noop {
        type Message = serde_json::Value;

        fn name(&self) -> &'static str {
            "noop"
        }

        fn key_path(&self) -> &'static str {
            "id"
        }

        fn key(&self, _: &Self::Message, metadata: &Metadata<'_>) -> Result<Key, KeyError> {
            Ok(metadata.hash_key())
        }

        fn handle<'a>(
            &'a self,
            _: &'a mut AsyncPgConnection,
            _: &'a mut Context,
            _: Self::Message,
        ) -> BoxFuture<'a, Result<HandlerOutput, HandlerError>> {
            Box::pin(async { Ok(HandlerOutput::none()) })
        }
    }

    /// A builder that passes every check but the one under test.
    fn builder() -> RuntimeBuilder {
        RuntimeBuilder::new()
            .amqp_url("amqp://guest:secret@127.0.0.1:5672/%2f")
            .database_url("postgres://postgres:secret@127.0.0.1:5432/idemq")
            .consume("payments", Noop)
    }

    fn config_error(builder: RuntimeBuilder) -> String {
        match builder.build() {
            Err(Error::Config(message)) => message,
            other => panic!("expected Error::Config, got {other:?}"),
        }
    }

    #[test]
    fn the_test_builder_builds() {
        builder().build().expect("a valid configuration");
    }

    #[test]
    fn a_consumed_queue_the_topology_does_not_declare_is_refused_with_the_fix() {
        let declared =
            crate::broker::topology::Topology::new().queue(crate::broker::topology::Queue::new("orders"));
        let message = config_error(builder().topology(declared.clone()));
        assert!(
            message.contains("queue 'payments' is consumed but the topology does not declare it"),
            "{message}"
        );
        assert!(
            message.contains(r#"Queue::new("payments")"#) && message.contains(".declared_elsewhere()"),
            "{message}"
        );
        let elsewhere = declared.queue(crate::broker::topology::Queue::new("payments").declared_elsewhere());
        builder().topology(elsewhere).build().expect("declared elsewhere on purpose");
        let exchanges_only = crate::broker::topology::Topology::new()
            .exchange(crate::broker::topology::Exchange::topic("events"));
        builder().topology(exchanges_only).build().expect("a topology that names no queue");
        builder().build().expect("no topology: the queue exists already");
    }

    #[test]
    fn a_batch_size_of_zero_is_refused_with_the_fix() {
        let message = config_error(builder().batch_size(0));
        assert!(message.contains("not 0") && message.contains(".batch_size(1)"), "{message}");
    }

    #[test]
    fn a_reply_ttl_with_the_relay_off_is_refused_either_way_round() {
        for builder in [
            builder().relay(false).reply_ttl(Duration::from_secs(60)),
            builder().reply_ttl(Duration::from_secs(60)).relay(false),
        ] {
            let message = builder.build().expect_err("refused").to_string();
            assert!(message.contains("reply_ttl") && message.contains("drop one"), "{message}");
        }
        builder().reply_ttl(Duration::from_secs(60)).build().expect("the TTL alone");
        let kept = builder().relay(false).reply_ttl(Duration::from_secs(60)).relay(true);
        kept.build().expect("set while off, kept by relay(true)");
    }

    #[test]
    fn a_relay_poll_interval_with_the_relay_off_is_refused_either_way_round() {
        for builder in [
            builder().relay(false).relay_poll_interval(Duration::from_millis(50)),
            builder().relay_poll_interval(Duration::from_millis(50)).relay(false),
        ] {
            let message = config_error(builder);
            assert!(message.contains("relay_poll_interval") && message.contains("drop one"), "{message}");
        }
        builder().relay(false).build().expect("the relay off alone");
        builder().relay_poll_interval(Duration::from_millis(50)).build().expect("the interval alone");
    }

    #[test]
    fn a_poll_interval_survives_turning_the_relay_off_and_on_again() {
        let builder = builder().relay(false).relay_poll_interval(Duration::from_millis(50)).relay(true);
        assert_eq!(builder.relay.map(|settings| settings.poll_interval), Some(Duration::from_millis(50)));
    }

    /// `Noop` with a provider that keeps idempotency keys for a minute.
    struct ShortKeys;

    impl Handler for ShortKeys {
        type Message = serde_json::Value;

        fn name(&self) -> &'static str {
            "charge"
        }

        fn key_path(&self) -> &'static str {
            "id"
        }

        fn key(&self, _: &Self::Message, metadata: &Metadata<'_>) -> Result<Key, KeyError> {
            Ok(metadata.hash_key())
        }

        fn idempotency_key_lifetime(&self) -> Option<Duration> {
            Some(Duration::from_secs(60))
        }

        fn handle<'a>(
            &'a self,
            _: &'a mut AsyncPgConnection,
            _: &'a mut Context,
            _: Self::Message,
        ) -> BoxFuture<'a, Result<HandlerOutput, HandlerError>> {
            Box::pin(async { Ok(HandlerOutput::none()) })
        }
    }

    #[test]
    fn a_provider_key_lifetime_shorter_than_the_retry_horizon_is_warned_about_once() {
        let long = crate::base::retry::RetryPolicy::new([Duration::from_secs(30), Duration::from_secs(300)]);
        let runtime = builder().consume("charges", ShortKeys).consume("refunds", ShortKeys).retry(long);
        let warnings = runtime.short_idempotency_keys();
        assert_eq!(warnings.len(), 1, "one per handler: {warnings:?}");
        assert!(warnings[0].contains("ShortKeys") && warnings[0].contains("for 1m"), "{warnings:?}");
        runtime.build().expect("a warning, not a refusal");
        let short = crate::base::retry::RetryPolicy::new([Duration::from_secs(5), Duration::from_secs(30)]);
        let within = builder().consume("charges", ShortKeys).retry(short);
        assert_eq!(within.short_idempotency_keys(), Vec::<String>::new());
        assert_eq!(builder().short_idempotency_keys(), Vec::<String>::new(), "no lifetime declared");
    }

    #[test]
    fn debug_redacts_the_urls() {
        let printed = format!("{:?}", builder());
        assert!(!printed.contains("secret"), "{printed}");
        assert!(printed.contains("payments"), "{printed}");
    }
}
