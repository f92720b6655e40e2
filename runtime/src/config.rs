//! URLs from the environment, or from a file the environment names: the
//! container-secrets convention (`DATABASE_URL_FILE=/run/secrets/database_url`), so a
//! password need not sit in the process's environment.
//!
//! Everything that reads `AMQP_URL` or `DATABASE_URL` reads them here: the builders'
//! defaults, the CLI (through the same [`resolve`]) and the test kit. So does a
//! builder for the one switch it reads from the environment itself
//! (`IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER`: [`env_switch`], with the CLI's words).

use std::path::Path;

use crate::error::Error;

/// The default AMQP URL (`AMQP_URL` overrides it).
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The default database URL (`DATABASE_URL` overrides it).
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The URL in the environment variable `name` (e.g. `DATABASE_URL`), or else the
/// content of the file named by `<name>_FILE` (surrounding whitespace, such as the
/// trailing newline, trimmed), or else `default`.
///
/// A variable that is set counts, even if empty.
///
/// # Errors
/// [`Error::Config`] when both `name` and `<name>_FILE` are set (keep one) or the file
/// holds nothing, [`Error::ConfigIo`] when it cannot be read; the message names the
/// variable and the file, never the file's content.
///
/// ```no_run
/// # fn main() -> Result<(), idemq::Error> {
/// let url = idemq::connect::env_url("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/app")?;
/// # let _ = url;
/// # Ok(())
/// # }
/// ```
pub fn env_url(name: &str, default: &str) -> Result<String, Error> {
    let file_name = format!("{name}_FILE");
    let value = std::env::var_os(name).map(|value| value.to_string_lossy().into_owned());
    let file = std::env::var_os(&file_name);
    Ok(resolve((name, value), (&file_name, file.as_deref().map(Path::new)))?
        .unwrap_or_else(|| default.to_owned()))
}

/// The switch in the environment variable `name` (`1`, `on`, `true`, `yes` or
/// their opposites, as the CLI's switches take them), `None` when it is not set.
///
/// # Errors
/// [`Error::Config`] naming the variable when its value is neither on nor off.
pub(crate) fn env_switch(name: &str) -> Result<Option<bool>, Error> {
    let Some(value) = std::env::var_os(name) else { return Ok(None) };
    parse_switch(&value.to_string_lossy())
        .map(Some)
        .map_err(|problem| Error::Config(format!("{name}: {problem}")))
}

/// `on` or `off` (also `true`/`false`, `yes`/`no`, `1`/`0`).
pub fn parse_switch(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!("`{text}` is neither on nor off")),
    }
}

/// A URL given either as a value or as a file holding it, each with the name it was
/// given by (`AMQP_URL`, `--amqp-url-file`, `amqp_url_file` in the config file…):
/// the value, the file's content, or `None` when neither is given.
pub fn resolve(
    (value_name, value): (&str, Option<String>),
    (file_name, file): (&str, Option<&Path>),
) -> Result<Option<String>, Error> {
    match (value, file) {
        (Some(_), Some(_)) => Err(Error::Config(format!(
            "both {value_name} and {file_name} are set: keep one ({file_name} names a file holding the URL)"
        ))),
        (Some(value), None) => Ok(Some(value)),
        (None, Some(path)) => read_url_file(file_name, path).map(Some),
        (None, None) => Ok(None),
    }
}

/// The URL in the file `path` (given as `setting`), trimmed.
fn read_url_file(setting: &str, path: &Path) -> Result<String, Error> {
    // The I/O error says why (not found, permission denied, not UTF-8), never what
    // the file holds.
    let text = std::fs::read_to_string(path).map_err(|source| Error::ConfigIo {
        message: format!("{setting}: cannot read the file {}", path.display()),
        source,
    })?;
    let url = text.trim();
    if url.is_empty() {
        return Err(Error::Config(format!(
            "{setting}: the file {} is empty; write the URL in it",
            path.display()
        )));
    }
    Ok(url.to_owned())
}

/// What a builder read from the environment for its URLs, kept until `build()` or
/// `run()` can report it (the builders are made infallibly). A URL the code then
/// sets itself makes its variable's problem moot.
#[derive(Debug, Clone, Default)]
pub(crate) struct EnvUrls {
    problems: Vec<(&'static str, Problem)>,
}

/// An [`env_url`] error, kept in a builder (which is `Clone`; an [`Error`] is not:
/// its I/O error is not).
#[derive(Debug, Clone)]
enum Problem {
    Config(String),
    /// An [`Error::ConfigIo`]: its I/O error kept as its kind and words.
    Io {
        message: String,
        kind: std::io::ErrorKind,
        said: String,
    },
}

impl Problem {
    fn of(err: Error) -> Self {
        match err {
            Error::ConfigIo { message, source } => {
                Self::Io { message, kind: source.kind(), said: source.to_string() }
            }
            Error::Config(message) => Self::Config(message),
            other => Self::Config(other.report()),
        }
    }

    fn to_error(&self) -> Error {
        match self {
            Self::Config(message) => Error::Config(message.clone()),
            Self::Io { message, kind, said } => {
                Error::ConfigIo { message: message.clone(), source: std::io::Error::new(*kind, said.clone()) }
            }
        }
    }
}

impl EnvUrls {
    /// [`env_url`], or `default` with the problem kept.
    pub(crate) fn read(&mut self, name: &'static str, default: &str) -> String {
        env_url(name, default).unwrap_or_else(|err| {
            self.problems.push((name, Problem::of(err)));
            default.to_owned()
        })
    }

    /// The code set `name`'s URL itself.
    pub(crate) fn overridden(&mut self, name: &str) {
        self.problems.retain(|(variable, _)| *variable != name);
    }

    /// The first problem left, as the error to report.
    pub(crate) fn check(&self) -> Result<(), Error> {
        match self.problems.first() {
            Some((_, problem)) => Err(problem.to_error()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// A file holding `content`, deleted on drop.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(content: &str) -> Self {
            let path = std::env::temp_dir().join(format!(
                "idemq-config-env-{}-{}",
                std::process::id(),
                fastrand::u64(..)
            ));
            std::fs::File::create(&path).and_then(|mut f| f.write_all(content.as_bytes())).expect("write");
            Self(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn config_message(result: Result<Option<String>, Error>) -> String {
        match result {
            Err(Error::Config(message) | Error::ConfigIo { message, .. }) => message,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn a_value_and_its_file_both_set_is_an_error_naming_both() {
        let file = TempFile::new("postgres://u:secret@h/db\n");
        let message = config_message(resolve(
            ("DATABASE_URL", Some("postgres://u:other@h/db".into())),
            ("DATABASE_URL_FILE", Some(&file.0)),
        ));
        assert!(message.contains("both DATABASE_URL and DATABASE_URL_FILE are set: keep one"), "{message}");
        assert!(!message.contains("secret") && !message.contains("other"), "{message}");
    }

    #[test]
    fn the_files_content_is_the_url_trimmed() {
        let file = TempFile::new("  amqp://u:secret@h:5672/%2f\r\n\n");
        let url = resolve(("AMQP_URL", None), ("AMQP_URL_FILE", Some(&file.0))).expect("read");
        assert_eq!(url.as_deref(), Some("amqp://u:secret@h:5672/%2f"));
    }

    #[test]
    fn a_missing_file_is_an_error_naming_it_with_the_io_error_as_its_source() {
        let path = std::env::temp_dir().join("idemq-config-env-no-such-file");
        let result = resolve(("AMQP_URL", None), ("AMQP_URL_FILE", Some(&path)));
        let Err(Error::ConfigIo { ref source, .. }) = result else { panic!("an I/O error: {result:?}") };
        assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        let message = config_message(result);
        assert!(message.starts_with("AMQP_URL_FILE: cannot read the file"), "{message}");
        assert!(message.contains(&path.display().to_string()), "{message}");
    }

    #[test]
    fn a_builder_keeps_an_unreadable_files_error_with_its_kind_and_words() {
        let path = std::env::temp_dir().join("idemq-config-env-no-such-file");
        let Err(err) = resolve(("AMQP_URL", None), ("AMQP_URL_FILE", Some(&path))) else { panic!("unread") };
        let report = err.report();
        let mut urls = EnvUrls::default();
        urls.problems.push(("AMQP_URL", Problem::of(err)));
        let kept = urls.clone().check().expect_err("kept");
        assert_eq!(kept.report(), report);
        assert!(
            matches!(kept, Error::ConfigIo { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound)
        );
    }

    #[test]
    fn an_empty_file_is_an_error_naming_it_and_not_its_content() {
        let file = TempFile::new(" \n\t\n");
        let message = config_message(resolve(("amqp_url", None), ("amqp_url_file", Some(&file.0))));
        assert!(message.contains(&format!("the file {} is empty", file.0.display())), "{message}");
    }

    #[test]
    fn neither_set_is_none_and_a_value_alone_is_itself() {
        assert_eq!(resolve(("AMQP_URL", None), ("AMQP_URL_FILE", None)).expect("resolve"), None);
        let value = resolve(("AMQP_URL", Some("amqp://h".into())), ("AMQP_URL_FILE", None)).expect("resolve");
        assert_eq!(value.as_deref(), Some("amqp://h"));
    }

    #[test]
    fn env_url_falls_back_to_the_default_when_neither_variable_is_set() {
        // A name no test sets: reading it does not race with other tests.
        let url = env_url("IDEMQ_CONFIG_ENV_TEST_UNSET_URL", "amqp://default").expect("default");
        assert_eq!(url, "amqp://default");
    }

    #[test]
    fn a_switch_in_the_environment_reads_as_the_clis_and_an_unset_one_is_none() {
        // A name no test sets: reading it does not race with other tests.
        assert_eq!(env_switch("IDEMQ_CONFIG_ENV_TEST_UNSET_SWITCH").expect("unset"), None);
        assert_eq!(parse_switch(" 1 "), Ok(true));
        assert_eq!(parse_switch("Off"), Ok(false));
        assert!(parse_switch("maybe").unwrap_err().contains("neither on nor off"));
    }

    #[test]
    fn a_builders_problem_is_reported_unless_the_code_sets_that_url() {
        let mut urls = EnvUrls::default();
        urls.problems.push(("AMQP_URL", Problem::Config("both AMQP_URL and AMQP_URL_FILE are set".into())));
        let Err(Error::Config(message)) = urls.check() else { panic!("the problem is reported") };
        assert_eq!(message, "both AMQP_URL and AMQP_URL_FILE are set");
        urls.overridden("AMQP_URL");
        assert!(urls.check().is_ok());
    }
}
