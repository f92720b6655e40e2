//! What PostgreSQL said, read off the wire: the SQLSTATE of every error the server
//! sends on a connection.
//!
//! diesel-async keeps a server error's message but drops its SQLSTATE (its
//! `DatabaseErrorInformation` has no code and cannot be downcast), and the message is
//! translated into the server's `lc_messages`. So every connection idemq makes reads
//! its plaintext through a [`Wire`], which follows the backend's message framing (a
//! type byte, then a big-endian `u32` length that counts itself) and, for each
//! `ErrorResponse` (`'E'`), takes the `'C'` (code) field and records it in the
//! connection's [`WireLog`]. A statement's failure is then read by its code: mark the
//! log before the statement ([`WireLog::mark`]), ask what arrived since
//! ([`WireLog::since`]).
//!
//! It costs a few comparisons per message: message bodies are skipped by counting,
//! never copied; of an error only its five code bytes are kept; nothing allocates.
//! Messages split across reads, and many in one read, are followed alike.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A SQLSTATE: five ASCII characters (`40P01`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SqlState([u8; 5]);

impl SqlState {
    /// The code `text` (five characters).
    pub(crate) const fn new(text: &[u8; 5]) -> Self {
        Self(*text)
    }

    /// The code as text.
    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or("?????")
    }
}

impl std::fmt::Debug for SqlState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SqlState({})", self.as_str())
    }
}

impl std::fmt::Display for SqlState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How many of a connection's latest errors its log keeps. A statement's own error
/// is the last one when it fails; the few before it tell a cause (a deadlock) from
/// its echoes (25P02 for every statement after it in the aborted transaction).
pub(crate) const KEPT: usize = 8;

/// A point in a connection's log: the errors after it are the ones
/// [`WireLog::since`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mark(u64);

/// The SQLSTATEs a connection's server sent, the latest [`KEPT`], shared between its
/// [`Wire`] (which writes, in the connection's task) and whoever reads its errors.
#[derive(Debug, Default)]
pub(crate) struct WireLog {
    /// Errors seen so far: the next one's sequence number.
    seen: AtomicU64,
    /// Error `n` is at `n % KEPT`.
    kept: Mutex<[Option<SqlState>; KEPT]>,
}

impl WireLog {
    /// A log of nothing yet.
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The point after every error seen so far.
    pub(crate) fn mark(&self) -> Mark {
        Mark(self.seen.load(Ordering::Acquire))
    }

    /// The errors the server sent after `mark`, oldest first (at most the latest
    /// [`KEPT`]). An error is recorded when its message is read, before the driver
    /// hands it to the statement that waits for it: once a statement has failed, its
    /// error is here.
    pub(crate) fn since(&self, mark: Mark) -> Sent {
        let kept = self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let seen = self.seen.load(Ordering::Acquire);
        let first = mark.0.max(seen.saturating_sub(KEPT as u64));
        let mut sent = Sent { codes: [None; KEPT], len: 0 };
        for n in first..seen {
            sent.codes[sent.len] = kept[(n % KEPT as u64) as usize];
            sent.len += 1;
        }
        sent
    }

    fn record(&self, code: SqlState) {
        let mut kept = self.kept.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = self.seen.load(Ordering::Acquire);
        kept[(n % KEPT as u64) as usize] = Some(code);
        self.seen.store(n + 1, Ordering::Release);
    }
}

/// The errors a server sent after a [`Mark`], oldest first.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sent {
    codes: [Option<SqlState>; KEPT],
    len: usize,
}

impl Sent {
    /// Each code, oldest first.
    pub(crate) fn iter(&self) -> impl DoubleEndedIterator<Item = SqlState> + '_ {
        self.codes[..self.len].iter().flatten().copied()
    }

    /// The latest: a statement that just failed, its error.
    pub(crate) fn last(&self) -> Option<SqlState> {
        self.iter().next_back()
    }
}

/// A connection's plaintext stream, its backend messages followed for their errors'
/// SQLSTATEs (see the module docs). Writes pass through untouched.
pub(crate) struct Wire<S> {
    inner: S,
    log: Arc<WireLog>,
    framing: Framing,
}

impl<S> Wire<S> {
    /// `inner`, positioned at the start of a backend message (after the SSLRequest's
    /// answer and any TLS handshake), its errors recorded in `log`.
    pub(crate) fn new(inner: S, log: Arc<WireLog>) -> Self {
        Self { inner, log, framing: Framing::default() }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Wire<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let log = &this.log;
            this.framing.feed(&buf.filled()[before..], |code| log.record(code));
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Wire<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<S: tokio_postgres::tls::TlsStream + Unpin> tokio_postgres::tls::TlsStream for Wire<S> {
    fn channel_binding(&self) -> tokio_postgres::tls::ChannelBinding {
        self.inner.channel_binding()
    }
}

/// Where the reader is in the backend's message stream.
#[derive(Debug, Clone, Copy)]
enum Framing {
    /// In a message's header: its type byte, then its length (`got` of the 5 bytes).
    Header { got: usize, header: [u8; 5] },
    /// In the body of a message that is not an error: `left` bytes to skip.
    Skip { left: usize },
    /// In the body of an `ErrorResponse`, `left` bytes to its end.
    Error { left: usize, field: Field },
    /// The stream broke the framing (a length below 4): nothing more is read from
    /// it (the driver fails the connection on its own).
    Lost,
}

impl Default for Framing {
    fn default() -> Self {
        Self::Header { got: 0, header: [0; 5] }
    }
}

/// Where the reader is in an `ErrorResponse`'s fields: each a type byte and a
/// NUL-terminated value, the list ended by a NUL type byte.
#[derive(Debug, Clone, Copy)]
enum Field {
    /// At the next field's type byte.
    Type,
    /// In a value; the code field's first five bytes are kept.
    Value { code: bool, got: usize, value: [u8; 5] },
    /// Past the list's terminator (nothing should follow it).
    Done,
}

impl Framing {
    /// Follows `bytes`, the next bytes the server sent, calling `found` with the code
    /// of each complete `ErrorResponse`'s `C` field.
    fn feed(&mut self, mut bytes: &[u8], mut found: impl FnMut(SqlState)) {
        while !bytes.is_empty() {
            match self {
                Self::Lost => return,
                Self::Header { got, header } => {
                    let take = (header.len() - *got).min(bytes.len());
                    header[*got..*got + take].copy_from_slice(&bytes[..take]);
                    *got += take;
                    bytes = &bytes[take..];
                    if *got == header.len() {
                        let length =
                            u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
                        *self = match length.checked_sub(4) {
                            None => Self::Lost,
                            Some(left) if header[0] == b'E' => Self::Error { left, field: Field::Type },
                            Some(left) => Self::Skip { left },
                        };
                        self.end_if_done();
                    }
                }
                Self::Skip { left } => {
                    let take = (*left).min(bytes.len());
                    *left -= take;
                    bytes = &bytes[take..];
                    self.end_if_done();
                }
                Self::Error { left, field } => {
                    let take = (*left).min(bytes.len());
                    for &byte in &bytes[..take] {
                        *field = match *field {
                            Field::Type if byte == 0 => Field::Done,
                            Field::Type => Field::Value { code: byte == b'C', got: 0, value: [0; 5] },
                            Field::Value { code, got, value } if byte == 0 => {
                                if code && got == value.len() {
                                    found(SqlState(value));
                                }
                                Field::Type
                            }
                            Field::Value { code, got, mut value } => {
                                if code && got < value.len() {
                                    value[got] = byte;
                                }
                                // A code longer than five bytes is none: `got` passes 5.
                                Field::Value { code, got: got.saturating_add(1), value }
                            }
                            Field::Done => Field::Done,
                        };
                    }
                    *left -= take;
                    bytes = &bytes[take..];
                    self.end_if_done();
                }
            }
        }
    }

    /// A body read to its end: the next message's header follows.
    fn end_if_done(&mut self) {
        if matches!(self, Self::Skip { left: 0 } | Self::Error { left: 0, .. }) {
            *self = Self::default();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend message: type byte, length (counting itself), body.
    fn message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut bytes = vec![kind];
        bytes.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        bytes.extend_from_slice(body);
        bytes
    }

    /// An `ErrorResponse` with these fields.
    fn error(fields: &[(u8, &str)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (kind, value) in fields {
            body.push(*kind);
            body.extend_from_slice(value.as_bytes());
            body.push(0);
        }
        body.push(0);
        message(b'E', &body)
    }

    /// What a server sends for a deadlock in German: the message translated, the code not.
    fn deadlock() -> Vec<u8> {
        error(&[
            (b'S', "FEHLER"),
            (b'V', "ERROR"),
            (b'C', "40P01"),
            (b'M', "Verklemmung (Deadlock) entdeckt"),
            (b'D', "Prozess 1 wartet auf ShareLock; blockiert von Prozess 2."),
            (b'F', "deadlock.c"),
            (b'L', "1148"),
            (b'R', "DeadLockReport"),
        ])
    }

    /// A stream of messages: rows, an error, a notice (same fields, not an error),
    /// another error, ReadyForQuery.
    fn stream() -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend(message(b'D', b"\x00\x01\x00\x00\x00\x03abc"));
        bytes.extend(message(b'D', &[7; 300]));
        bytes.extend(deadlock());
        bytes.extend(message(b'N', b"SWARNING\0C01000\0Mhm\0\0"));
        bytes.extend(error(&[
            (b'S', "ERROR"),
            (b'C', "25P02"),
            (b'M', "aktuelle Transaktion wurde abgebrochen"),
        ]));
        bytes.extend(message(b'Z', b"E"));
        bytes
    }

    fn codes_of(chunks: &[&[u8]]) -> Vec<String> {
        let mut framing = Framing::default();
        let mut codes = Vec::new();
        for chunk in chunks {
            framing.feed(chunk, |code| codes.push(code.to_string()));
        }
        codes
    }

    #[test]
    fn the_codes_of_errors_are_read_and_everything_else_is_skipped() {
        let bytes = stream();
        assert_eq!(codes_of(&[&bytes]), ["40P01", "25P02"], "many messages in one read");
    }

    #[test]
    fn messages_split_across_reads_are_followed_at_every_cut() {
        let bytes = stream();
        for cut in 0..=bytes.len() {
            let (a, b) = bytes.split_at(cut);
            assert_eq!(codes_of(&[a, b]), ["40P01", "25P02"], "cut at {cut}");
        }
        let bytes_one_by_one: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(codes_of(&bytes_one_by_one), ["40P01", "25P02"], "a byte per read");
        let sevens: Vec<&[u8]> = bytes.chunks(7).collect();
        assert_eq!(codes_of(&sevens), ["40P01", "25P02"]);
    }

    #[test]
    fn an_error_without_a_code_or_with_a_malformed_one_records_nothing() {
        let mut bytes = error(&[(b'S', "ERROR"), (b'M', "no code")]);
        bytes.extend(error(&[(b'C', "4001")]));
        bytes.extend(error(&[(b'C', "400011")]));
        bytes.extend(error(&[(b'M', "C"), (b'C', "57014")]));
        assert_eq!(codes_of(&[&bytes]), ["57014"]);
    }

    #[test]
    fn a_length_below_four_stops_the_reading() {
        let mut bytes = vec![b'E', 0, 0, 0, 3];
        bytes.extend(deadlock());
        assert!(codes_of(&[&bytes]).is_empty());
    }

    #[test]
    fn the_log_answers_what_arrived_since_a_mark_and_keeps_the_latest() {
        let log = WireLog::new();
        log.record(SqlState::new(b"23505"));
        let mark = log.mark();
        assert_eq!(log.since(mark).last(), None);
        log.record(SqlState::new(b"40P01"));
        log.record(SqlState::new(b"25P02"));
        let since: Vec<String> = log.since(mark).iter().map(|code| code.to_string()).collect();
        assert_eq!(since, ["40P01", "25P02"]);
        assert_eq!(log.since(mark).last(), Some(SqlState::new(b"25P02")));
        for _ in 0..2 * KEPT {
            log.record(SqlState::new(b"25P02"));
        }
        assert_eq!(log.since(mark).iter().count(), KEPT, "only the latest are kept");
        assert_eq!(log.since(log.mark()).iter().count(), 0);
    }

    #[tokio::test]
    async fn a_wire_records_what_it_reads_and_passes_every_byte_through() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut server, client) = tokio::io::duplex(64);
        let log = WireLog::new();
        let mut wire = Wire::new(client, Arc::clone(&log));
        let bytes = stream();
        let sent = bytes.clone();
        let writer = tokio::spawn(async move {
            server.write_all(&sent).await.unwrap();
            server
        });
        let mut read = vec![0; bytes.len()];
        wire.read_exact(&mut read).await.unwrap();
        drop(writer.await.unwrap());
        assert_eq!(read, bytes);
        let codes: Vec<String> = log.since(Mark(0)).iter().map(|code| code.to_string()).collect();
        assert_eq!(codes, ["40P01", "25P02"]);
    }
}
