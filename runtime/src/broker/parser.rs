//! Is lapin's AMQP parser the patched one? Upstream `amq-protocol-types` fails a
//! whole frame on a short string that is not UTF-8 (a `message_id` of bytes `ff 31`
//! sent by pika), which closes the connection; the broker redelivers the message
//! first on every reconnect, and the queue stops for good. idemq's workspace builds
//! with a patched copy (`vendor/amq-protocol-types`, see its README), but cargo does
//! not apply a dependency's `[patch]`: an application's own workspace builds the
//! upstream crate unless its `Cargo.toml` says otherwise. So `build` asks the parser
//! itself, and refuses to start with one that fails
//! ([`Error::UnpatchedAmqpParser`]) unless told to accept the risk.
//!
//! The parser asked is the one lapin parses with (`lapin::protocol`, re-exported from
//! `amq-protocol`), never a copy of another version: a dependency of idemq's own on
//! `amq-protocol-types` could resolve to another crate than lapin's.

use std::path::Path;

use crate::error::Error;

/// The basic properties of a content header with a `message_id` (flag bit 7) of the
/// bytes `ff 31`, which are not UTF-8.
const NOT_UTF8_MESSAGE_ID: [u8; 5] = [0x00, 0x80, 2, 0xff, 0x31];

/// How the patched parser reads that `message_id`: U+FDD0, then the hex of its bytes.
const PATCHED_READING: &str = "\u{FDD0}ff31";

/// The settings and the variable that start a runtime with an unpatched parser
/// (kept beside the error that names them: `error` is the lower layer).
use crate::error::UNPATCHED_PARSER_OPT_OUT as OPT_OUT;

/// What lapin's parser does with a `message_id` that is not UTF-8.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Parser {
    /// idemq's patch: it reads one-to-one, as U+FDD0 and the hex of its bytes.
    Patched,
    /// Upstream: the whole frame fails, and with it the connection.
    FailsTheFrame,
    /// It reads as this string: another patch or a future upstream, not the reading
    /// idemq's keys are documented with (a lossy one would make two ids one key).
    ReadsAs(String),
}

/// Asks lapin's parser (five bytes parsed: call it freely).
pub(crate) fn parser() -> Parser {
    match lapin::protocol::basic::parse_properties(&NOT_UTF8_MESSAGE_ID[..]) {
        Err(_) => Parser::FailsTheFrame,
        Ok((_, properties)) => match properties.message_id() {
            Some(id) if id.as_str() == PATCHED_READING => Parser::Patched,
            Some(id) => Parser::ReadsAs(id.as_str().to_owned()),
            None => Parser::ReadsAs(String::new()),
        },
    }
}

/// `Ok` with the patched parser, or when `allowed` (with a warning naming the risk);
/// else [`Error::UnpatchedAmqpParser`], naming the two lines that fix it.
pub(crate) fn check(parser: &Parser, allowed: bool) -> Result<(), Error> {
    let found = match parser {
        Parser::Patched => return Ok(()),
        Parser::FailsTheFrame => "fails the whole frame on a short string that is not UTF-8 (a `message_id` of \
             the bytes ff 31, as pika may send): such a message would close the connection each time it is \
             delivered, and its queue would stop for good (the broker delivers it first again on every reconnect)"
            .to_owned(),
        Parser::ReadsAs(text) => format!(
            "reads a `message_id` of the bytes ff 31 (not UTF-8) as {text:?}, not as idemq's patch does \
             (U+FDD0 and the hex of its bytes): keys read from such ids (`@message_id`) may not be one-to-one"
        ),
    };
    if allowed {
        crate::base::log::warn!(
            "lapin's AMQP parser (amq-protocol-types) {found}. Starting anyway (allowed by {OPT_OUT}); \
             to remove the risk, {}",
            fix().trim_end()
        );
        return Ok(());
    }
    Err(Error::UnpatchedAmqpParser { found, fix: fix() })
}

/// The fix: the two lines of `Cargo.toml` that patch the parser with idemq's copy
/// (its folder, where this program was built from idemq's source and it is still
/// there), or with a copy of it.
fn fix() -> String {
    let idemq = Path::new(env!("CARGO_MANIFEST_DIR"));
    let vendored = idemq
        .parent()
        .map(|root| root.join("vendor").join("amq-protocol-types"))
        .filter(|folder| folder.join("Cargo.toml").is_file());
    match vendored {
        // A path dependency on idemq, or a git one (a folder of cargo's checkouts).
        Some(folder) => format!(
            "add these two lines to the Cargo.toml at your workspace's root (only the second if it has a \
             [patch.crates-io] already), then rebuild:\n{}",
            patch_lines(&folder.display().to_string())
        ),
        // idemq from a registry (its package holds no vendor folder), or a program
        // run on another machine than the one that built it.
        None => format!(
            "copy the folder vendor/amq-protocol-types of idemq's source repository (this program was \
             built with idemq from {}) into your workspace, add these two lines to the Cargo.toml at its \
             root (only the second if it has a [patch.crates-io] already), then rebuild:\n{}",
            idemq.display(),
            patch_lines("vendor/amq-protocol-types")
        ),
    }
}

/// `[patch.crates-io]` and its line for the folder `path`, a TOML string (`Debug`
/// escapes `\` and `"` as TOML does).
fn patch_lines(path: &str) -> String {
    format!("[patch.crates-io]\namq-protocol-types = {{ path = {path:?} }}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_workspace_builds_with_the_patched_parser() {
        assert_eq!(parser(), Parser::Patched);
        assert!(check(&parser(), false).is_ok());
    }

    #[test]
    fn an_unpatched_parser_is_refused_with_the_two_lines_naming_idemqs_own_copy() {
        let Err(err) = check(&Parser::FailsTheFrame, false) else { panic!("refused") };
        let message = err.to_string();
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace");
        let folder = root.join("vendor").join("amq-protocol-types");
        let lines =
            format!("\n[patch.crates-io]\namq-protocol-types = {{ path = {:?} }}\n", folder.display());
        assert!(message.contains(&lines), "{message}");
        assert!(message.contains("fails the whole frame"), "{message}");
        assert!(message.contains("IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER=1"), "{message}");
    }

    #[test]
    fn another_reading_is_refused_too_and_allowed_on_request() {
        let other = Parser::ReadsAs("\u{fffd}1".into());
        let Err(err) = check(&other, false) else { panic!("refused") };
        assert!(err.to_string().contains("as \"\u{fffd}1\""), "{err}");
        assert!(check(&other, true).is_ok());
        assert!(check(&Parser::FailsTheFrame, true).is_ok());
    }
}
