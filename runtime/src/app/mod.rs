//! What applications run beside the engine: OpenTelemetry, and the stderr writer
//! its log subscriber shares with the CLI's (the CLI and the test kits are crates of
//! their own, `idemq-cli` and `idemq-testing`).

#[cfg(feature = "otel")]
pub mod otel;
pub(crate) mod stderr;
