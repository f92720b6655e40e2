//! The processes of a private cluster's nodes: the watchdog that holds the host's
//! lock and tears down after the owner, each node's directory and configuration,
//! `rabbitmq-server -detached`, the start-up wait, `rabbitmqctl`, and finding and
//! killing a node's processes by their environment.

use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use tokio::process::Command;

use super::{ClusterBuilder, ClusterError, ClusterNode};
use crate::host::is_root;

/// Where the nodes' files live (one directory per node) and the lock beside it.
pub(super) const BASE: &str = "/tmp/idemq-kit-cluster";
/// Node names are `<PREFIX><letter>@localhost`.
pub(super) const PREFIX: &str = "idemq-kit-";
/// How long a node may take to start (first boot creates its database).
const START_TIMEOUT: Duration = Duration::from_secs(90);

/// Takes the host-wide lock and keeps it in a watchdog: `flock(1)` running a
/// shell, in a process group of its own (so it outlives this process), that says
/// when it holds the lock, waits for this process to end however it ends, then
/// kills every node of ours (found by their environment, as [`node_pids`] does),
/// wipes their data and so releases the lock. Blocks while another run's cluster
/// holds it.
pub(super) fn start_watchdog() -> Result<std::process::Child, ClusterError> {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let script = format!(
        "echo locked; \
         while kill -0 {owner} 2>/dev/null; do sleep 1; done; \
         for p in /proc/[0-9]*; do \
           if tr '\\0' '\\n' 2>/dev/null < $p/environ | grep -qx 'RABBITMQ_NODENAME={PREFIX}.*'; then \
             kill -9 ${{p#/proc/}} 2>/dev/null; \
           fi; \
         done; rm -rf {BASE}",
        owner = std::process::id(),
    );
    let lock = format!("{BASE}.lock");
    let mut child = std::process::Command::new("flock")
        .args([lock.as_str(), "sh", "-c", &script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|source| io("start the cluster's watchdog (flock)", source))?;
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|source| io(&format!("wait for the lock {lock}"), source))?;
    if line.trim() != "locked" {
        let _ = child.kill();
        return Err(ClusterError::Command {
            command: format!("flock {lock}"),
            output: "did not take the lock".into(),
        });
    }
    Ok(child)
}

pub(super) use crate::host::io;

/// Kills nodes left over by a killed run (found by name) and wipes their data.
pub(super) async fn remove_stale() -> Result<(), ClusterError> {
    let stale = node_pids(PREFIX);
    if !stale.is_empty() {
        tracing::warn!(processes = stale.len(), "removing a stale private RabbitMQ cluster of a killed run");
        for pid in &stale {
            kill_pid(*pid);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while !node_pids(PREFIX).is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    match std::fs::remove_dir_all(BASE) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(io(&format!("remove {BASE}"), err)),
        _ => Ok(()),
    }
}

pub(super) fn prepare_dir(node: &ClusterNode, options: &ClusterBuilder) -> Result<(), ClusterError> {
    let write = |path: &Path, text: String| {
        std::fs::write(path, text).map_err(|source| io(&format!("write {}", path.display()), source))
    };
    for dir in [node.dir.join("log"), node.dir.join("mnesia")] {
        std::fs::create_dir_all(&dir).map_err(|source| io(&format!("create {}", dir.display()), source))?;
    }
    let mut conf = format!("listeners.tcp.default = 127.0.0.1:{}\nloopback_users = none\n", node.port);
    for line in &options.conf {
        conf.push_str(line);
        conf.push('\n');
    }
    write(&node.dir.join("rabbitmq.conf"), conf)?;
    let mut rabbit: Vec<String> =
        options.rabbit.iter().map(|(key, value)| format!("{{{key}, {value}}}")).collect();
    if let Some(tls) = &options.tls {
        // In `advanced.config`: `rabbitmq.conf` has no key for `sni_hosts`.
        let quote = |text: &str| format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""));
        let files = |(cert, key): &(String, String)| {
            format!("{{certfile, {}}}, {{keyfile, {}}}", quote(cert), quote(key))
        };
        let sni: Vec<String> =
            tls.sni.iter().map(|(name, pair)| format!("{{{}, [{}]}}", quote(name), files(pair))).collect();
        rabbit.push(format!("{{ssl_listeners, [{{\"127.0.0.1\", {}}}]}}", node.tls_port));
        rabbit.push(format!(
            "{{ssl_options, [{{cacertfile, {}}}, {}, {{verify, verify_peer}}, {{fail_if_no_peer_cert, {}}}, {{sni_hosts, [{}]}}]}}",
            quote(&tls.ca),
            files(&tls.identity),
            tls.require_client_certificates,
            sni.join(", ")
        ));
    }
    let advanced = if rabbit.is_empty() {
        "[].\n".to_owned()
    } else {
        format!("[{{rabbit, [{}]}}].\n", rabbit.join(", "))
    };
    write(&node.dir.join("advanced.config"), advanced)?;
    write(&node.dir.join("enabled_plugins"), "[].\n".to_owned())?;
    if is_root() {
        // The nodes run as `rabbitmq`: it must own their files.
        let status = std::process::Command::new("chown")
            .arg("-R")
            .arg("rabbitmq:rabbitmq")
            .arg(&node.dir)
            .status()
            .map_err(|source| io("chown the node's files", source))?;
        if !status.success() {
            return Err(ClusterError::Command {
                command: format!("chown -R rabbitmq {}", node.dir.display()),
                output: status.to_string(),
            });
        }
    }
    Ok(())
}

/// `rabbitmq-server -detached` for `node`, as `rabbitmq` when we are root.
pub(super) async fn launch(node: &ClusterNode) -> Result<(), ClusterError> {
    let dir = node.dir.display().to_string();
    let env = [
        ("RABBITMQ_NODENAME", node.name.clone()),
        ("RABBITMQ_NODE_PORT", node.port.to_string()),
        ("RABBITMQ_DIST_PORT", node.dist_port().to_string()),
        ("RABBITMQ_MNESIA_BASE", format!("{dir}/mnesia")),
        ("RABBITMQ_LOG_BASE", format!("{dir}/log")),
        ("RABBITMQ_CONFIG_FILE", format!("{dir}/rabbitmq.conf")),
        ("RABBITMQ_ADVANCED_CONFIG_FILE", format!("{dir}/advanced.config")),
        ("RABBITMQ_ENABLED_PLUGINS_FILE", format!("{dir}/enabled_plugins")),
        ("RABBITMQ_PID_FILE", format!("{dir}/pid")),
        ("ERL_EPMD_ADDRESS", "127.0.0.1".to_owned()),
    ];
    let mut command = if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq"]);
        for (name, value) in &env {
            command.arg(format!("{name}={value}"));
        }
        command.args(["rabbitmq-server", "-detached"]);
        command
    } else {
        let mut command = Command::new("rabbitmq-server");
        command.arg("-detached").envs(env.iter().map(|(name, value)| (name, value)));
        command
    };
    // Not a pipe: the detached node inherits it, and dies of SIGPIPE writing to it
    // once we have stopped reading.
    let log_path = node.dir.join("launch.log");
    let log =
        File::create(&log_path).map_err(|source| io(&format!("create {}", log_path.display()), source))?;
    let log_err = log.try_clone().map_err(|source| io("clone a file handle", source))?;
    let status = command
        .stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .status()
        .await
        .map_err(|source| io("run rabbitmq-server", source))?;
    if !status.success() {
        return Err(ClusterError::Command {
            command: format!("rabbitmq-server -detached ({})", node.name),
            output: std::fs::read_to_string(&log_path).unwrap_or_default(),
        });
    }
    Ok(())
}

pub(super) async fn await_startup(node: &ClusterNode) -> Result<(), ClusterError> {
    // `await_startup` waits for a node that is booting, but fails at once for one
    // that has not registered with epmd yet: ask again until the deadline.
    let deadline = Instant::now() + START_TIMEOUT;
    let timeout = START_TIMEOUT.as_secs().to_string();
    loop {
        match ctl(&node.name, &["await_startup", "-t", &timeout]).await {
            Ok(_) => return Ok(()),
            Err(err) if Instant::now() > deadline => {
                return Err(if node_pids(&node.name).is_empty() {
                    ClusterError::Timeout { node: node.name.clone(), what: "start", timeout: START_TIMEOUT }
                } else {
                    err
                });
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// `rabbitmqctl -n node args…`; its stdout.
pub(super) async fn ctl(node: &str, args: &[&str]) -> Result<String, ClusterError> {
    let output = Command::new("rabbitmqctl")
        .arg("-n")
        .arg(node)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|source| io("run rabbitmqctl", source))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(ClusterError::Command {
            command: format!("rabbitmqctl -n {node} {}", args.join(" ")),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        })
    }
}

/// Processes of a node whose name starts with `name` (the Erlang VM and its
/// helpers), found by `RABBITMQ_NODENAME` in their environment: RabbitMQ 3.x does
/// not put the node name on the command line, nor reliably write its pid file
/// when detached.
pub(super) fn node_pids(name: &str) -> Vec<u32> {
    let needle = format!("RABBITMQ_NODENAME={name}");
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|environ| environ.split(|b| *b == 0).any(|var| var.starts_with(needle.as_bytes())))
        })
        .collect()
}

pub(super) fn kill_node(name: &str) {
    for pid in node_pids(name) {
        kill_pid(pid);
    }
}

fn kill_pid(pid: u32) {
    let _ = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status();
}
