//! A type derived with only `#[message(key)]` has a key but no route: publishing it
//! by type says which attribute to add.
use idemq::{Context, Message};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Message)]
struct PaymentApplied {
    #[message(key)]
    payment_id: String,
}

fn publish(ctx: &mut Context, event: &PaymentApplied) {
    let _ = ctx.send(event);
}

fn main() {}
