//! The order saga: an order is placed, its payment reserved, then it ships and the
//! payment is captured — or, if it has not shipped within [`PAYMENT_WINDOW`], the
//! reservation is released.
//!
//! ```text
//!  OrderPlaced ──> Placed ── PaymentReserved ──> Reserved ── OrderShipped ──> Shipped (completed:
//!   (starts it;        │                             │                          CapturePayment sent,
//!   schedules the      └──────── PaymentExpired ─────┴──> Released (completed:  the timeout cancelled)
//!   PaymentExpired                 (the timeout)          ReleasePayment sent)
//!   timeout)
//! ```
//!
//! Every message comes in on one queue, [`ORDERS`], each type to its step (the AMQP
//! `type`); every step is an `#[idempotent_handler]` taking the saga: a duplicate or
//! a redelivery runs no step twice, two steps of one order never run at once (the
//! saga's row is locked), and what a step sends and schedules commits with its state.
//! `payments orders` runs it over a burst of orders (`orders_run.rs`); its tests are
//! in `examples/tests/orders.rs`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemq::saga::Saga;
use idemq::{idempotent_handler, Context, HandlerError, Message, Permanent};
use serde::{Deserialize, Serialize};

/// The queue every message of the saga comes in on.
pub const ORDERS: &str = "orders";

/// How long a placed order waits to ship before its payment is released.
pub const PAYMENT_WINDOW: Duration = Duration::from_secs(15 * 60);

/// The window in force, in ms (0: [`PAYMENT_WINDOW`]); `payments orders --window`
/// shortens it so its timeouts fire while you watch.
static WINDOW_MS: AtomicU64 = AtomicU64::new(0);

/// Sets the payment window of the orders placed from now on (a demo's: a shop has
/// one window, [`PAYMENT_WINDOW`]).
pub fn set_payment_window(window: Duration) {
    WINDOW_MS.store(u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1), Ordering::Relaxed);
}

/// The payment window in force.
pub fn payment_window() -> Duration {
    match WINDOW_MS.load(Ordering::Relaxed) {
        0 => PAYMENT_WINDOW,
        ms => Duration::from_millis(ms),
    }
}

/// An order was placed: starts its saga.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Message)]
#[message(type = "order.placed", exchange = "", routing_key = "orders")]
pub struct OrderPlaced {
    /// The order, and the saga's correlation key.
    pub order_id: String,
    /// What it costs, in cents.
    pub amount_cents: i64,
}

/// The payment service reserved the order's amount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Message)]
#[message(type = "payment.reserved", exchange = "", routing_key = "orders")]
pub struct PaymentReserved {
    /// The order.
    pub order_id: String,
    /// The reservation, to capture or release.
    pub payment_id: String,
}

/// The warehouse shipped the order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Message)]
#[message(type = "order.shipped", exchange = "", routing_key = "orders")]
pub struct OrderShipped {
    /// The order.
    pub order_id: String,
}

/// The saga's timeout: scheduled when the order is placed, due after
/// [`PAYMENT_WINDOW`], cancelled if the order ships first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Message)]
#[message(type = "order.payment_expired", exchange = "", routing_key = "orders")]
pub struct PaymentExpired {
    /// The order.
    pub order_id: String,
}

/// Sent to the payment service once the order shipped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Message)]
#[message(type = "payment.capture", exchange = "", routing_key = "payments.capture")]
pub struct CapturePayment {
    /// The order.
    pub order_id: String,
    /// The reservation to capture.
    pub payment_id: String,
    /// How much.
    pub amount_cents: i64,
}

/// Sent to the payment service when the order did not ship in time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Message)]
#[message(type = "payment.release", exchange = "", routing_key = "payments.release")]
pub struct ReleasePayment {
    /// The order.
    pub order_id: String,
    /// The reservation to release (none if none was made).
    pub payment_id: Option<String>,
}

/// Where an order is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Placed, waiting for its payment.
    #[default]
    Placed,
    /// Its payment is reserved, waiting to ship.
    Reserved,
    /// Shipped, the payment captured: done.
    Shipped,
    /// Not shipped in time, the payment released: done.
    Released,
}

/// The order saga's state, in `idemq_saga` under the name `order` and the order id.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, idemq::saga::Saga)]
#[saga(
    name = "order",
    key = "order_id",
    takes(OrderPlaced, PaymentReserved, OrderShipped, PaymentExpired),
    sends(CapturePayment, ReleasePayment, PaymentExpired),
    keep_finished = "7d"
)]
pub struct Order {
    /// Where it is.
    pub status: Status,
    /// What it costs, in cents.
    pub amount_cents: i64,
    /// The payment reservation, once made.
    pub payment_id: Option<String>,
}

/// Starts the saga and schedules its timeout, [`payment_window`] ahead.
#[idempotent_handler(key = "order_id", saga(start))]
pub async fn order_placed(
    _conn: &mut AsyncPgConnection,
    msg: OrderPlaced,
    saga: &mut Saga<Order>,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    saga.amount_cents = msg.amount_cents;
    saga.schedule(ctx, &PaymentExpired { order_id: msg.order_id }, payment_window())?;
    Ok(())
}

/// Records the reservation. A reservation that overtook its order's placing waits
/// for it (retried: `missing` is `retry` by default).
#[idempotent_handler(key = "payment_id")]
pub async fn payment_reserved(
    _conn: &mut AsyncPgConnection,
    msg: PaymentReserved,
    saga: &mut Saga<Order>,
) -> Result<(), HandlerError> {
    if saga.status == Status::Placed {
        saga.status = Status::Reserved;
        saga.payment_id = Some(msg.payment_id);
    }
    Ok(())
}

/// Captures the payment and completes the saga (its timeout is cancelled with it).
/// Shipped before its payment was reserved is a bug upstream: dead-lettered.
#[idempotent_handler(key = "order_id")]
pub async fn order_shipped(
    _conn: &mut AsyncPgConnection,
    msg: OrderShipped,
    saga: &mut Saga<Order>,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    let Some(payment_id) = saga.payment_id.clone() else {
        return Err(
            Permanent(format!("order {} shipped before its payment was reserved", msg.order_id)).into()
        );
    };
    ctx.send(&CapturePayment { order_id: msg.order_id, payment_id, amount_cents: saga.amount_cents })?;
    saga.status = Status::Shipped;
    saga.complete();
    Ok(())
}

/// The timeout: the order did not ship in time; releases its payment and completes
/// the saga. After the saga completed it is never delivered (cancelled), and a copy
/// that comes anyway is acked unrun (`finished = "ignore"`, the default).
#[idempotent_handler(key = "order_id")]
pub async fn payment_expired(
    _conn: &mut AsyncPgConnection,
    msg: PaymentExpired,
    saga: &mut Saga<Order>,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    ctx.send(&ReleasePayment { order_id: msg.order_id, payment_id: saga.payment_id.clone() })?;
    saga.status = Status::Released;
    saga.complete();
    Ok(())
}

/// The saga's steps on `builder`, all on [`ORDERS`].
pub fn consume(builder: idemq::RuntimeBuilder) -> idemq::RuntimeBuilder {
    builder
        .consume(ORDERS, order_placed)
        .consume(ORDERS, payment_reserved)
        .consume(ORDERS, order_shipped)
        .consume(ORDERS, payment_expired)
}
