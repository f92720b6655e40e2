//! The `payments` demo: exactly-once ledger updates from RabbitMQ.
//!
//! Run with: `cargo run -p idemq-example-payments -- demo`
//!
//! A `payments` queue (quorum, dead-letter queue `payments.dlq`) carries
//! `{"payment_id": string, "account": string, "amount_cents": integer}`. The handler
//! inserts a `ledger` row and adds the amount to `accounts`, in the transaction that
//! also records the dedup row for `payment_id`. `ledger` has no unique constraint on
//! `payment_id` on purpose: it is the witness that idemq, not the schema, prevents
//! doubles.

use diesel::prelude::*;
use diesel::upsert::excluded;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemq::{idempotent_handler, Batch, Context, Exchange, HandlerError, Message, Queue, Topology};
use serde::{Deserialize, Serialize};

pub mod demo;
pub mod orders;
pub mod orders_run;

/// The queue the demo consumes.
pub const QUEUE: &str = "payments";
/// The stream the demo also consumes, exactly once, with the offset kept in the
/// handler's transaction and no dedup rows ([`apply_stream_payment`]).
pub const STREAM: &str = "payments.stream";
/// The queue every applied payment's [`PaymentApplied`] event lands in.
pub const EVENTS_QUEUE: &str = "payments.applied";
/// The fanout exchange the events are published to; [`EVENTS_QUEUE`] is bound to it
/// (so are the demo's own watchers).
pub const EVENTS_EXCHANGE: &str = <PaymentApplied as Message>::EXCHANGE;
/// The demo's default database (created if missing).
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/idemq_demo";

diesel::table! {
    /// Every applied payment, one row each; deliberately no unique constraint.
    ledger (id) {
        /// Row id.
        id -> Int8,
        /// The payment's idempotency key.
        payment_id -> Text,
        /// The account credited.
        account -> Text,
        /// The amount, in cents.
        amount_cents -> Int8,
    }
}

diesel::table! {
    /// Balances, the sum of each account's applied payments.
    accounts (account) {
        /// The account.
        account -> Text,
        /// The balance, in cents.
        balance_cents -> Int8,
    }
}

/// A payment to apply.
// `JsonSchema` (with idemq's feature `schemars`): `payments asyncapi` gives its
// payload's schema, these doc comments as its descriptions; without it, only
// `{"type": "object"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PaymentRequested {
    /// The idempotency key.
    pub payment_id: String,
    /// The account credited.
    pub account: String,
    /// The amount, in cents.
    pub amount_cents: i64,
}

/// The event published (through idemq's outbox) for every applied payment, to the
/// exchange `payments.events`, which the queue `payments.applied` is bound to. Every
/// copy of one payment's event carries the same AMQP `message_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Message, schemars::JsonSchema)]
#[message(exchange = "payments.events", routing_key = "payment.applied")]
pub struct PaymentApplied {
    /// The payment's idempotency key.
    pub payment_id: String,
    /// The account credited.
    pub account: String,
    /// The amount, in cents.
    pub amount_cents: i64,
}

impl From<PaymentRequested> for PaymentApplied {
    /// The event of an applied payment.
    fn from(msg: PaymentRequested) -> Self {
        Self { payment_id: msg.payment_id, account: msg.account, amount_cents: msg.amount_cents }
    }
}

/// Applies the new payments of one transaction together — one multi-row ledger
/// insert and one balance upsert for all of them ([`record_payments`]) — and publishes
/// a [`PaymentApplied`] event per payment. Runs inside idemq's dedup transaction, so a
/// redelivered payment is never applied twice, and the events go out once the
/// transaction commits (never if it rolls back). A batch handler: see the guide, `docs/handlers.md`,
/// "Batch handlers: when to choose them"; [`apply_payment_each`] is the same effect
/// one payment at a time.
#[idempotent_handler(key = "payment_id", lane = "account")]
pub async fn apply_payment(
    conn: &mut AsyncPgConnection,
    batch: &mut Batch<PaymentRequested>,
) -> Result<(), HandlerError> {
    record_payments(conn, batch.messages()).await?;
    for (msg, ctx) in batch.iter_mut() {
        ctx.send(&PaymentApplied::from(msg.clone()))?;
    }
    Ok(())
}

/// The payments of [`STREAM`]: the same effect (a ledger row, the balance) with **no
/// dedup row** — the stream consumer keeps its offset in this transaction and resumes
/// after it, so each payment of the stream is applied once.
#[idempotent_handler(key = "payment_id", dedup = false)]
pub async fn apply_stream_payment(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    Ok(())
}

/// [`apply_payment`] one payment at a time (the same dedup name, so the same dedup
/// rows): one ledger row, one balance update, one event per handler call. For
/// comparison (the benchmark runs both).
#[idempotent_handler(key = "payment_id", name = "apply_payment", lane = "account")]
pub async fn apply_payment_each(
    conn: &mut AsyncPgConnection,
    msg: PaymentRequested,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    record_payment(conn, &msg).await?;
    let event = PaymentApplied::from(msg);
    ctx.send(&event)?;
    Ok(())
}

/// The effect of several payments on the demo's tables, in two statements: one
/// `INSERT … VALUES (..), (..)` into `ledger`, and one upsert into `accounts` with
/// each account's total. The amounts are summed per account first — PostgreSQL
/// refuses an `ON CONFLICT DO UPDATE` that touches one row twice in a statement
/// ("command cannot affect row a second time") — and the accounts go in sorted
/// order, so concurrent batches lock their rows in one order (no deadlock between
/// them). Does nothing for no payments.
///
/// # Errors
/// The database's; a total beyond `i64` is refused as PostgreSQL refuses a balance
/// beyond `bigint`.
pub async fn record_payments(
    conn: &mut AsyncPgConnection,
    payments: &[PaymentRequested],
) -> Result<(), diesel::result::Error> {
    if payments.is_empty() {
        return Ok(());
    }
    let rows: Vec<_> = payments
        .iter()
        .map(|msg| {
            (
                ledger::payment_id.eq(&msg.payment_id),
                ledger::account.eq(&msg.account),
                ledger::amount_cents.eq(msg.amount_cents),
            )
        })
        .collect();
    diesel::insert_into(ledger::table).values(rows).execute(conn).await?;
    let mut totals: std::collections::BTreeMap<&str, i64> = std::collections::BTreeMap::new();
    for msg in payments {
        let total = totals.entry(msg.account.as_str()).or_default();
        *total = total.checked_add(msg.amount_cents).ok_or_else(|| {
            diesel::result::Error::QueryBuilderError(
                format!("the payments to account {} add up beyond a bigint", msg.account).into(),
            )
        })?;
    }
    let balances: Vec<_> = totals
        .into_iter()
        .map(|(account, total)| (accounts::account.eq(account), accounts::balance_cents.eq(total)))
        .collect();
    diesel::insert_into(accounts::table)
        .values(balances)
        .on_conflict(accounts::account)
        .do_update()
        .set(accounts::balance_cents.eq(accounts::balance_cents + excluded(accounts::balance_cents)))
        .execute(conn)
        .await?;
    Ok(())
}

/// The payment's effect on the demo's tables (without the event): for callers with
/// a transaction of their own, like the benchmark's hand-written baseline.
///
/// # Errors
/// The database's.
pub async fn record_payment(
    conn: &mut AsyncPgConnection,
    msg: &PaymentRequested,
) -> Result<(), diesel::result::Error> {
    diesel::insert_into(ledger::table)
        .values((
            ledger::payment_id.eq(&msg.payment_id),
            ledger::account.eq(&msg.account),
            ledger::amount_cents.eq(msg.amount_cents),
        ))
        .execute(conn)
        .await?;
    diesel::insert_into(accounts::table)
        .values((accounts::account.eq(&msg.account), accounts::balance_cents.eq(msg.amount_cents)))
        .on_conflict(accounts::account)
        .do_update()
        .set(accounts::balance_cents.eq(accounts::balance_cents + excluded(accounts::balance_cents)))
        .execute(conn)
        .await?;
    Ok(())
}

/// The demo's topology: the `payments` quorum queue and its `payments.dlq`, the
/// `payments.events` fanout exchange the events are published to, and the
/// `payments.applied` quorum queue bound to it, where they land (quorum, so that on
/// a cluster they survive the loss of a node).
pub fn topology() -> Topology {
    Topology::new()
        .exchange(Exchange::fanout(EVENTS_EXCHANGE))
        // What the handlers publish there (for the AsyncAPI document: `payments asyncapi`).
        .message::<PaymentApplied>()
        .queue(Queue::new(QUEUE))
        .queue(Queue::new(EVENTS_QUEUE).bind(EVENTS_EXCHANGE, ""))
        // A day of payments: a stream keeps what was read, until its retention.
        .queue(Queue::stream(STREAM).max_age(std::time::Duration::from_secs(86_400)))
}

/// The demo's own tables (`ledger`, `accounts`) as diesel migrations: `payments
/// migrate` and `payments run` apply them after idemq's, under idemq's migration lock
/// (`Cli::migrations`), and `payments migrate --status` lists them beside idemq's.
///
/// `ledger.id` is an identity column, not a `bigserial`: a role with only INSERT on
/// the table can add rows (a serial's `nextval` needs USAGE on its sequence; an
/// identity column's needs nothing more). A `ledger` made by an earlier version keeps
/// its `bigserial`: grant USAGE on `ledger_id_seq` there.
pub const MIGRATIONS: diesel_migrations::EmbeddedMigrations =
    diesel_migrations::embed_migrations!("migrations");

/// Errors of the demo's own set-up. As idemq's, a cause is the `source` and not
/// repeated in the message: print one with [`report`].
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// idemq's migrations or connection failed.
    #[error(transparent)]
    Idemq(#[from] idemq::Error),
    /// A database statement failed.
    #[error("could not {context}")]
    Database {
        /// What was being done (any URL in it redacted).
        context: String,
        /// The driver's error.
        #[source]
        source: diesel::result::Error,
    },
}

fn db_error(context: impl Into<String>) -> impl FnOnce(diesel::result::Error) -> SetupError {
    let context = context.into();
    move |source| SetupError::Database { context, source }
}

/// Creates the database if missing, then applies idemq's migrations and the demo's
/// ([`MIGRATIONS`]): what `payments migrate` does, for tests and the demo.
///
/// Several processes may run it at once: both sets of migrations run under idemq's
/// migration lock ([`idemq::store::MIGRATION_LOCK`]).
///
/// On a database where all of it exists it runs no DDL and touches no other database,
/// so `payments run` works as a role with only SELECT, INSERT, UPDATE and DELETE on
/// the tables (see `docs/security.md`, *Least privilege*).
///
/// # Errors
/// When PostgreSQL is unreachable or refuses a statement.
pub async fn migrate(database_url: &str) -> Result<(), SetupError> {
    create_database(database_url).await?;
    idemq::migrate(database_url).await?;
    idemq::store::migrate_with(database_url, MIGRATIONS).await?;
    Ok(())
}

/// The demo's set-up step (`Cli::setup`): creates the database named in
/// `database_url` if it cannot be reached and does not exist.
///
/// # Errors
/// When PostgreSQL is unreachable or refuses to create it.
pub async fn create_database(database_url: &str) -> Result<(), SetupError> {
    // Only a database that cannot be reached is looked up (and created) from the
    // server's `postgres` database, which a least-privilege role may not connect to.
    if connect(database_url).await.is_err() {
        ensure_database(database_url).await?;
        connect(database_url).await?;
    }
    Ok(())
}

/// A look-up's answer.
#[derive(QueryableByName)]
struct Exists {
    #[diesel(sql_type = diesel::sql_types::Bool)]
    exists: bool,
}

/// Connects to `url`; an error names the URL redacted.
async fn connect(url: &str) -> Result<AsyncPgConnection, SetupError> {
    // As idemq connects: TLS as the URL's sslmode says.
    Ok(idemq::connect::database(url).await?)
}

/// Creates the database named in `database_url` if it does not exist.
async fn ensure_database(database_url: &str) -> Result<(), SetupError> {
    // Only a URL names a database to create (`host=… dbname=…` strings are left to the server).
    let Ok(mut admin) = url::Url::parse(database_url) else {
        return Ok(());
    };
    let name = admin.path().trim_start_matches('/').to_owned();
    if name.is_empty() || name == "postgres" {
        return Ok(());
    }
    let name = percent_encoding::percent_decode_str(&name).decode_utf8_lossy().into_owned();
    admin.set_path("/postgres");
    let admin_url = String::from(admin);
    let mut admin = connect(&admin_url).await?;
    let found: Exists =
        diesel::sql_query("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1) AS exists")
            .bind::<diesel::sql_types::Text, _>(&name)
            .get_result(&mut admin)
            .await
            .map_err(db_error("look up the database"))?;
    if !found.exists {
        let quoted = name.replace('"', "\"\"");
        match diesel::sql_query(format!("CREATE DATABASE \"{quoted}\"")).execute(&mut admin).await {
            Ok(_) => {}
            // Another process created it between our look-up and CREATE.
            Err(diesel::result::Error::DatabaseError(_, info))
                if info.message().contains("already exists") => {}
            Err(err) => return Err(db_error(format!("create database {name}"))(err)),
        }
    }
    Ok(())
}
