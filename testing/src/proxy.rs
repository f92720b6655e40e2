//! A loopback TCP proxy for network faults: [`NetworkProxy`].
//!
//! Each connection is two pipes (client → upstream, upstream → client). A pipe reads
//! a chunk, stamps it with the time it may be delivered (now + the latency), and a
//! writer beside it delivers the chunks in order once that time has come and no black
//! hole is in force. Both sides of a pipe wait while a black hole lasts, so nothing
//! moves, not even a close: the sockets stay open and silent, as with a network that
//! drops every packet. Afterwards whatever was held goes through (bytes, then a
//! close), as TCP's retransmissions would deliver it once a partition heals.
//!
//! A reset aborts a connection at both ends (`SO_LINGER` 0: the peers read
//! `ECONNRESET`, not an orderly end); so does a pipe that meets a reset or a write
//! error on one side, which passes it on to the other.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The most bytes a pipe reads at once.
const CHUNK: usize = 16 * 1024;
/// How many bytes of what each client sends are kept for
/// [`NetworkProxy::sent_by_clients`].
const RECORDED: usize = 64 * 1024;
/// The most chunks a pipe holds between reading and delivering them (with a latency,
/// what is in flight): past it, the pipe stops reading and the sender's socket buffers
/// fill, as on a real link.
const IN_FLIGHT: usize = 256;

/// A TCP proxy on a free loopback port in front of one upstream address (RabbitMQ,
/// PostgreSQL), for tests of network faults: point the code under test at
/// [`address`](Self::address) (or a URL rewritten by [`url_for`](Self::url_for)) and
/// then reset every connection, black-hole the traffic or slow it down.
///
/// ```no_run
/// # async fn example() -> std::io::Result<()> {
/// use std::time::Duration;
/// use idemq::testing::NetworkProxy;
///
/// let database_url = "postgres://postgres@127.0.0.1:5432/app";
/// let proxy = NetworkProxy::in_front_of(database_url).await?;
/// let through_proxy = proxy.url_for(database_url); // postgres://postgres@127.0.0.1:<port>/app
/// // ... start the runtime with `through_proxy` ...
/// proxy.set_latency(Duration::from_millis(50)); // each way
/// proxy.black_hole(); // a half-open peer: sockets open, nothing moves
/// // ... wait for what must happen meanwhile ...
/// proxy.restore(); // what was held goes through
/// proxy.reset_all(); // every connection aborted (RST) at both ends
/// # Ok(()) }
/// ```
///
/// Dropping the proxy stops it: it no longer listens, and every connection through
/// it is aborted (like losing the host).
pub struct NetworkProxy {
    address: SocketAddr,
    upstream: String,
    shared: Arc<Shared>,
}

/// What the listener, the connections and the handle share.
struct Shared {
    /// The conditions every pipe obeys, watched so that a restore wakes them.
    conditions: watch::Sender<Conditions>,
    /// Cancelled to abort every connection made so far, then replaced by a fresh
    /// child of `stop` (each connection holds the one current when it was accepted).
    generation: Mutex<CancellationToken>,
    /// Cancelled when the proxy is dropped.
    stop: CancellationToken,
    /// Connections accepted and not yet closed at both ends.
    open: AtomicUsize,
    /// What each connection's client sent (its first [`RECORDED`] bytes), in the
    /// order the connections were accepted.
    sent: Mutex<Vec<Vec<u8>>>,
}

/// What the network does right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Conditions {
    black_hole: bool,
    latency: Duration,
}

impl std::fmt::Debug for NetworkProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let conditions = *self.shared.conditions.borrow();
        f.debug_struct("NetworkProxy")
            .field("address", &self.address)
            .field("upstream", &self.upstream)
            .field("black_hole", &conditions.black_hole)
            .field("latency", &conditions.latency)
            .field("connections", &self.connections())
            .finish()
    }
}

impl NetworkProxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to
    /// `upstream` (`host:port`, connected to afresh for each one). A connection whose
    /// upstream refuses it is reset.
    ///
    /// # Errors
    /// No loopback port could be bound.
    ///
    /// # Cancel safety
    /// Cancel-safe: a proxy not yet returned has spawned nothing.
    pub async fn start(upstream: impl Into<String>) -> std::io::Result<Self> {
        let upstream = upstream.into();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let address = listener.local_addr()?;
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared {
            conditions: watch::Sender::new(Conditions { black_hole: false, latency: Duration::ZERO }),
            generation: Mutex::new(stop.child_token()),
            stop,
            open: AtomicUsize::new(0),
            sent: Mutex::new(Vec::new()),
        });
        tokio::spawn(accept(listener, upstream.clone(), Arc::clone(&shared)));
        Ok(Self { address, upstream, shared })
    }

    /// [`start`](Self::start) in front of the host and port of `url` (`amqp://…`,
    /// `amqps://…`, `postgres://…`, `postgresql://…`; without a port, the scheme's
    /// default). Pair it with [`url_for`](Self::url_for).
    ///
    /// # Errors
    /// `url` is not a URL with a host (or, for another scheme, a port), or no
    /// loopback port could be bound.
    ///
    /// # Cancel safety
    /// As [`start`](Self::start).
    pub async fn in_front_of(url: &str) -> std::io::Result<Self> {
        let invalid = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_owned());
        let parsed = url::Url::parse(url).map_err(|err| invalid(&format!("not a URL: {err}")))?;
        let host = parsed.host_str().filter(|host| !host.is_empty()).ok_or_else(|| invalid("no host"))?;
        let port = parsed
            .port()
            .or_else(|| default_port(parsed.scheme()))
            .ok_or_else(|| invalid("no port, and no default port for this scheme"))?;
        Self::start(format!("{host}:{port}")).await
    }

    /// Where the proxy listens: connect here instead of the upstream.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The upstream address, as given.
    pub fn upstream(&self) -> &str {
        &self.upstream
    }

    /// `url` with its host and port replaced by the proxy's address; the user,
    /// password, path (database, vhost) and query are kept.
    ///
    /// # Panics
    /// If `url` is not a URL with a host (a comma-separated list of broker URLs is
    /// not one: rewrite each).
    pub fn url_for(&self, url: &str) -> String {
        let mut parsed = url::Url::parse(url).unwrap_or_else(|err| panic!("url_for needs a URL: {err}"));
        assert!(parsed.has_host(), "url_for needs a URL with a host");
        parsed.set_host(Some(&self.address.ip().to_string())).expect("a URL with a host takes an IP address");
        parsed.set_port(Some(self.address.port())).expect("a URL with a host takes a port");
        parsed.into()
    }

    /// Aborts every connection open now, at both ends, whatever is in flight or held
    /// by a black hole: each peer reads a reset (`ECONNRESET`). Connections made
    /// afterwards are forwarded as usual (a black hole in force still holds them).
    pub fn reset_all(&self) {
        let mut generation = self.shared.generation.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        generation.cancel();
        *generation = self.shared.stop.child_token();
    }

    /// Stops all traffic, until [`restore`](Self::restore): every connection, open
    /// now or made meanwhile (accepted, but not connected upstream yet), stays open
    /// and silent — no byte, no close, no reset goes through either way. To the
    /// client it is a half-open peer: only its own timeouts or heartbeats can tell.
    pub fn black_hole(&self) {
        self.shared.conditions.send_modify(|conditions| conditions.black_hole = true);
    }

    /// Ends a black hole: what it held goes through, in order (bytes, then any close
    /// that came meanwhile), as if a network partition healed; new connections are
    /// connected upstream. A peer that gave up meanwhile has closed its end, so what
    /// the other sent it is answered by a reset.
    pub fn restore(&self) {
        self.shared.conditions.send_modify(|conditions| conditions.black_hole = false);
    }

    /// Whether a black hole is in force.
    pub fn is_black_holed(&self) -> bool {
        self.shared.conditions.borrow().black_hole
    }

    /// Delays every byte by `latency` in each direction from now on (a round trip
    /// takes twice as long; the throughput is not limited). Zero (the default)
    /// forwards at once.
    pub fn set_latency(&self, latency: Duration) {
        self.shared.conditions.send_modify(|conditions| conditions.latency = latency);
    }

    /// How many connections through the proxy are open (accepted, and not yet closed
    /// at both ends), e.g. to wait until the code under test has connected.
    pub fn connections(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// What the client of each connection accepted so far sent through the proxy (its
    /// first 64 KiB), in the order the connections were accepted: to check what
    /// crosses the wire — that a TLS connection opens with a handshake
    /// (`0x16 0x03 …`, or PostgreSQL's SSLRequest first) and that no password or
    /// payload ever appears in the clear.
    pub fn sent_by_clients(&self) -> Vec<Vec<u8>> {
        self.shared.sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl Drop for NetworkProxy {
    fn drop(&mut self) {
        self.shared.stop.cancel();
    }
}

/// The default port of the URL schemes the proxy stands in front of.
fn default_port(scheme: &str) -> Option<u16> {
    match scheme {
        "amqp" => Some(5672),
        "amqps" => Some(5671),
        "postgres" | "postgresql" => Some(5432),
        _ => None,
    }
}

/// Accepts connections until the proxy is dropped.
async fn accept(listener: TcpListener, upstream: String, shared: Arc<Shared>) {
    loop {
        let accepted = tokio::select! {
            () = shared.stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((client, _)) = accepted else {
            // Out of file descriptors, say: the client's connect fails; try again soon.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let reset = shared.generation.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        shared.open.fetch_add(1, Ordering::SeqCst);
        let index = {
            let mut sent = shared.sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            sent.push(Vec::new());
            sent.len() - 1
        };
        tokio::spawn(connection(client, upstream.clone(), Arc::clone(&shared), reset, index));
    }
}

/// Counts a connection as open while it lives.
struct Open(Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One proxied connection, from accept until both ends are closed.
async fn connection(
    client: TcpStream,
    upstream: String,
    shared: Arc<Shared>,
    reset: CancellationToken,
    index: usize,
) {
    let _open = Open(Arc::clone(&shared));
    let mut conditions = shared.conditions.subscribe();
    // Black-holed from the start: accepted, but nothing reaches the upstream (not even
    // the connect) until the black hole ends.
    let connected = tokio::select! {
        () = reset.cancelled() => None,
        server = async {
            flowing(&mut conditions).await;
            TcpStream::connect(&upstream).await
        } => server.ok(),
    };
    let Some(server) = connected else {
        abort_stream(&client);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // A reset of one side, or of everything, aborts both pipes.
    let abort = reset.child_token();
    tokio::join!(
        pipe(client_read, server_write, shared.conditions.subscribe(), abort.clone(), Some((&shared, index))),
        pipe(server_read, client_write, shared.conditions.subscribe(), abort, None),
    );
}

/// What a pipe passes from its reader to its writer.
enum Chunk {
    /// Bytes, and when they may be delivered.
    Data(Vec<u8>, Instant),
    /// The sender closed its end (after its last bytes).
    End,
}

/// Copies `from` into `to` under the proxy's conditions, until `from` ends (then `to`
/// is shut down: the close goes through) or the connection is aborted (then both
/// sockets are reset, once the other pipe lets go of its halves too).
async fn pipe(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    conditions: watch::Receiver<Conditions>,
    abort: CancellationToken,
    record: Option<(&Shared, usize)>,
) {
    let (chunks, queued) = mpsc::channel(IN_FLIGHT);
    let reading = read_side(&mut from, chunks, conditions.clone(), &abort, record);
    let writing = write_side(&mut to, queued, conditions, &abort);
    tokio::select! {
        () = abort.cancelled() => {}
        ((), ()) = async { tokio::join!(reading, writing) } => {}
    }
    if abort.is_cancelled() {
        abort_stream(from.as_ref());
        abort_stream(to.as_ref());
        // No FIN on the way out: the socket closes (with a reset) when both halves
        // are dropped.
        to.forget();
    }
}

/// Reads chunks off `from`, each stamped with its delivery time, until its end.
async fn read_side(
    from: &mut OwnedReadHalf,
    chunks: mpsc::Sender<Chunk>,
    mut conditions: watch::Receiver<Conditions>,
    abort: &CancellationToken,
    record: Option<(&Shared, usize)>,
) {
    let mut buffer = vec![0_u8; CHUNK];
    loop {
        flowing(&mut conditions).await;
        let chunk = match from.read(&mut buffer).await {
            Ok(0) => Chunk::End,
            Ok(n) => {
                if let Some((shared, index)) = record {
                    let mut sent = shared.sent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    let kept = &mut sent[index];
                    let room = RECORDED.saturating_sub(kept.len()).min(n);
                    kept.extend_from_slice(&buffer[..room]);
                }
                Chunk::Data(buffer[..n].to_vec(), Instant::now() + conditions.borrow().latency)
            }
            Err(_) => {
                // A reset (or another failure) of this side: passed on to the other,
                // once the network lets it through.
                flowing(&mut conditions).await;
                abort.cancel();
                return;
            }
        };
        let end = matches!(chunk, Chunk::End);
        if chunks.send(chunk).await.is_err() || end {
            // The writer has stopped (its side failed, and the pipe is aborting).
            return;
        }
    }
}

/// Delivers the chunks to `to` when they are due and the network lets them through.
async fn write_side(
    to: &mut OwnedWriteHalf,
    mut queued: mpsc::Receiver<Chunk>,
    mut conditions: watch::Receiver<Conditions>,
    abort: &CancellationToken,
) {
    while let Some(chunk) = queued.recv().await {
        match chunk {
            Chunk::Data(bytes, due) => {
                tokio::time::sleep_until(due).await;
                flowing(&mut conditions).await;
                if to.write_all(&bytes).await.is_err() {
                    abort.cancel();
                    return;
                }
            }
            Chunk::End => {
                flowing(&mut conditions).await;
                let _ = to.shutdown().await;
                return;
            }
        }
    }
}

/// Returns once no black hole is in force (never, if the proxy is gone: it is
/// aborting every connection).
async fn flowing(conditions: &mut watch::Receiver<Conditions>) {
    if conditions.wait_for(|now| !now.black_hole).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Makes closing `stream` abortive: a reset, not an orderly end (`SO_LINGER` 0).
fn abort_stream(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}
