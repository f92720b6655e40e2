//! What applications run: the command line, metrics and health endpoints, the test
//! kits.

#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "otel")]
pub mod otel;
#[cfg(any(feature = "cli", feature = "otel"))]
pub(crate) mod stderr;
#[cfg(any(feature = "testing", feature = "test-cluster"))]
pub mod testing;
