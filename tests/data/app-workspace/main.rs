//! An application of idemq in its own workspace (tests/tests/app_workspace.rs):
//! builds a runtime, which connects to nothing yet, and prints `built` or
//! `refused: ` and the error (exit 1). Warnings go to stderr.

use idemq::diesel_async::AsyncPgConnection;
use idemq::{idempotent_handler, HandlerError, Runtime};

#[derive(serde::Deserialize)]
struct PaymentRequested {
    payment_id: String,
}

#[idempotent_handler(key = "payment_id")]
async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), HandlerError> {
    let _ = (conn, msg.payment_id);
    Ok(())
}

fn main() {
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(false).init();
    let built = Runtime::builder()
        .amqp_url("amqp://guest:guest@127.0.0.1:5672/%2f")
        .database_url("postgres://postgres@127.0.0.1:5432/postgres")
        .consume("payments", apply_payment)
        .build();
    match built {
        Ok(_) => println!("built"),
        Err(err) => {
            println!("refused: {}", err.report());
            std::process::exit(1);
        }
    }
}
