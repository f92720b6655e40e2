//! An application built in its own workspace gets upstream `amq-protocol-types`,
//! whose parser fails a whole frame on a short string that is not UTF-8 (a
//! `message_id` of bytes `ff 31` closes the connection on every delivery, for ever):
//! cargo applies idemq's `[patch.crates-io]` to idemq's workspace only. This test
//! builds such an application (tests/data/app-workspace: idemq as a path
//! dependency, no `[patch]`, a `main` that calls `RuntimeBuilder::build`) with
//! `cargo run`, and proves what it meets:
//!
//! 1. unpatched, `build` refuses with `Error::UnpatchedAmqpParser`, whose message
//!    holds the two lines of `Cargo.toml` that fix it;
//! 2. with `IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER=1` it builds, and warns;
//! 3. with those two lines appended to its `Cargo.toml`, as the message says, it
//!    builds without a warning.
//!
//! No broker or database: `build` connects to nothing. The nested cargo shares this
//! build's target folder (cargo releases its lock before it runs the tests) and
//! starts from this workspace's `Cargo.lock`, so only what differs is compiled:
//! `amq-protocol-types` and the crates above it (`amq-protocol`, lapin, idemq),
//! twice (upstream, then patched), and crates whose features differ from this
//! build's. The first run also fetches upstream `amq-protocol-types` from crates.io.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// Longer than a cold build of idemq's dependencies on two cores.
const BUILD_TIMEOUT: Duration = Duration::from_secs(20 * 60);

const ALLOW: &str = "IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER";

/// The application's workspace, in a folder of this test's own (removed on drop).
struct AppWorkspace {
    folder: PathBuf,
}

impl AppWorkspace {
    fn new() -> Self {
        let tests = Path::new(env!("CARGO_MANIFEST_DIR"));
        let root = tests.parent().expect("the workspace's root");
        let folder =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("app-workspace-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&folder);
        std::fs::create_dir_all(&folder).expect("create the application's folder");
        let fixture = tests.join("data").join("app-workspace");
        let manifest =
            std::fs::read_to_string(fixture.join("Cargo.toml.in")).expect("the fixture's Cargo.toml");
        let idemq = root.join("idemq");
        let manifest = manifest.replace("@IDEMQ@", &idemq.display().to_string());
        std::fs::write(folder.join("Cargo.toml"), manifest).expect("write Cargo.toml");
        std::fs::copy(fixture.join("main.rs"), folder.join("main.rs")).expect("copy main.rs");
        // The versions idemq is tested with, so that unchanged crates are reused.
        std::fs::copy(root.join("Cargo.lock"), folder.join("Cargo.lock")).expect("copy Cargo.lock");
        Self { folder }
    }

    /// Appends `lines` to its `Cargo.toml`.
    fn append(&self, lines: &str) {
        let path = self.folder.join("Cargo.toml");
        let manifest = std::fs::read_to_string(&path).expect("read Cargo.toml");
        std::fs::write(&path, format!("{manifest}\n{lines}\n")).expect("write Cargo.toml");
    }

    /// `cargo run` in it, with `IDEMQ_ALLOW_UNPATCHED_AMQP_PARSER` set to `allow`
    /// or unset; stdout and stderr as text.
    async fn run(&self, allow: Option<&str>) -> (Output, String, String) {
        // This build's target folder: CARGO_TARGET_TMPDIR is its `tmp`.
        let target = Path::new(env!("CARGO_TARGET_TMPDIR")).parent().expect("the target folder");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
        let mut command = tokio::process::Command::new(cargo);
        command
            .args(["run", "--quiet", "--manifest-path"])
            .arg(self.folder.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", target)
            .env_remove(ALLOW)
            .env_remove("RUST_LOG")
            .kill_on_drop(true);
        if let Some(allow) = allow {
            command.env(ALLOW, allow);
        }
        let output = tokio::time::timeout(BUILD_TIMEOUT, command.output())
            .await
            .unwrap_or_else(|_| panic!("`cargo run` took longer than {BUILD_TIMEOUT:?}"))
            .expect("run cargo");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output, stdout, stderr)
    }
}

impl Drop for AppWorkspace {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// The two lines the refusal names: `[patch.crates-io]` and the one after it.
fn patch_lines(refusal: &str) -> String {
    let mut lines = refusal.lines().skip_while(|line| line.trim() != "[patch.crates-io]");
    let (Some(table), Some(patch)) = (lines.next(), lines.next()) else {
        panic!("the refusal names no [patch.crates-io]: {refusal}")
    };
    assert!(patch.starts_with("amq-protocol-types = { path = "), "{refusal}");
    format!("{table}\n{patch}")
}

#[tokio::test(flavor = "multi_thread")]
async fn an_application_workspace_is_refused_the_unpatched_parser_until_it_adds_the_two_lines() {
    let started = Instant::now();
    let app = AppWorkspace::new();

    let (output, stdout, stderr) = app.run(None).await;
    assert_eq!(output.status.code(), Some(1), "refused at build(); stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.starts_with("refused: the AMQP parser this program was built with"), "{stdout}");
    assert!(stdout.contains("fails the whole frame"), "{stdout}");
    assert!(stdout.contains(ALLOW), "the refusal names the opt-out: {stdout}");
    let lines = patch_lines(&stdout);
    let vendored = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("root").join("vendor");
    assert!(lines.contains(&vendored.join("amq-protocol-types").display().to_string()), "{lines}");
    eprintln!("unpatched, refused: {:?}", started.elapsed());

    let (output, stdout, stderr) = app.run(Some("1")).await;
    assert!(output.status.success(), "built when allowed; stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(stdout.trim(), "built");
    assert!(stderr.contains("WARN") && stderr.contains("Starting anyway"), "one warning: {stderr}");
    assert_eq!(stderr.matches("WARN").count(), 1, "{stderr}");
    eprintln!("unpatched, allowed: {:?}", started.elapsed());

    app.append(&lines);
    let (output, stdout, stderr) = app.run(None).await;
    assert!(output.status.success(), "built when patched; stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(stdout.trim(), "built");
    assert!(!stderr.contains("WARN"), "no warning once patched: {stderr}");
    eprintln!("patched: {:?}", started.elapsed());
}
