//! Compile-time tests of `#[idempotent_handler]`: what it accepts, and the
//! diagnostics it gives for what it refuses (snapshots in `tests/ui/fail/*.stderr`).
//!
//! Regenerate the snapshots with
//! `TRYBUILD=overwrite cargo test -p idemq-macros --test ui`, then review the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
