//! Nothing here: the tests are the crate. `tests/pass.rs` compiles and runs what
//! `#[idempotent_handler]` and `#[derive(Message)]` accept (`tests/ui/pass`);
//! `tests/ui.rs` checks the diagnostic of everything they refuse
//! (`tests/ui/fail/*.stderr`, through trybuild).
