//! A TCP proxy that can go silent: it stops forwarding on the connections it has,
//! without closing them, like a broker that hangs or a network that drops packets.
//! New connections are forwarded normally.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// A proxy to one upstream address; stops when dropped.
pub struct Proxy {
    address: SocketAddr,
    next_id: Arc<AtomicU64>,
    frozen_before: Arc<AtomicU64>,
    /// Cancelled to close every connection made so far; replaced by a fresh one.
    sever: Arc<std::sync::Mutex<CancellationToken>>,
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`.
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let address = listener.local_addr().expect("proxy address");
        let next_id = Arc::new(AtomicU64::new(0));
        let frozen_before = Arc::new(AtomicU64::new(0));
        let stop = CancellationToken::new();
        let sever = Arc::new(std::sync::Mutex::new(CancellationToken::new()));
        let (ids, frozen, stopped, upstream) =
            (Arc::clone(&next_id), Arc::clone(&frozen_before), stop.clone(), upstream.to_owned());
        let severs = Arc::clone(&sever);
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    () = stopped.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                };
                let Ok(server) = TcpStream::connect(&upstream).await else { continue };
                let id = ids.fetch_add(1, Ordering::SeqCst);
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let severed = severs.lock().expect("sever lock").clone();
                for (from, to) in [(client_read, server_write), (server_read, client_write)] {
                    let (frozen, stopped, severed) = (Arc::clone(&frozen), stopped.clone(), severed.clone());
                    tokio::spawn(async move {
                        tokio::select! {
                            () = stopped.cancelled() => {}
                            () = severed.cancelled() => {}
                            () = pump(from, to, id, frozen) => {}
                        }
                    });
                }
            }
        });
        Proxy { address, next_id, frozen_before, sever, stop }
    }

    /// `host:port` to connect to instead of the upstream.
    pub fn address(&self) -> String {
        self.address.to_string()
    }

    /// Every connection made so far is closed at once, both ways, whatever is in
    /// flight (a network cut); new connections are forwarded normally.
    pub fn sever_existing(&self) {
        let mut current = self.sever.lock().expect("sever lock");
        current.cancel();
        *current = CancellationToken::new();
    }

    /// Every connection made so far stops forwarding (and stays open).
    pub fn freeze_existing(&self) {
        self.frozen_before.store(self.next_id.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Copies bytes until EOF; once connection `id` is frozen it swallows them instead.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, id: u64, frozen_before: Arc<AtomicU64>) {
    let mut buffer = vec![0_u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if id < frozen_before.load(Ordering::SeqCst) {
            // Silent: read and drop, never answer, never close.
            continue;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
