use idemq::Message;
use serde::Serialize;

#[derive(Serialize, Message)]
#[message(exchange = "payments")]
struct OnlyExchange {
    payment_id: String,
}

#[derive(Serialize, Message)]
#[message(exchange = "payments", routing_key = "payment.applied", durable = true)]
struct UnknownOption {
    payment_id: String,
}

#[derive(Serialize, Message)]
struct TwoKeys {
    #[message(key)]
    a: String,
    #[message(key)]
    b: String,
}

#[derive(Serialize, Message)]
struct Nothing {
    payment_id: String,
}

fn main() {}
