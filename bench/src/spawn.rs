//! Runs a contender in a child process (this binary, `--child …`) and reads its report.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::child::ChildReport;
use crate::config::ChildSpec;
use crate::urls::Urls;

/// A child still running after this is killed (it has its own, shorter timeouts).
const CHILD_TIMEOUT: Duration = Duration::from_secs(900);

/// Runs `spec` in a child and returns its report, or what went wrong (its own
/// error message has gone to stderr, which the child shares with this process).
pub(crate) async fn child(spec: &ChildSpec, urls: &Urls) -> Result<ChildReport, String> {
    let exe = std::env::current_exe().map_err(|err| format!("cannot find this program: {err}"))?;
    let mut command = Command::new(exe);
    command
        .args(spec.to_args())
        .env("AMQP_URL", &urls.amqp)
        .env("DATABASE_URL", &urls.database)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let output = tokio::task::spawn_blocking(move || run(command))
        .await
        .map_err(|err| format!("the child's waiter panicked: {err}"))??;
    let line = output.lines().rev().find(|line| !line.trim().is_empty()).unwrap_or_default();
    serde_json::from_str(line).map_err(|err| format!("the child's report is not readable ({err}): {line:?}"))
}

/// Spawns `command`, collects its stdout, and waits for it (killing it after
/// [`CHILD_TIMEOUT`]). Blocking.
fn run(mut command: Command) -> Result<String, String> {
    let mut child = command.spawn().map_err(|err| format!("cannot start the child: {err}"))?;
    let mut stdout = child.stdout.take().ok_or("the child has no stdout")?;
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        stdout.read_to_string(&mut out).map(|_| out)
    });
    let deadline = Instant::now() + CHILD_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("the child ran longer than {CHILD_TIMEOUT:?} and was killed"));
            }
            Err(err) => return Err(format!("cannot wait for the child: {err}")),
        }
    };
    let out = reader.join().map_err(|_| "the child's reader panicked")?.map_err(|err| err.to_string())?;
    if !status.success() {
        return Err(format!("the child failed ({status}; its error is printed above)"));
    }
    Ok(out)
}
