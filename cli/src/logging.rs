//! The CLI's log subscriber: installed by [`Cli::run_matches`](super::Cli::run_matches)
//! (and so by `run` and `run_from`) unless the application installed one first.
//!
//! - **Filter:** `RUST_LOG` when set (it decides alone), else the default level plus
//!   [`QUIET`]: what lapin and lapin's clients log about failures idemq reports itself.
//! - **Format:** `--log-format human|text|json` (`IDEMQ_LOG_FORMAT`): lines for people
//!   (the default) or one JSON object per line.
//! - **Colour:** only when stderr is a terminal (and `NO_COLOR` is unset): a log
//!   redirected to a file or a pipe holds no escape codes.
//! - **Where:** stderr, through a thread of its own (`app/stderr.rs`): a closed or
//!   full stderr never blocks or breaks the service; stdout is the commands' output.

use idemq_core::__private::sibling;
use std::io::IsTerminal;

use clap::ArgMatches;

/// The level `run` and the other subcommands log at when `RUST_LOG` is not set.
pub(super) const DEFAULT_LEVEL: &str = "info";

/// Directives added to every default filter (`RUST_LOG` replaces them too):
///
/// - `lapin::returned_messages`: lapin's warning for each message the broker returns
///   prints the whole message, body included — payloads in the logs — and idemq
///   reports every unroutable publish itself.
/// - `lapin::channel`, `lapin::channels`, `lapin::io_loop`: lapin logs every failed
///   connection at ERROR, three to four lines per attempt (`Connection closed`,
///   `Connection error`, `Exponential backoff attempts exhausted`, `error doing IO`)
///   with its `Debug` dumps, before idemq's own line about the same failure: a
///   refused login, a lost connection, a closed channel each reach idemq as an error
///   it logs or returns, with the address redacted and what to check.
///   `RUST_LOG=lapin=debug` shows them again.
const QUIET: &str =
    "lapin::returned_messages=error,lapin::channel=off,lapin::channels=off,lapin::io_loop=off";

/// Installs the `tracing` subscriber the parsed `--log-format` asks for (for people
/// by default, JSON lines with `json`), on stderr, filtered by `RUST_LOG` or else
/// `default_filter` (`"info"`, `"warn"`, …), without colours unless stderr is a
/// terminal. [`Cli::run_matches`](super::Cli::run_matches) calls it with `"info"`;
/// call it first only for another default, or for a subcommand of the application's
/// own before it runs.
///
/// A subscriber already installed stays: an application that sets up its own
/// `tracing` before the CLI keeps it (this call then does nothing), and calling it
/// twice is harmless.
///
/// The default filter also silences lapin's copies of failures idemq reports itself
/// (its ERROR lines for each failed connection) and lapin's warning for each message
/// the broker returns, which prints the whole message, body included. `RUST_LOG`
/// decides alone when set.
pub fn init_tracing(matches: &ArgMatches, default_filter: &str) {
    install(matches, default_filter);
}

/// [`init_tracing`]; `true` when this call installed a JSON subscriber (the CLI then
/// logs its final error as a JSON line too, so that stderr stays one object a line).
pub(super) fn install(matches: &ArgMatches, default_filter: &str) -> bool {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{default_filter},{QUIET}")));
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    // Through a thread of its own: a closed or full stderr never blocks or panics
    // the task that logs (see `runtime/src/app/stderr.rs`: the queue `otel`'s
    // subscriber writes through too).
    let lines = sibling::StderrLines::get();
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(move || lines.line()).with_ansi(ansi);
    // `try_init` leaves a subscriber set before this one in place (and says so with an
    // error, which only means that).
    if json(matches) {
        builder.json().try_init().is_ok()
    } else {
        let _ = builder.try_init();
        false
    }
}

/// Whether `--log-format json` (or `IDEMQ_LOG_FORMAT=json`) was given; `false` for a
/// command without the flag (an application's own).
fn json(matches: &ArgMatches) -> bool {
    matches.try_get_one::<String>("log-format").ok().flatten().is_some_and(|format| format == "json")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(args: &[&str]) -> ArgMatches {
        clap::Command::new("app")
            .arg(super::super::log_format())
            .try_get_matches_from(std::iter::once("app").chain(args.iter().copied()))
            .expect("parses")
    }

    #[test]
    fn json_is_chosen_by_the_flag_only() {
        assert!(json(&matches(&["--log-format", "json"])));
        assert!(!json(&matches(&["--log-format", "text"])));
        assert!(!json(&matches(&["--log-format", "human"])));
        assert!(!json(&clap::Command::new("own").get_matches_from(["own"])), "a command without the flag");
    }

    #[test]
    fn the_default_filter_parses_and_keeps_lapins_connection_errors_out() {
        let filter =
            tracing_subscriber::EnvFilter::try_new(format!("{DEFAULT_LEVEL},{QUIET}")).expect("valid");
        let shown = filter.to_string();
        for target in ["lapin::channels=off", "lapin::channel=off", "lapin::io_loop=off", "info"] {
            assert!(shown.contains(target), "{target} missing from {shown}");
        }
    }
}
