//! Code written against 0.1's crate root still compiles in this release: every old
//! root name resolves to the item at its new path (deprecated, with the new path in
//! the warning). Compile-time checks; the assertions only tie each name to its
//! replacement. Delete with `src/deprecated.rs`.

#![allow(deprecated)]

use std::any::TypeId;

fn same<A: 'static, B: 'static>() -> bool {
    TypeId::of::<A>() == TypeId::of::<B>()
}

#[test]
fn the_old_root_types_are_the_new_ones() {
    assert!(same::<idemq::Settled, idemq::observe::Settled>());
    assert!(same::<idemq::ConnectionEvent, idemq::observe::ConnectionEvent>());
    assert!(same::<idemq::Stats, idemq::observe::Stats>());
    assert!(same::<idemq::StatsSnapshot, idemq::observe::StatsSnapshot>());
    assert!(same::<idemq::RelayPass, idemq::observe::RelayPass>());
    assert!(same::<idemq::Sweep, idemq::observe::Sweep>());
    assert!(same::<idemq::Outgoing, idemq::outbox::Outgoing>());
    assert!(same::<idemq::PublishError, idemq::outbox::PublishError>());
    assert!(same::<idemq::Relay, idemq::outbox::Relay>());
    assert!(same::<idemq::RelayBuilder, idemq::outbox::RelayBuilder>());
    assert!(same::<idemq::Retention, idemq::store::Retention>());
    assert!(same::<idemq::CheckedRetention, idemq::store::CheckedRetention>());
    assert!(same::<idemq::KeyError, idemq::key::KeyError>());
    assert!(same::<idemq::TemplatePart<'static>, idemq::key::TemplatePart<'static>>());
}

/// The one old root name that did not stay: `idemq::Batch` is now the batch handlers'
/// [`idemq::Batch<M>`] (0.1's observer event is `idemq::observe::Batch`).
#[test]
fn the_root_batch_is_the_handlers_batch_not_the_observers() {
    assert!(!same::<idemq::Batch<()>, idemq::observe::Batch<'static>>());
}

#[test]
fn the_old_root_constants_keep_their_values() {
    assert_eq!(idemq::DEFAULT_DELIVERY_LIMIT, idemq::Queue::DEFAULT_DELIVERY_LIMIT);
    assert_eq!(idemq::BROKER_LIMIT_MARGIN, idemq::Queue::BROKER_LIMIT_MARGIN);
    assert_eq!(idemq::DEFAULT_BATCH_SIZE, idemq::RuntimeBuilder::DEFAULT_BATCH_SIZE);
    assert_eq!(idemq::DEFAULT_CONCURRENCY, idemq::RuntimeBuilder::DEFAULT_CONCURRENCY);
    assert_eq!(idemq::DEFAULT_AMQP_URL, idemq::connect::DEFAULT_AMQP_URL);
    assert_eq!(idemq::DEFAULT_DATABASE_URL, idemq::connect::DEFAULT_DATABASE_URL);
    assert_eq!(idemq::MAX_ERROR_HEADER_BYTES, idemq::headers::MAX_ERROR_HEADER_BYTES);
    assert_eq!(idemq::MAX_STORED_KEY_BYTES, idemq::key::MAX_STORED_KEY_BYTES);
    assert_eq!(idemq::MIGRATION_LOCK, idemq::store::MIGRATION_LOCK);
    assert_eq!(idemq::GC_LOCK, idemq::store::GC_LOCK);
}

#[test]
fn the_old_root_functions_and_traits_still_resolve() {
    assert_eq!(idemq::redact("amqp://u:secret@h/"), idemq::connect::redact("amqp://u:secret@h/"));
    let _: fn(&str, &str) -> Result<String, idemq::Error> = idemq::env_url;
    fn takes_observer<T: idemq::Observe>() {}
    takes_observer::<idemq::observe::Stats>();
    fn takes_key_field<T: idemq::KeyField>() {}
    takes_key_field::<String>();
    let _ = idemq::schema::idemq_dedup::table;
    // `RuntimeBuilder`'s old registration and observer methods.
    let _ = idemq::Runtime::builder().observer(|_| {}).on_connection_event(|_| {});
}
