//! What applications run: the command line, metrics and health endpoints, the test
//! kits.

#[cfg(feature = "cli")]
pub mod cli;
#[cfg(any(feature = "testing", feature = "test-cluster"))]
pub mod testing;
