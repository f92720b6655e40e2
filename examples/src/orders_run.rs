//! `payments orders`: the order saga over a burst of orders, end to end — a real
//! broker, database and relay, the payment window shortened so the timeouts fire.
//!
//! Each order is placed; three in four get their payment reserved (the rest never
//! do); two in three of those ship. Every fifth message is published twice. The
//! reservations go out with the orders, so some overtake their order and wait for
//! it (`missing = "retry"`); the shipments go once every reservation is recorded.
//! Then it waits until every saga has finished and checks each ended one way: shipped
//! with one capture, or released by its timeout with one release and no capture (a
//! shipment that comes after its order's window finds the saga released).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use diesel_async::RunQueryDsl;
use idemq::{Queue, Runtime, Topology};
use tokio_util::sync::CancellationToken;

use crate::orders::{
    self, CapturePayment, OrderPlaced, OrderShipped, PaymentReserved, ReleasePayment, ORDERS,
};

/// The queues the saga's commands go to (the payment service's, here only counted).
pub const CAPTURES: &str = "payments.capture";
/// See [`CAPTURES`].
pub const RELEASES: &str = "payments.release";

/// The saga's topology: its queue (with its dead-letter queue) and the two the
/// payment service would consume.
pub fn topology() -> Topology {
    Topology::new()
        .queue(Queue::new(ORDERS))
        .queue(Queue::new(CAPTURES))
        .queue(Queue::new(RELEASES))
        .message::<CapturePayment>()
        .message::<ReleasePayment>()
}

/// What the run saw.
#[derive(Debug)]
pub struct OrdersReport {
    /// Orders placed.
    pub orders: usize,
    /// Messages published (duplicates included).
    pub published: usize,
    /// Sagas that ended shipped, and captures published.
    pub shipped: (usize, usize),
    /// Sagas that ended released by their timeout, and releases published.
    pub released: (usize, usize),
    /// Shipments that came after their order's window (the saga had been released).
    pub late: usize,
    /// Deliveries retried because their saga did not exist yet.
    pub waited: u64,
    /// Steps skipped as duplicates.
    pub duplicates: u64,
    /// How long until every saga had finished.
    pub took: Duration,
    /// Whether every saga ended one way, with one command each.
    pub ok: bool,
}

impl std::fmt::Display for OrdersReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "orders:     {} placed, {} messages published (duplicates included)",
            self.orders, self.published
        )?;
        writeln!(f, "shipped:    {} sagas, {} captures sent", self.shipped.0, self.shipped.1)?;
        writeln!(
            f,
            "released:   {} sagas by their timeout, {} releases sent",
            self.released.0, self.released.1
        )?;
        writeln!(
            f,
            "late:       {} shipments after their order's window (acked, the saga was released)",
            self.late
        )?;
        writeln!(f, "duplicates: {} steps skipped", self.duplicates)?;
        writeln!(f, "waited:     {} deliveries retried until their saga existed", self.waited)?;
        writeln!(f, "took:       {:.1} s until every saga finished", self.took.as_secs_f64())?;
        let verdict =
            if self.ok { "OK: every saga ended one way, each command sent once" } else { "MISMATCH" };
        write!(f, "check:      {verdict}")
    }
}

/// Runs `orders` orders through the saga with a payment window of `window`.
///
/// # Errors
/// Setting up (the database, the broker), publishing, or the runtime's.
pub async fn run(
    amqp_url: &str,
    database_url: &str,
    orders: usize,
    window: Duration,
) -> Result<OrdersReport, Box<dyn std::error::Error + Send + Sync>> {
    crate::migrate(database_url).await?;
    orders::set_payment_window(window);
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let connection = idemq::connect::broker(amqp_url, "orders").await?;
    let channel = connection.create_channel().await?;
    topology().declare(&channel).await?;
    for queue in [CAPTURES, RELEASES] {
        channel.queue_purge(queue.into(), lapin::options::QueuePurgeOptions::default()).await?;
    }

    let waited = std::sync::Arc::new(AtomicU64::new(0));
    let counted = std::sync::Arc::clone(&waited);
    let runtime = orders::consume(Runtime::builder().amqp_url(amqp_url).database_url(database_url))
        .topology(topology())
        .retry(idemq::RetryPolicy::new([Duration::from_millis(200); 10]))
        .observe(idemq::observe::on_settled(move |settled| {
            if matches!(&settled.outcome, idemq::Outcome::Retry { error, .. } if error.starts_with("no saga"))
            {
                counted.fetch_add(1, Ordering::Relaxed);
            }
        }))
        .build()?;
    let stats = runtime.stats();
    let shutdown = CancellationToken::new();
    let started = Instant::now();
    let consumer = tokio::spawn(runtime.run(shutdown.clone()));

    let publisher = idemq::Publisher::builder().amqp_url(amqp_url).name("orders publisher").connect().await?;
    let id = |i: usize| format!("{run_id}-{i}");
    let reserved = |i: usize| i % 4 != 3;
    let ships = |i: usize| reserved(i) && i % 3 != 2;
    let mut published = 0;
    // Placed and reserved together: a reservation may overtake its order.
    for i in 0..orders {
        let placed = OrderPlaced { order_id: id(i), amount_cents: 1_000 + i as i64 };
        let copies = if i % 5 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            publisher.send(&placed).await?;
            published += 1;
            if reserved(i) {
                publisher
                    .send(&PaymentReserved { order_id: id(i), payment_id: format!("pay-{}", id(i)) })
                    .await?;
                published += 1;
            }
        }
    }
    let mut conn = idemq::connect::database(database_url).await?;
    let deadline = started + window + Duration::from_secs(120);
    let status_count = |status: &'static str| {
        format!(
            "SELECT count(*) AS n FROM idemq_saga WHERE saga = 'order' AND key LIKE '{run_id}-%' \
             AND state->>'status' = '{status}'"
        )
    };
    let expected_reserved = (0..orders).filter(|&i| reserved(i)).count() as i64;
    while count(&mut conn, &status_count("reserved")).await? < expected_reserved {
        if Instant::now() > deadline || consumer.is_finished() {
            return Err("the reservations were not all recorded in time".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in (0..orders).filter(|&i| ships(i)) {
        publisher.send(&OrderShipped { order_id: id(i) }).await?;
        published += 1;
        if i % 5 == 0 {
            publisher.send(&OrderShipped { order_id: id(i) }).await?;
            published += 1;
        }
    }
    publisher.close().await;
    let finished = format!(
        "SELECT count(*) AS n FROM idemq_saga WHERE saga = 'order' AND key LIKE '{run_id}-%' AND finished_at IS NOT NULL"
    );
    while count(&mut conn, &finished).await? < orders as i64 {
        if Instant::now() > deadline || consumer.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    // The last commands in the outbox reach their queues within a relay pass.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    shutdown.cancel();
    consumer.await??;

    let shipped = count(&mut conn, &status_count("shipped")).await? as usize;
    let released = count(&mut conn, &status_count("released")).await? as usize;
    let captures = ids_in(&channel, CAPTURES, |body| {
        serde_json::from_slice::<CapturePayment>(body).ok().map(|c| c.order_id)
    })
    .await?;
    let releases = ids_in(&channel, RELEASES, |body| {
        serde_json::from_slice::<ReleasePayment>(body).ok().map(|r| r.order_id)
    })
    .await?;
    let _ = connection.close(200, "orders done".into()).await;
    let once = |ids: &BTreeMap<String, usize>| ids.values().all(|&n| n == 1);
    let expected_shipped = (0..orders).filter(|&i| ships(i)).count();
    // A shipment that came after its order's window finds the saga released (and is
    // acked without a step): the saga still ended one way.
    let ok = shipped <= expected_shipped
        && shipped + released == orders
        && captures.len() == shipped
        && releases.len() == released
        && once(&captures)
        && once(&releases)
        && captures.keys().all(|id| !releases.contains_key(id));
    Ok(OrdersReport {
        orders,
        published,
        shipped: (shipped, captures.values().sum()),
        released: (released, releases.values().sum()),
        late: expected_shipped.saturating_sub(shipped),
        waited: AtomicU64::load(&waited, Ordering::Relaxed),
        duplicates: stats.snapshot().duplicates,
        took,
        ok,
    })
}

async fn count(conn: &mut diesel_async::AsyncPgConnection, sql: &str) -> diesel::QueryResult<i64> {
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    Ok(diesel::sql_query(sql).get_result::<Count>(conn).await?.n)
}

/// The order ids of the commands in `queue` (taken), and how often each came.
async fn ids_in(
    channel: &lapin::Channel,
    queue: &str,
    order_id: impl Fn(&[u8]) -> Option<String>,
) -> Result<BTreeMap<String, usize>, lapin::Error> {
    let mut ids = BTreeMap::new();
    while let Some(message) =
        channel.basic_get(queue.into(), lapin::options::BasicGetOptions { no_ack: true }).await?
    {
        if let Some(id) = order_id(&message.delivery.data) {
            *ids.entry(id).or_insert(0) += 1;
        }
    }
    Ok(ids)
}
