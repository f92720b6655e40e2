use diesel_async::AsyncPgConnection;
use idemq::saga::{Saga, SagaState, Takes};
use idemq::{idempotent_handler, Context, Handler, HandlerError, Metadata};
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Placed {
    order_id: String,
}

#[derive(Deserialize)]
struct Expired {
    order: Inner,
}

#[derive(Deserialize)]
struct Inner {
    id: String,
}

// The saga's key read from each message it takes; one message type has its own.
#[derive(Default, Serialize, Deserialize, idemq::saga::Saga)]
#[saga(name = "order", key = "order_id", takes(Placed, Expired(key = "order.id")), keep_finished = "0")]
struct Order {
    steps: u32,
}

// Without a name: the type's, in snake case.
#[derive(Serialize, Deserialize, idemq::saga::Saga)]
#[saga(key = "{@header:x-tenant}/{order_id}", takes(Placed))]
struct TenantOrder {
    steps: u32,
}

// A starting step, the saga before the context.
#[idempotent_handler(key = "order_id", saga(start))]
async fn placed(
    conn: &mut AsyncPgConnection,
    msg: Placed,
    saga: &mut Saga<Order>,
    ctx: &mut Context,
) -> Result<(), HandlerError> {
    let _ = (conn, msg.order_id, ctx);
    saga.steps += 1;
    Ok(())
}

// A later step, the saga first, the message by reference; its policies.
#[idempotent_handler(key = "@message_id", saga(missing = "ignore", finished = "dead_letter"))]
async fn expired(
    conn: &mut AsyncPgConnection,
    saga: &mut Saga<Order>,
    msg: &Expired,
) -> Result<(), HandlerError> {
    let _ = (conn, &msg.order.id);
    saga.complete();
    Ok(())
}

// A saga that is not started by a message needs no `Default`.
#[idempotent_handler(key = "order_id")]
async fn tenant(
    conn: &mut AsyncPgConnection,
    msg: Placed,
    saga: &mut Saga<TenantOrder>,
) -> Result<(), HandlerError> {
    let _ = (conn, msg.order_id);
    saga.steps += 1;
    Ok(())
}

pub(crate) fn main() {
    assert_eq!(<Order as SagaState>::NAME, "order");
    assert_eq!(<Order as SagaState>::KEEP_FINISHED, std::time::Duration::ZERO);
    assert_eq!(<Order as SagaState>::TAKES, ["Placed", "Expired"]);
    assert_eq!(<TenantOrder as SagaState>::NAME, "tenant_order");
    assert_eq!(<TenantOrder as SagaState>::KEEP_FINISHED, std::time::Duration::from_secs(7 * 86_400));
    let properties = idemq::lapin::BasicProperties::default();
    let metadata = Metadata::new(&properties, &[]);
    let key = <Order as Takes<Expired>>::correlate(&Expired { order: Inner { id: "o-1".into() } }, &metadata);
    assert_eq!(key.expect("a key").as_str(), "o-1");
    assert_eq!(<Order as Takes<Expired>>::KEY_PATH, "order.id");
    let message = Placed { order_id: "o-2".into() };
    assert_eq!(placed.saga_key(&message, &metadata).expect("a saga step").expect("a key").as_str(), "o-2");
    assert_eq!(placed.saga_key_path(), Some("order_id"));
    assert_eq!(placed.saga().map(|s| s.name), Some("order"));
    assert_eq!(expired.key_path(), "@message_id");
    assert!(tenant.saga_key(&message, &metadata).expect("a saga step").is_err(), "no x-tenant header");
}
