//! `status [--nonzero]`: one line per queue — its ready messages and consumers, its
//! dead letters, the retries waiting in its wait queues — and below it a line for
//! what needs one: a wait queue holding retries, something missing or unreadable, a
//! stream's end and each of its handlers. Then the exchanges, the dedup rows, the
//! outbox backlog and the sagas: a line per saga name (how many run and the oldest's
//! age, how many finished are kept), or `sagas: none`. What cannot be read is
//! `unknown (why)`, never a number, and makes the command exit 1 after printing the
//! rest.
//!
//! A stream keeps what its consumers read, so its count of messages says nothing of
//! them (a stream read to its end still holds all of it). A stream's line shows
//! instead where it ends, and below it each handler consuming it: the offset it
//! applied up to (`idemq_stream_offsets`), its lag in messages, and the process that
//! owns it now (the PostgreSQL session holding its owner lock), with the processes
//! sharing a handler's partitions.

use idemq_core::__private::sibling;
use idemq_core::__private::sibling::QueueText as _;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use lapin::Connection;

use crate::common::{
    connect_broker, connect_db_limited, exchange_exists, passive_queue, say, CliResult, Out,
};
use crate::declare::name_width;
use idemq_core::__private::sibling::db;
use idemq_core::__private::sibling::human;
use idemq_core::RuntimeBuilder;

/// How long `status` lets each statement run before it prints "unknown" instead: a
/// count reads the whole table, which at a billion rows takes longer than an operator
/// should wait.
const COUNT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a read of a stream waits for its first delivery when the broker counts
/// messages in it, and when it counts none (its count is refreshed every few seconds
/// only, so a stream published to just now may still read 0).
const FIRST_DELIVERY: Duration = Duration::from_secs(5);
const FIRST_DELIVERY_OF_AN_EMPTY_STREAM: Duration = Duration::from_secs(1);

/// A figure: a value, or why it could not be read.
type Figure<T> = Result<T, String>;

/// One printed line, and whether it makes `--nonzero` keep its queue: a figure that
/// is not zero, or something missing, unreadable or amiss.
struct Line {
    text: String,
    notable: bool,
}

/// A queue's line and the lines below it.
struct Block {
    row: Line,
    details: Vec<Line>,
}

/// `status`: see the module docs. `app` is the binary's name, for the hints it
/// prints; `only_nonzero` keeps the queues with something to look at.
pub(super) async fn status(builder: &RuntimeBuilder, app: &str, only_nonzero: bool) -> CliResult {
    status_to(&mut Out::new(), &Inventory::of(builder), app, only_nonzero).await
}

/// What `status` (and the console, which outlives the builder) reads of the
/// application: its queues, exchanges, handlers and where its broker and database are.
pub(crate) struct Inventory {
    pub(crate) plans: Vec<sibling::QueuePlan>,
    pub(crate) exchanges: Vec<String>,
    /// Each consumed queue and its dead-letter queue.
    pub(crate) consumed: Vec<(String, String)>,
    /// Each handler, its queue, and its settings in words.
    pub(crate) handlers: Vec<(String, String, Vec<String>)>,
    pub(crate) amqp_url: String,
    pub(crate) database_url: String,
}

impl Inventory {
    pub(crate) fn of(builder: &RuntimeBuilder) -> Self {
        use sibling::BuilderPlan as _;
        Self {
            plans: builder.queue_plans(),
            exchanges: builder.exchange_names(),
            consumed: builder.consumed_queues(),
            handlers: builder.handler_settings(),
            amqp_url: builder.configured_amqp_url().to_owned(),
            database_url: builder.configured_database_url().to_owned(),
        }
    }
}

/// [`status`], its lines written to `out` (the console keeps them for a page).
pub(crate) async fn status_to(
    out: &mut Out,
    inventory: &Inventory,
    app: &str,
    only_nonzero: bool,
) -> CliResult {
    let plans = &inventory.plans;
    let width = name_width(plans.iter().flat_map(|plan| plan.names()));
    let mut report = Report { unknown: 0, dead_letters: 0, width, app };
    let mut db = Db::connect(&inventory.database_url).await;
    let header = format!(
        "{:<width$} {:>8} {:>11} {:>14} {:>10}",
        "queue", "ready", "consumers", "dead letters", "retrying"
    );
    let mut blocks = Vec::new();
    let mut exchanges = Vec::new();
    match connect_broker(&inventory.amqp_url).await {
        Ok(connection) => {
            // Each stream's end is read on a channel of its own, all at once: a read
            // lasts at least stream_end::BURST_GAP.
            let streams = futures_util::future::join_all(
                plans
                    .iter()
                    .filter(|plan| plan.queue.is_stream())
                    .map(|plan| read_stream(&connection, plan.queue.name())),
            )
            .await;
            let mut streams = streams.into_iter();
            let mut streams_per_handler = std::collections::HashMap::new();
            for plan in plans.iter().filter(|plan| plan.queue.is_stream()) {
                for handler in &plan.handlers {
                    *streams_per_handler.entry(handler.clone()).or_insert(0) += 1;
                }
            }
            for plan in plans {
                let stream = if plan.queue.is_stream() { streams.next() } else { None };
                let plan = Plan {
                    queue: &plan.queue,
                    declared_here: plan.declared_here,
                    waits: &plan.waits,
                    handlers: &plan.handlers,
                    streams_per_handler: &streams_per_handler,
                };
                blocks.push(report.block(&plan, &connection, stream, &mut db).await);
            }
            for exchange in inventory.exchanges.iter().cloned() {
                let exists = exchange_exists(&connection, &exchange).await.map_err(|err| err.report());
                exchanges.push((exchange, exists));
            }
            let _ = connection.close(200, "inspected".into()).await;
        }
        Err(err) => blocks.push(Block {
            row: Line { text: format!("queues: {}", report.unknown(err.report())), notable: true },
            details: Vec::new(),
        }),
    }

    let shown: Vec<&Block> = blocks
        .iter()
        .filter(|block| !only_nonzero || block.row.notable || block.details.iter().any(|l| l.notable))
        .collect();
    if !shown.is_empty() {
        say!(out, "{header}");
    }
    for block in &shown {
        say!(out, "{}", block.row.text.trim_end());
        // A queue kept is shown whole: a stream behind with its end, say.
        for line in &block.details {
            say!(out, "{}", line.text.trim_end());
        }
    }
    if only_nonzero && shown.is_empty() {
        say!(out,
            "all {} queues are fine: nothing ready, no dead letters, no retries waiting, no stream behind, none missing",
            plans.len()
        );
    }
    // The exchanges: on one line while they all exist, else each missing one named.
    let present: Vec<&str> =
        exchanges.iter().filter(|(_, exists)| exists == &Ok(true)).map(|(name, _)| name.as_str()).collect();
    if !present.is_empty() && !only_nonzero {
        say!(out, "exchanges: {} (exist)", present.join(", "));
    }
    for (exchange, exists) in exchanges {
        match exists {
            Ok(true) => {}
            Ok(false) => say!(
                out,
                "exchange {exchange} missing: publishing to it fails; `{app} declare --apply` (or `run`) declares it"
            ),
            Err(why) => say!(out, "exchange {exchange}: {}", report.unknown(why)),
        }
    }
    if report.dead_letters > 0 {
        say!(out, "dead letters: `{app} dlq list` shows them, `{app} dlq replay` sends them back");
    }
    let dedup = db.count("idemq_dedup").await;
    let outbox = db.count("idemq_outbox").await;
    say!(out, "dedup rows: {}", report.show(dedup));
    say!(out, "outbox backlog:        {}", report.show(outbox));
    match db.sagas().await {
        Ok(sagas) if sagas.is_empty() => say!(out, "sagas: none"),
        Ok(sagas) => {
            for saga in &sagas {
                say!(out, "{}", saga_line(saga));
            }
            say!(out, "sagas: `{app} saga show NAME KEY` shows one");
        }
        Err(why) => say!(out, "sagas: {}", report.unknown(why)),
    }
    match report.unknown {
        0 => Ok(()),
        n => Err(format!("{n} of the figures above could not be read (unknown)").into()),
    }
}

/// What `status` has found so far, for the lines still to print.
struct Report<'a> {
    /// Figures that could not be read.
    unknown: usize,
    /// Dead letters counted, for the hint at the end.
    dead_letters: u64,
    /// The width of the name column.
    width: usize,
    /// The binary's name, for the hints.
    app: &'a str,
}

impl Report<'_> {
    /// `why` as printed: `unknown (why)`, counted.
    fn unknown(&mut self, why: String) -> String {
        self.unknown += 1;
        format!("unknown ({why})")
    }

    fn show(&mut self, figure: Figure<i64>) -> String {
        match figure {
            Ok(n) => n.to_string(),
            Err(why) => self.unknown(why),
        }
    }

    /// The block of one queue (a stream's with `stream`, read before).
    async fn block(
        &mut self,
        plan: &Plan<'_>,
        connection: &Connection,
        stream: Option<StreamRead>,
        db: &mut Db,
    ) -> Block {
        let name = plan.queue.name();
        let width = self.width;
        let mut details = Vec::new();
        let mut notable = false;
        // What is missing, named on one line below the queue's.
        let mut missing = Vec::new();
        // The queue itself: a stream's was read with its end.
        let main = match stream.as_ref() {
            Some(read) => read.queue.clone(),
            None => passive_queue(connection, name)
                .await
                .map(|q| q.map(|q| (q.message_count(), q.consumer_count())))
                .map_err(|err| err.report()),
        };
        let (ready, consumers) = match main {
            // No count of ready messages (a stream keeps what is read), nor of
            // consumers: RabbitMQ 3.10's declare-ok counts none on a stream. Its
            // handlers' lines below say who consumes it.
            Ok(Some(_)) if plan.queue.is_stream() => ("stream".to_owned(), "-".to_owned()),
            Ok(Some((ready, consumers))) => {
                notable |= ready > 0;
                (ready.to_string(), consumers.to_string())
            }
            Ok(None) => {
                missing.push(name.to_owned());
                ("missing".to_owned(), "-".to_owned())
            }
            Err(why) => {
                details.push(Line { text: format!("  {name}: {}", self.unknown(why)), notable: true });
                ("unknown".to_owned(), "-".to_owned())
            }
        };
        // Its dead letters (a queue declared elsewhere may have none).
        let dlq = plan.queue.dead_letter_name();
        let dead = match passive_queue(connection, dlq).await {
            Ok(Some(q)) => {
                self.dead_letters += u64::from(q.message_count());
                notable |= q.message_count() > 0;
                q.message_count().to_string()
            }
            Ok(None) if !plan.declared_here => "-".to_owned(),
            Ok(None) => {
                missing.push(dlq.to_owned());
                "missing".to_owned()
            }
            Err(err) => {
                details
                    .push(Line { text: format!("  {dlq}: {}", self.unknown(err.report())), notable: true });
                "unknown".to_owned()
            }
        };
        // The retries waiting: their sum, and each wait queue holding some on a line.
        let mut retrying = Ok(0_u64);
        for (wait, delay) in plan.waits {
            let held = match passive_queue(connection, wait).await {
                Ok(Some(q)) => u64::from(q.message_count()),
                Ok(None) => {
                    missing.push(wait.clone());
                    retrying = retrying.and(Err("missing"));
                    continue;
                }
                Err(err) => {
                    details.push(Line {
                        text: format!("  {wait}: {}", self.unknown(err.report())),
                        notable: true,
                    });
                    retrying = Err("unknown");
                    continue;
                }
            };
            if held > 0 {
                let what = format!("retries of {name} after {}", human(*delay));
                let w = width.saturating_sub(2);
                details.push(Line { text: format!("  {wait:<w$} {held:>8}  {what}"), notable: true });
            }
            retrying = retrying.map(|sum| sum + held);
        }
        let retrying = match retrying {
            _ if plan.waits.is_empty() => "-".to_owned(),
            Ok(n) => {
                notable |= n > 0;
                n.to_string()
            }
            Err(state) => state.to_owned(),
        };
        if !missing.is_empty() {
            let (names, fix) = match (plan.declared_here, missing.len()) {
                (false, _) if missing[0] == name => {
                    (missing.join(", "), "it is declared elsewhere: idemq never declares it".to_owned())
                }
                (_, 1) => {
                    (missing.join(", "), format!("`{} declare --apply` (or `run`) declares it", self.app))
                }
                (_, n) if n == plan.waits.len() + 2 => (
                    match plan.waits.len() {
                        0 => format!("{name} and its dead-letter queue"),
                        waits => format!("{name}, its dead-letter queue and its {waits} retry wait queues"),
                    },
                    format!("`{} declare --apply` (or `run`) declares them", self.app),
                ),
                _ => (missing.join(", "), format!("`{} declare --apply` (or `run`) declares them", self.app)),
            };
            details.insert(0, Line { text: format!("  missing: {names}: {fix}"), notable: true });
        }
        notable |= !details.is_empty();
        if let Some(read) = stream {
            self.stream_lines(plan, read, db, &mut details).await;
        }
        let text =
            format!("{name:<width$} {ready:>8} {consumers:>11} {dead:>14} {retrying:>10}  {}", plan.note());
        Block { row: Line { text, notable }, details }
    }

    /// A stream's end, and a line per handler consuming it: the offset it applied up
    /// to, its lag, who owns it.
    async fn stream_lines(
        &mut self,
        plan: &Plan<'_>,
        read: StreamRead,
        db: &mut Db,
        details: &mut Vec<Line>,
    ) {
        let name = plan.queue.name();
        let ends = match read.ends {
            None => return,
            Some(Ok(ends)) => ends,
            Some(Err(why)) => {
                details.push(Line { text: format!("  end: {}", self.unknown(why)), notable: true });
                return;
            }
        };
        details.push(Line {
            text: match ends {
                Ends::Empty(waited) => format!(
                    "  end: none, the stream is empty (nothing delivered from it within {})",
                    human(waited)
                ),
                Ends::Kept { first, last } => {
                    format!(
                        "  end: offset {last}; offsets {first}–{last} kept ({} messages)",
                        last - first + 1
                    )
                }
            },
            notable: false,
        });
        let rows = match db.stored_offsets(name).await {
            Ok(rows) => rows,
            Err(why) => {
                let why = self.unknown(why);
                for handler in plan.handlers {
                    details.push(Line { text: format!("  {handler}: stored offset {why}"), notable: true });
                }
                return;
            }
        };
        for handler in plan.handlers {
            // Its rows: by its name, or under a namespace (`<namespace>/<name>`),
            // whichever the processes consuming it were given.
            let mine: Vec<&db::StoredOffset> = rows
                .iter()
                .filter(|row| row.handler == *handler || row.handler.ends_with(&format!("/{handler}")))
                .collect();
            if mine.is_empty() {
                let lag = Lag::of(db::NO_OFFSET, ends);
                details.push(Line {
                    text: format!(
                        "  {handler}: no offset stored: it has not consumed this stream yet; lag {}",
                        lag.words()
                    ),
                    notable: lag.notable(),
                });
                continue;
            }
            for row in mine {
                let lag = Lag::of(row.last_offset, ends);
                let applied = match row.last_offset {
                    db::NO_OFFSET => "nothing applied yet".to_owned(),
                    offset => format!("applied up to offset {offset}"),
                };
                let moved = match lag {
                    Lag::Behind { by, .. } if by > 0 => format!(" (its offset last moved {})", row.updated),
                    _ => String::new(),
                };
                let unknown_before = self.unknown;
                let owner = match db.owner(&row.handler, name).await {
                    Ok(Some(holder)) => format!("owned by {}", session(&holder)),
                    Ok(None) => {
                        "owned by no process now (none runs it, or each waits for the broker)".to_owned()
                    }
                    Err(why) => format!("owner {}", self.unknown(why)),
                };
                let shared = match plan.partitions_of(handler) {
                    1 => String::new(),
                    streams => match db.sharing(&row.handler).await {
                        Ok(1) => format!("; 1 process shares its {streams} streams"),
                        Ok(processes) => format!("; {processes} processes share its {streams} streams"),
                        Err(why) => {
                            format!("; the processes sharing its {streams} streams: {}", self.unknown(why))
                        }
                    },
                };
                details.push(Line {
                    text: format!(
                        "  {}: {applied}, lag {}{moved}; {owner}{shared}",
                        row.handler,
                        lag.words()
                    ),
                    notable: lag.notable() || self.unknown > unknown_before,
                });
            }
        }
    }
}

/// A saga name's line: how many run and for how long the oldest has, how many
/// finished are kept.
fn saga_line(saga: &db::SagaCount) -> String {
    let running = match (saga.running, saga.oldest_seconds) {
        (0, _) => "none running".to_owned(),
        (n, Some(seconds)) => {
            format!(
                "{n} running, the oldest for {}",
                human(Duration::from_secs(u64::try_from(seconds).unwrap_or(0)))
            )
        }
        (n, None) => format!("{n} running"),
    };
    format!("saga {}: {running}; {} finished (kept)", saga.saga, saga.finished)
}

/// A held lock's session in words.
fn session(holder: &db::LockHolder) -> String {
    let mut words = format!("the PostgreSQL session of pid {}", holder.pid);
    if let Some(application) = &holder.application {
        words.push_str(&format!(" ({application})"));
    }
    if let Some(client) = &holder.client {
        words.push_str(&format!(" from {client}"));
    }
    if let Some(since) = &holder.since {
        words.push_str(&format!(", connected since {since}"));
    }
    words
}

/// What `status` shows of a queue: a view of the builder's plan of it.
struct Plan<'a> {
    queue: &'a idemq_core::Queue,
    declared_here: bool,
    waits: &'a [(String, Duration)],
    handlers: &'a [String],
    /// How many streams each handler consumes, by name (partitions share them).
    streams_per_handler: &'a std::collections::HashMap<String, usize>,
}

impl Plan<'_> {
    /// The words after a queue's figures: what it is, who consumes it.
    fn note(&self) -> String {
        let mut note = match (self.handlers, self.declared_here) {
            ([], true) => "declared; no handler here consumes it".to_owned(),
            ([], false) => "declared elsewhere; no handler here consumes it".to_owned(),
            (handlers, _) => format!("consumed by {}", handlers.join(", ")),
        };
        if self.queue.is_stream() {
            note = format!("a stream, {note}");
        }
        if !self.waits.is_empty() {
            let delays: Vec<String> = self.waits.iter().map(|(_, delay)| human(*delay).to_string()).collect();
            note.push_str(&format!("; retries wait {}", delays.join(", ")));
        }
        let dlq = self.queue.dead_letter_name();
        if dlq != format!("{}.dlq", self.queue.name()) {
            note.push_str(&format!("; dead letters in {dlq}"));
        }
        note
    }

    /// How many streams `handler` consumes.
    fn partitions_of(&self, handler: &str) -> usize {
        self.streams_per_handler.get(handler).copied().unwrap_or(1)
    }
}

/// How far a handler is behind a stream's end.
#[derive(Clone, Copy)]
enum Lag {
    /// `by` messages to apply; `lost` more were removed by the stream's retention
    /// before it applied them.
    Behind { by: i64, lost: i64 },
    /// The stored offset is past the stream's end: the stream was deleted and
    /// declared again (offsets start at 0 again), and the handler skips what comes
    /// up to its offset.
    PastTheEnd { stored: i64 },
}

impl Lag {
    /// The lag of a handler whose stored offset is `stored` ([`db::NO_OFFSET`]:
    /// none) on a stream whose kept messages are `ends`.
    fn of(stored: i64, ends: Ends) -> Lag {
        match ends {
            Ends::Empty(_) if stored == db::NO_OFFSET => Lag::Behind { by: 0, lost: 0 },
            Ends::Empty(_) => Lag::PastTheEnd { stored },
            Ends::Kept { last, .. } if stored > last => Lag::PastTheEnd { stored },
            Ends::Kept { first, last } => {
                // A consumer starts at the first offset kept: what retention removed
                // before it was applied is not behind, it is gone.
                let from = stored.max(first - 1);
                let lost = if stored == db::NO_OFFSET { 0 } else { from - stored };
                Lag::Behind { by: last - from, lost }
            }
        }
    }

    fn notable(self) -> bool {
        !matches!(self, Lag::Behind { by: 0, lost: 0 })
    }

    fn words(self) -> String {
        match self {
            Lag::Behind { by, lost: 0 } => by.to_string(),
            Lag::Behind { by, lost } => {
                format!("{by} ({lost} more were removed by the stream's retention before it applied them)")
            }
            Lag::PastTheEnd { stored } => format!(
                "unknown: its offset {stored} is past the stream's end — was the stream deleted and declared again? \
                 it skips what is published up to offset {stored}"
            ),
        }
    }
}

/// Where a stream's kept messages begin and end.
#[derive(Clone, Copy)]
enum Ends {
    /// Nothing was delivered from it within this wait.
    Empty(Duration),
    /// Its first and last offsets.
    Kept { first: i64, last: i64 },
}

/// A stream as the broker shows it: its passive declare (messages, consumers; `None`
/// if missing) and, if it exists, where it begins and ends.
struct StreamRead {
    queue: Figure<Option<(u32, u32)>>,
    ends: Option<Figure<Ends>>,
}

async fn read_stream(connection: &Connection, stream: &str) -> StreamRead {
    let queue = passive_queue(connection, stream)
        .await
        .map(|q| q.map(|q| (q.message_count(), q.consumer_count())))
        .map_err(|err| err.report());
    let ends = match &queue {
        Ok(Some((kept, _))) => Some(stream_ends(connection, stream, *kept).await),
        _ => None,
    };
    StreamRead { queue, ends }
}

/// The consumer tag of `status`'s reads of a stream.
const STATUS_CONSUMER: &str = "idemq-status";

/// Where `stream`'s kept messages begin and end, read over AMQP 0-9-1 (RabbitMQ 3.9
/// and on): the offsets the broker sets on what it delivers (`x-stream-offset`).
///
/// - The first: the offset of the first delivery of a consumer started at `first`.
///   Exact.
/// - The last: a consumer started at `last` is sent the whole last chunk of the
///   stream (and what is committed after it), from the chunk's first message, in one
///   burst — the broker reads every committed entry its credit allows as soon as
///   the consumer attaches, and the credit here is renewed as deliveries come. So
///   the greatest offset delivered before the deliveries pause for a moment is
///   the stream's last, exact as of the read (a stream still written to ends later
///   a moment after; a read lasts a few seconds at most).
///
/// Not the `messages` of a passive declare, which for a stream is its kept messages
/// as of the broker's last statistics tick (every 5 s by default: 0 for a stream
/// published to just now), and counts nothing of where its offsets are. Only used
/// here to tell how long to wait for a first delivery (`kept`).
async fn stream_ends(connection: &Connection, stream: &str, kept: u32) -> Figure<Ends> {
    let wait = if kept > 0 { FIRST_DELIVERY } else { FIRST_DELIVERY_OF_AN_EMPTY_STREAM };
    let Some(first) =
        sibling::stream_end::read_offset(connection, stream, "first", wait, false, STATUS_CONSUMER).await?
    else {
        return Ok(Ends::Empty(wait));
    };
    match sibling::stream_end::read_offset(connection, stream, "last", FIRST_DELIVERY, true, STATUS_CONSUMER)
        .await?
    {
        Some(last) => Ok(Ends::Kept { first, last: last.max(first) }),
        None => Err(format!(
            "the broker delivered nothing from the end of '{stream}' within {}",
            human(FIRST_DELIVERY)
        )),
    }
}

/// The CLI's database connection, each statement cut after [`COUNT_TIMEOUT`]; or why
/// there is none.
struct Db(Figure<AsyncPgConnection>);

impl Db {
    async fn connect(url: &str) -> Self {
        Db(connect_db_limited(url, COUNT_TIMEOUT).await)
    }

    fn conn(&mut self) -> Figure<&mut AsyncPgConnection> {
        self.0.as_mut().map_err(|why| why.clone())
    }

    /// The exact number of rows of idemq's `table`.
    async fn count(&mut self, table: &'static str) -> Figure<i64> {
        match db::count_rows(self.conn()?, table).await {
            Ok(Some(rows)) => Ok(rows),
            Ok(None) => Err(format!("{table} is not there: run `migrate`")),
            Err(err) => Err(format!(
                "counting {table} failed within a {} statement_timeout: {err}",
                human(COUNT_TIMEOUT)
            )),
        }
    }

    /// The sagas by name (`idemq_saga`, counted whole like the tables above).
    async fn sagas(&mut self) -> Figure<Vec<db::SagaCount>> {
        let conn = self.conn()?;
        match db::count_sagas(conn).await {
            Ok(sagas) => Ok(sagas),
            Err(_) if crate::saga::table_missing(conn).await => Err(crate::saga::NOT_MIGRATED.to_owned()),
            Err(err) => Err(format!(
                "counting idemq_saga failed within a {} statement_timeout: {err}",
                human(COUNT_TIMEOUT)
            )),
        }
    }

    async fn stored_offsets(&mut self, stream: &str) -> Figure<Vec<db::StoredOffset>> {
        match db::stored_offsets(self.conn()?, stream).await {
            Ok(Some(rows)) => Ok(rows),
            Ok(None) => Err("idemq_stream_offsets is not there: run `migrate`".to_owned()),
            Err(err) => Err(format!("reading idemq_stream_offsets failed: {err}")),
        }
    }

    /// The session holding the owner lock of `stream` for the handler `scope`.
    async fn owner(&mut self, scope: &str, stream: &str) -> Figure<Option<db::LockHolder>> {
        db::lock_holder(self.conn()?, db::owner_lock(scope, stream))
            .await
            .map_err(|err| format!("reading pg_locks failed: {err}"))
    }

    /// How many processes share the streams of the handler `scope`.
    async fn sharing(&mut self, scope: &str) -> Figure<i64> {
        db::count_members(self.conn()?, db::share_group(scope))
            .await
            .map_err(|err| format!("reading pg_locks failed: {err}"))
    }
}

#[cfg(test)]
mod tests {
    use super::{Ends, Lag};
    use std::time::Duration;

    fn lag(stored: i64, ends: Ends) -> (Option<(i64, i64)>, bool) {
        match Lag::of(stored, ends) {
            Lag::Behind { by, lost } => (Some((by, lost)), Lag::of(stored, ends).notable()),
            Lag::PastTheEnd { .. } => (None, true),
        }
    }

    /// The lag counts the messages a handler has still to apply: from its stored
    /// offset, or from the first kept when retention removed what came before (those
    /// are said to be gone, not behind); an offset past the end is no lag at all.
    #[test]
    fn the_lag_counts_what_is_kept_after_the_stored_offset() {
        let kept = Ends::Kept { first: 0, last: 59 };
        assert_eq!(lag(59, kept), (Some((0, 0)), false), "read to its end");
        assert_eq!(lag(-1, kept), (Some((60, 0)), true), "never consumed: all of it");
        assert_eq!(lag(54, kept), (Some((5, 0)), true));
        let truncated = Ends::Kept { first: 20, last: 59 };
        assert_eq!(lag(9, truncated), (Some((40, 10)), true), "offsets 10-19 removed before it applied them");
        assert_eq!(lag(-1, truncated), (Some((40, 0)), true), "a new handler starts at the first kept");
        assert_eq!(lag(60, kept), (None, true), "the stream was declared again");
        let empty = Ends::Empty(Duration::from_secs(1));
        assert_eq!(lag(-1, empty), (Some((0, 0)), false));
        assert_eq!(lag(3, empty), (None, true));
    }
}
