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

#[derive(Serialize, serde::Deserialize, Message)]
#[message(previous = Nothing)]
struct PreviousWithoutVersion {
    payment_id: String,
}

#[derive(Serialize, serde::Deserialize, Message)]
#[message(version = 0)]
struct VersionZero {
    payment_id: String,
}

#[derive(Serialize, serde::Deserialize, Message)]
#[message(version = 1, previous = Nothing)]
struct FirstWithPrevious {
    payment_id: String,
}

#[derive(Serialize, serde::Deserialize, Message)]
#[message(version = 1)]
struct V1 {
    payment_id: String,
}

/// No `From<V1>`: underlined at `previous`.
#[derive(Serialize, serde::Deserialize, Message)]
#[message(version = 2, previous = V1)]
struct V2WithoutFrom {
    payment_id: String,
}

#[derive(Serialize, Message)]
#[message(type = "")]
struct EmptyType {
    payment_id: String,
}

fn main() {}
