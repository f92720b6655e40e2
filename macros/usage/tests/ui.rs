//! Compile-time tests of `#[idempotent_handler]` and `#[derive(Message)]`: the
//! diagnostics they give for what they refuse (snapshots in `tests/ui/fail/*.stderr`).
//! What they accept (`tests/ui/pass`) is compiled and run by `tests/pass.rs`, as
//! modules of one ordinary test binary: trybuild would build every dependency again,
//! with codegen, for a case that must run; with only refusals it checks them.
//!
//! Regenerate the snapshots with
//! `TRYBUILD=overwrite cargo test -p idemq-macros-usage --test ui`, then review the diff:
//! the wording of every message, rustc's own help lines included, is part of the
//! interface.
//!
//! The snapshots hold rustc's words too, and those change between releases. They
//! were made with the rustc in [`SNAPSHOT_RUSTC`]; on another minor version they are
//! skipped, and the test says so on stderr — regenerate and review the
//! snapshots to move to a new toolchain (CI runs the one they were made with).
//! `IDEMQ_UI_STRICT=1` compares them anyway.

use std::process::Command;

/// `major.minor` of the rustc the `.stderr` snapshots were made with.
const SNAPSHOT_RUSTC: &str = "1.95";

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    let rustc = rustc_minor();
    if rustc.as_deref() == Some(SNAPSHOT_RUSTC) || std::env::var_os("IDEMQ_UI_STRICT").is_some() {
        t.compile_fail("tests/ui/fail/*.rs");
    } else {
        eprintln!(
            "ui: the fail snapshots were made with rustc {SNAPSHOT_RUSTC}, this is {}; \
             they are skipped (set IDEMQ_UI_STRICT=1 to compare anyway, or regenerate them)",
            rustc.as_deref().unwrap_or("unknown")
        );
    }
}

fn rustc_minor() -> Option<String> {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let output = Command::new(rustc).arg("--version").output().ok()?;
    let version = String::from_utf8(output.stdout).ok()?;
    let number = version.split_whitespace().nth(1)?;
    let mut parts = number.split('.');
    Some(format!("{}.{}", parts.next()?, parts.next()?))
}
