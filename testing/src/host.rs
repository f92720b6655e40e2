//! What the kit's private servers share on this host: who we run as, a watchdog
//! that cleans up after this process however it ends, and the removal of what a
//! killed run left behind.

#[cfg(feature = "testing")]
use std::path::{Path, PathBuf};

use super::ClusterError;

/// Whether this process runs as root (the servers then run as their own users).
pub(super) fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status.lines().any(|line| line.starts_with("Uid:") && line.split_whitespace().nth(1) == Some("0"))
    })
}

/// An I/O failure while doing `action`.
pub(super) fn io(action: &str, source: std::io::Error) -> ClusterError {
    ClusterError::Io { action: action.to_owned(), source }
}

/// Starts `sh -c` with a script that waits for this process to end, then runs
/// `cleanup`: in a process group of its own, so it outlives us (a kit kept in a
/// `static` is never dropped, and a killed test binary drops nothing).
#[cfg(feature = "testing")]
pub(super) fn watchdog(cleanup: &str, what: &str) -> Result<std::process::Child, ClusterError> {
    use std::os::unix::process::CommandExt;
    let script = format!("while kill -0 {} 2>/dev/null; do sleep 1; done; {cleanup}", std::process::id());
    std::process::Command::new("sh")
        .args(["-c", &script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|source| io(&format!("start the watchdog of {what}"), source))
}

/// The directories `<base>-<pid>-…` under `/tmp` whose process `<pid>` is gone:
/// left over by a run that was killed (its watchdog too).
#[cfg(feature = "testing")]
pub(super) fn stale_dirs(base: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir("/tmp") else { return Vec::new() };
    let prefix = format!("{}-", base.trim_start_matches("/tmp/"));
    entries
        .filter_map(Result::ok)
        .filter(|entry| {
            let name = entry.file_name();
            let Some(rest) = name.to_str().and_then(|name| name.strip_prefix(&prefix)) else { return false };
            rest.split('-')
                .next()
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .map(|entry| entry.path())
        .collect()
}
