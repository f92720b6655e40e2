//! RabbitMQ's HTTP API (the management plugin), for the vhosts of the tests.
//!
//! Each `rabbitmqctl` call boots an Erlang VM: about half a second of CPU, and a
//! suite run made 445 of them, 321 for the vhosts of 107 tests (add, permissions,
//! delete) — the largest share of the suite's CPU on a 2-core machine, more than
//! the broker's own. An HTTP request costs the broker a few milliseconds.
//!
//! The plugin ships with RabbitMQ; if its listener does not answer, the first vhost
//! enables it once (`rabbitmq-plugins enable rabbitmq_management`, which persists on
//! that broker) and waits for it. If that fails, the tests use `rabbitmqctl` as
//! before, and say so once.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use tokio::sync::OnceCell;

/// The management plugin's port (its default).
const PORT: u16 = 15672;
/// How long the plugin may take to answer once enabled.
const ENABLE_WAIT: Duration = Duration::from_secs(30);
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// The HTTP API of the broker `amqp_url` names, with its credentials.
#[derive(Debug)]
pub(crate) struct Api {
    addr: SocketAddr,
    authorization: String,
}

/// The API of the test broker, enabling the plugin the first time if it must; `None`
/// if it cannot be had (then `rabbitmqctl` it is).
pub(crate) async fn api() -> Option<&'static Api> {
    static API: OnceCell<Option<Api>> = OnceCell::const_new();
    API.get_or_init(|| async {
        let api = tokio::task::spawn_blocking(|| Api::for_url(&crate::amqp_url())).await.ok().flatten()?;
        if api.answers() {
            return Some(api);
        }
        let enabled = tokio::process::Command::new("rabbitmq-plugins")
            .args(["-q", "enable", "rabbitmq_management"])
            .stdin(std::process::Stdio::null())
            .output()
            .await;
        let api = match enabled {
            Ok(out) if out.status.success() => tokio::task::spawn_blocking(move || {
                let deadline = Instant::now() + ENABLE_WAIT;
                while Instant::now() < deadline {
                    if api.answers() {
                        return Some(api);
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
                None
            })
            .await
            .ok()
            .flatten(),
            _ => None,
        };
        if api.is_none() {
            eprintln!(
                "note: RabbitMQ's management plugin is not answering on port {PORT} and could not be \
                 enabled; test vhosts are managed with rabbitmqctl (slower)"
            );
        }
        api
    })
    .await
    .as_ref()
}

impl Api {
    /// The API on `amqp_url`'s host, with its user and password (`guest` if none).
    fn for_url(amqp_url: &str) -> Option<Api> {
        let rest = amqp_url.split_once("://")?.1;
        let authority = rest.split(['/', '?']).next()?;
        let (userinfo, host_port) = authority.rsplit_once('@').unwrap_or(("guest:guest", authority));
        let host = host_port.rsplit_once(':').map_or(host_port, |(host, _)| host);
        let addr = (host, PORT).to_socket_addrs().ok()?.next()?;
        let userinfo = percent_decode(userinfo);
        Some(Api { addr, authorization: format!("Basic {}", base64(userinfo.as_bytes())) })
    }

    fn answers(&self) -> bool {
        self.request("GET", "/api/overview", None).is_ok_and(|status| status == 200)
    }

    /// Sends one request and returns the response's status code.
    pub(crate) fn request(&self, method: &str, path: &str, json: Option<&str>) -> std::io::Result<u16> {
        let mut stream = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        stream.set_write_timeout(Some(IO_TIMEOUT))?;
        let body = json.unwrap_or("");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.addr,
            self.authorization,
            body.len()
        );
        stream.write_all(request.as_bytes())?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response)?;
        let status_line = response.split(|&b| b == b'\r').next().unwrap_or_default();
        std::str::from_utf8(status_line)
            .ok()
            .and_then(|line| line.split(' ').nth(1))
            .and_then(|code| code.parse().ok())
            .ok_or_else(|| std::io::Error::other("not an HTTP response"))
    }

    /// Sends one request that must succeed (2xx), panicking with what was asked.
    pub(crate) async fn expect(
        &'static self,
        method: &'static str,
        path: String,
        json: Option<&'static str>,
    ) {
        let what = format!("{method} {path}");
        let status = tokio::task::spawn_blocking(move || self.request(method, &path, json))
            .await
            .expect("the request's thread");
        match status {
            Ok(status) if (200..300).contains(&status) => {}
            other => panic!("RabbitMQ's HTTP API: {what}: {other:?}"),
        }
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(high), Some(low)) => {
                out.push((high * 16 + low) as u8);
                i += 3;
            }
            (byte, _, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn base64(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_credentials_are_base64_of_user_colon_password() {
        assert_eq!(base64(b"guest:guest"), "Z3Vlc3Q6Z3Vlc3Q=");
        assert_eq!(base64(b"a"), "YQ==");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(base64(b"abc"), "YWJj");
    }

    #[test]
    fn the_api_is_on_the_amqp_urls_host_with_its_credentials() {
        let api = Api::for_url("amqp://us%40er:p%3Ass@127.0.0.1:5672/%2f").expect("an API");
        assert_eq!(api.addr, "127.0.0.1:15672".parse().unwrap());
        assert_eq!(api.authorization, format!("Basic {}", base64(b"us@er:p:ss")));
    }
}
