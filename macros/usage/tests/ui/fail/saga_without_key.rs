use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Placed {
    order_id: String,
}

#[derive(Deserialize)]
struct Shipped {
    order_id: String,
}

// No key: neither the saga's nor each message's own.
#[derive(Default, Serialize, Deserialize, idemq::saga::Saga)]
#[saga(name = "order", takes(Placed, Shipped))]
struct Order {
    steps: u32,
}

// No attribute at all.
#[derive(Default, Serialize, Deserialize, idemq::saga::Saga)]
struct Bare {
    steps: u32,
}

// A key, nothing it takes; an option it does not have.
#[derive(Default, Serialize, Deserialize, idemq::saga::Saga)]
#[saga(key = "order_id", timeout = "15m")]
struct Idle {
    steps: u32,
}

fn main() {
    let _ = (Placed { order_id: String::new() }.order_id, Shipped { order_id: String::new() }.order_id);
}
