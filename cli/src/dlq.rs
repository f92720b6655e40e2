//! `dlq list | show | replay | purge`: dead letters, browsed without damage.
//!
//! Browsing takes the dead letters with manual acks on a channel of its own and
//! closes it, which returns every one it did not ack to the queue, in order. On a
//! quorum queue each such return counts a delivery (`x-delivery-count`), on RabbitMQ
//! 3.x and 4.x alike: idemq declares quorum dead-letter queues with an
//! `x-delivery-limit` no browsing reaches (RabbitMQ 4.0 would otherwise give them a
//! limit of 20, and drop a letter at it). A DLQ declared by an earlier idemq has none:
//! on RabbitMQ 4, lift its default with a policy before browsing it often (`run` warns
//! of it). A browse holds the dead letters unacked for at most [`BROWSE_FOR`], with a
//! per-consumer prefetch (`basic.qos` with `global = false`: RabbitMQ 4.3 refuses
//! global QoS).
//!
//! Replay publishes each chosen dead letter to its queue (default exchange,
//! persistent, `mandatory`, confirmed) without `x-delivery-count`, `x-death`,
//! `x-idemq-attempts` and `x-idemq-retry-of` — so it starts again at attempt 1 — and
//! only then acks it in the DLQ. Each replay adds one to `x-idemq-replay`: a new
//! lineage generation (a copy of the letter's first life can never settle it), and a
//! letter replayed `--max-replays` times (default 5) is left in the DLQ with a line
//! saying so instead of going round for ever. Each letter goes back to the queue it
//! was consumed from (`x-idemq-queue`; two queues may share a DLQ).
//!
//! Only true copies of one message are grouped — the same lineage, `message_id`,
//! body and publisher headers (see [`same_message`]): listed once with their count,
//! replayed once, the other copies removed. `replay` and `purge` take `--dry-run`;
//! `purge` asks on the terminal unless given `--yes`, and refuses without one.

use idemq_core::__private::sibling;
use idemq_core::__private::sibling::BuilderPlan as _;
use std::time::{Duration, Instant};

use clap::ArgMatches;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Confirmation, Connection};

use crate::common::{connect_broker, say, CliResult, Out};
use idemq_core::__private::sibling::identity;
use idemq_core::headers;
use idemq_core::RuntimeBuilder;

/// The longest a browse holds dead letters unacked.
const BROWSE_FOR: Duration = Duration::from_secs(30);

/// The most dead letters one command looks at.
const MAX_BROWSE: u16 = 10_000;

pub(crate) async fn run(builder: &RuntimeBuilder, matches: &ArgMatches) -> CliResult {
    let (action, sub) = matches.subcommand().ok_or("dlq needs list, show, replay or purge")?;
    let only = matches.get_one::<String>("queue");
    let consumed = builder.consumed_queues();
    let queues: Vec<&(String, String)> =
        consumed.iter().filter(|(queue, _)| only.is_none_or(|only| only == queue)).collect();
    if queues.is_empty() {
        return Err(match only {
            Some(queue) => format!("--queue {queue}: the code declares or consumes no such queue").into(),
            None => "the code declares and consumes no queue".into(),
        });
    }
    let mut dlqs = dead_letter_queues(&consumed);
    dlqs.retain(|(dlq, _)| queues.iter().any(|(_, wanted)| wanted == dlq));
    let connection = connect_broker(builder.configured_amqp_url()).await?;
    let filter = Filter::of(sub, only.cloned());
    let options = Options::of(sub);
    let mut index = 0;
    let mut out = Out::new();
    if matches!(action, "list" | "show") {
        // Reading only: every DLQ browsed at once, printed in order.
        let taken = futures_util::future::join_all(
            dlqs.iter().map(|(dlq, owners)| Browse::take(&connection, dlq, owners)),
        )
        .await;
        let mut failed = None;
        let mut browses = Vec::new();
        for browse in taken {
            match browse {
                Ok(browse) if failed.is_none() => {
                    if action == "list" {
                        list(&mut out, &browse, &filter, &mut index);
                    } else {
                        show(
                            &mut out,
                            &browse,
                            *sub.get_one::<usize>("index").expect("required"),
                            &mut index,
                        );
                    }
                    browses.push(browse);
                }
                Ok(browse) => browses.push(browse),
                Err(err) => {
                    failed.get_or_insert(err);
                }
            }
        }
        futures_util::future::join_all(browses.into_iter().map(|browse| browse.end(&connection))).await;
        if let Some(err) = failed {
            return Err(err);
        }
    }
    for (dlq, owners) in dlqs.iter().filter(|_| matches!(action, "replay" | "purge")) {
        let browse = Browse::take(&connection, dlq, owners).await?;
        let result = match action {
            "replay" => replay(&mut out, &connection, &browse, &filter, &options).await,
            _ => purge(&mut out, &browse, &filter, &options).await,
        };
        browse.end(&connection).await;
        result?;
    }
    if !matches!(action, "list" | "show" | "replay" | "purge") {
        return Err(format!("unknown dlq command `{action}`").into());
    }
    if action == "list" && index == 0 {
        say!(out, "no dead letters{}", if filter.is_empty() { "" } else { " match" });
    }
    Ok(())
}

/// Each dead-letter queue once, with the queues that dead-letter into it (from each
/// consumed queue and its DLQ): two queues may share one, and each letter goes back
/// to its own.
pub(crate) fn dead_letter_queues(consumed: &[(String, String)]) -> Vec<(String, Vec<String>)> {
    let mut dlqs: Vec<(String, Vec<String>)> = Vec::new();
    for (queue, dlq) in consumed {
        match dlqs.iter_mut().find(|(name, _)| name == dlq) {
            Some((_, owners)) => owners.push(queue.clone()),
            None => dlqs.push((dlq.clone(), vec![queue.clone()])),
        }
    }
    dlqs
}

/// How `replay` and `purge` act.
pub(crate) struct Options {
    pub(crate) dry_run: bool,
    pub(crate) yes: bool,
    pub(crate) max_replays: u32,
}

impl Options {
    fn of(matches: &ArgMatches) -> Self {
        let flag = |id: &str| matches.try_get_one::<bool>(id).ok().flatten().copied().unwrap_or(false);
        Self {
            dry_run: flag("dry-run"),
            yes: flag("yes"),
            max_replays: matches
                .try_get_one::<u32>("max-replays")
                .ok()
                .flatten()
                .copied()
                .unwrap_or(DEFAULT_MAX_REPLAYS),
        }
    }
}

/// How often `dlq replay` sends one message back before leaving it in the DLQ (the
/// `--max-replays` default in `cli.rs` says the same).
pub(crate) const DEFAULT_MAX_REPLAYS: u32 = 5;

/// The dead letters of one DLQ, taken unacked on a channel of their own.
pub(crate) struct Browse {
    channel: Channel,
    pub(crate) dlq: String,
    pub(crate) letters: Vec<Letter>,
    /// The DLQ's ready messages when the browse began.
    ready: u32,
    /// Dead letters acked since (replayed or purged).
    removed: std::sync::atomic::AtomicU32,
}

/// One message's dead letters: the first, and the tags of its true copies.
pub(crate) struct Letter {
    pub(crate) delivery: Delivery,
    pub(crate) copies: Vec<u64>,
    /// The queue it was consumed from, where a replay sends it: its
    /// `x-idemq-queue` if that is one of the queues this DLQ serves, else the only
    /// such queue; `None` when neither tells.
    pub(crate) queue: Option<String>,
}

impl Browse {
    pub(crate) async fn take(
        connection: &Connection,
        dlq: &str,
        owners: &[String],
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let channel = connection.create_channel().await?;
        let ready = || async {
            ready_count(&channel, dlq).await.map_err(|_| {
                format!("dead-letter queue '{dlq}' does not exist (`declare --apply` creates it)")
            })
        };
        // The count is of ready messages only. Dead letters a previous browse (or
        // replay) held come back a moment after its channel closed — on a quorum
        // queue after its close was answered — so `dlq list` twice in a row once
        // said "no dead letters" (a fresh-clone CI run). A browse therefore ends
        // only once the broker counts what it held as ready again ([`Browse::end`]);
        // here, readings 50 ms apart until two agree (an empty queue: for 200 ms).
        let mut count = ready().await?;
        let settle_by = Instant::now() + Duration::from_millis(200);
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let again = ready().await?;
            let stable = again == count;
            count = again;
            if (stable && count > 0) || Instant::now() >= settle_by {
                break;
            }
        }
        let want = u16::try_from(count).unwrap_or(MAX_BROWSE).min(MAX_BROWSE);
        let mut letters: Vec<Letter> = Vec::new();
        if want > 0 {
            channel.basic_qos(want, BasicQosOptions { global: false }).await?;
            let mut consumer = channel
                .basic_consume(
                    dlq.into(),
                    "idemq-dlq-browse".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            let until = Instant::now() + BROWSE_FOR;
            let mut seen = 0;
            while seen < usize::from(want) && Instant::now() < until {
                let Ok(Some(delivery)) = tokio::time::timeout(Duration::from_secs(2), consumer.next()).await
                else {
                    break;
                };
                let delivery = delivery?;
                seen += 1;
                match letters.iter_mut().find(|letter| same_message(&letter.delivery, &delivery)) {
                    Some(letter) => letter.copies.push(delivery.delivery_tag),
                    None => {
                        let queue = home_queue(&delivery, owners);
                        letters.push(Letter { delivery, copies: Vec::new(), queue });
                    }
                }
            }
        }
        Ok(Self { channel, dlq: dlq.to_owned(), letters, ready: count, removed: Default::default() })
    }

    /// Closes the channel: what was not acked goes back to the queue. Returns once
    /// the broker counts it as ready again (at most 2 s), so that the next command
    /// sees every dead letter at once.
    pub(crate) async fn end(self, connection: &Connection) {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.channel.close(200, "browsed".into())).await;
        let back = self.ready.saturating_sub(self.removed.load(std::sync::atomic::Ordering::Relaxed));
        if self.letters.is_empty() || back == 0 {
            return;
        }
        let Ok(channel) = connection.create_channel().await else { return };
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            match ready_count(&channel, &self.dlq).await {
                Ok(ready) if ready < back => tokio::time::sleep(Duration::from_millis(20)).await,
                _ => break,
            }
        }
        let _ = channel.close(200, "browsed".into()).await;
    }

    /// Acks a letter and its copies: they leave the DLQ.
    async fn remove(&self, letter: &Letter) -> Result<(), lapin::Error> {
        for tag in std::iter::once(letter.delivery.delivery_tag).chain(letter.copies.iter().copied()) {
            self.channel.basic_ack(tag, BasicAckOptions::default()).await?;
            self.removed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }
}

/// The messages ready in `dlq` (a passive declare: an error if it does not exist).
async fn ready_count(channel: &Channel, dlq: &str) -> Result<u32, lapin::Error> {
    let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    Ok(channel.queue_declare(dlq.into(), passive, FieldTable::default()).await?.message_count())
}

/// The queue `delivery` was consumed from, among the queues `owners` of its DLQ.
fn home_queue(delivery: &Delivery, owners: &[String]) -> Option<String> {
    match header(delivery, headers::QUEUE) {
        Some(queue) if owners.contains(&queue) => Some(queue),
        Some(_) => None,
        None if owners.len() == 1 => Some(owners[0].clone()),
        None => None,
    }
}

/// Whether two dead letters are copies of one message: the same lineage (copy id
/// before its `:attempt`), and — checked again, since lineages of idemq's first
/// releases hashed only handler and body — the same `message_id`, body, queue,
/// replay generation and headers of the publisher's. Anything else is two messages,
/// each listed, replayed and purged on its own: keeping true copies apart costs a
/// duplicate at most (its dedup row settles it), merging two messages loses one.
fn same_message(a: &Delivery, b: &Delivery) -> bool {
    let lineage = |d: &Delivery| header(d, headers::COPY_ID).map(|id| identity::lineage_of(&id).to_owned());
    let id = |d: &Delivery| d.properties.message_id().clone();
    lineage(a).is_some()
        && lineage(a) == lineage(b)
        && id(a) == id(b)
        && a.data == b.data
        && header(a, headers::QUEUE) == header(b, headers::QUEUE)
        && header(a, headers::REPLAY) == header(b, headers::REPLAY)
        && publisher_headers(a) == publisher_headers(b)
}

/// The headers the publisher set: without idemq's and the broker's (`x-death`,
/// `x-first-death-*`, `x-last-death-*`, `x-delivery-count`), which differ between
/// copies of one message.
fn publisher_headers(delivery: &Delivery) -> Vec<(String, String)> {
    let broker = |name: &str| {
        name.starts_with("x-idemq-")
            || name == "x-death"
            || name == headers::DELIVERY_COUNT
            || name.starts_with("x-first-death-")
            || name.starts_with("x-last-death-")
    };
    let mut own: Vec<(String, String)> = delivery
        .properties
        .headers()
        .iter()
        .flat_map(|table| table.inner().iter())
        .filter(|(name, _)| !broker(name.as_str()))
        .map(|(name, value)| (name.to_string(), format!("{value:?}")))
        .collect();
    own.sort();
    own
}

/// Which dead letters a command applies to.
pub(crate) struct Filter {
    kind: Option<String>,
    handler: Option<String>,
    queue: Option<String>,
    limit: Option<usize>,
    /// One message only, by its [`letter_key`] (the console's replay of a letter).
    message_id: Option<String>,
    /// `kind` and `handler` as given, `None` meaning the header is absent (the
    /// console's groups, which include the broker's dead letters without them).
    exact: bool,
}

impl Filter {
    fn of(matches: &ArgMatches, queue: Option<String>) -> Self {
        let get = |id: &str| matches.try_get_one::<String>(id).ok().flatten().cloned();
        Self {
            kind: get("kind"),
            handler: get("handler"),
            queue,
            limit: matches.try_get_one::<usize>("limit").ok().flatten().copied(),
            message_id: None,
            exact: false,
        }
    }

    /// The letters of one group: this error kind and handler exactly (`None`: the
    /// header is absent), and of one message if `message_id` is given.
    pub(crate) fn group(kind: Option<String>, handler: Option<String>, message_id: Option<String>) -> Self {
        Self { kind, handler, queue: None, limit: None, message_id, exact: true }
    }

    fn is_empty(&self) -> bool {
        self.kind.is_none() && self.handler.is_none()
    }

    fn matches(&self, letter: &Letter) -> bool {
        let delivery = &letter.delivery;
        if self.exact {
            return header(delivery, headers::ERROR_KIND) == self.kind
                && header(delivery, headers::HANDLER) == self.handler
                && self
                    .message_id
                    .as_ref()
                    .is_none_or(|wanted| letter_key(delivery).as_ref() == Some(wanted));
        }
        self.kind.as_ref().is_none_or(|kind| header(delivery, headers::ERROR_KIND).as_deref() == Some(kind))
            && self.handler.as_ref().is_none_or(|h| header(delivery, headers::HANDLER).as_deref() == Some(h))
            && self.queue.as_ref().is_none_or(|queue| letter.queue.as_ref() == Some(queue))
    }

    fn chosen<'a>(&self, letters: &'a [Letter]) -> Vec<&'a Letter> {
        let matching = letters.iter().filter(|letter| self.matches(letter));
        matching.take(self.limit.unwrap_or(usize::MAX)).collect()
    }
}

/// A header of `delivery` for display: text, or the value as the client shows it.
pub(crate) fn header(delivery: &Delivery, name: &str) -> Option<String> {
    let value = sibling::header(&delivery.properties, name)?;
    Some(sibling::text(value).unwrap_or_else(|| format!("{value:?}")))
}

/// How often the letter was replayed (`x-idemq-replay`).
/// What names one message among the dead letters (the console's single-letter
/// actions): its lineage (`x-idemq-copy-id` without the copy number), which idemq
/// writes on every delivery it settles, else its `message_id`.
pub(crate) fn letter_key(delivery: &Delivery) -> Option<String> {
    header(delivery, headers::COPY_ID)
        .map(|id| identity::lineage_of(&id).to_owned())
        .or_else(|| delivery.properties.message_id().as_ref().map(ToString::to_string))
}

/// A header's value as `show` and the console print it: a value whose name
/// says it is a credential (`authorization`, `*token*`, `*secret*`, `*password*`,
/// `*api-key*`, `cookie`) is hidden, and a URL's password redacted.
pub(crate) fn shown_header(name: &str, value: &str) -> String {
    let name = name.to_ascii_lowercase();
    let secret = ["authorization", "token", "secret", "password", "passwd", "api-key", "apikey", "cookie"];
    if secret.iter().any(|word| name.contains(word)) {
        return "‹hidden: a credential›".to_owned();
    }
    if value.contains("://") {
        return idemq_core::connect::redact(value);
    }
    value.to_owned()
}

pub(crate) fn replays(delivery: &Delivery) -> u32 {
    header(delivery, headers::REPLAY).and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// How often the letter was dead-lettered and replayed, and after how many
/// attempts, from idemq's headers (`x-idemq-replay`: each replay came out of the
/// DLQ, and the letter is back) — or, for a letter the broker dead-lettered (no
/// `x-idemq-error-kind`), its latest `x-death` entry.
pub(crate) fn history(delivery: &Delivery) -> String {
    let times = |n: u64| if n == 1 { "1 time".to_owned() } else { format!("{n} times") };
    if header(delivery, headers::ERROR_KIND).is_none() {
        if let Some((reason, queue, count)) = latest_death(delivery) {
            return format!("by the broker ({reason} in {queue}, {}: x-death)", times(count));
        }
    }
    let replayed = replays(delivery);
    let mut words = match replayed {
        0 => "1 time, never replayed".to_owned(),
        n => format!("{}, replayed {} ({})", times(u64::from(n) + 1), times(u64::from(n)), headers::REPLAY),
    };
    if let Some(attempts) = header(delivery, headers::ATTEMPTS) {
        let noun = if attempts == "1" { "attempt" } else { "attempts" };
        let life = if replayed == 0 { "" } else { " in its last life" };
        words.push_str(&format!("; after {attempts} {noun}{life} ({})", headers::ATTEMPTS));
    }
    words
}

/// The broker's latest `x-death` entry: reason, queue, count.
fn latest_death(delivery: &Delivery) -> Option<(String, String, u64)> {
    let deaths = delivery.properties.headers().as_ref()?.inner().get("x-death")?;
    let AMQPValue::FieldArray(deaths) = deaths else { return None };
    // The broker keeps the most recent death first.
    let AMQPValue::FieldTable(latest) = deaths.as_slice().first()? else { return None };
    let field = |name: &str| latest.inner().get(name).and_then(sibling::text);
    let count = field("count").and_then(|count| count.parse().ok()).unwrap_or(1);
    Some((field("reason")?, field("queue").unwrap_or_else(|| "?".to_owned()), count))
}

/// The routing key the broker's first `x-death` entry names: the one the message
/// had when the broker first dead-lettered it.
fn first_death_routing_key(delivery: &Delivery) -> Option<String> {
    let deaths = delivery.properties.headers().as_ref()?.inner().get("x-death")?;
    let AMQPValue::FieldArray(deaths) = deaths else { return None };
    // The broker keeps the most recent death first.
    let AMQPValue::FieldTable(first) = deaths.as_slice().last()? else { return None };
    let AMQPValue::FieldArray(keys) = first.inner().get("routing-keys")? else { return None };
    keys.as_slice().first().and_then(sibling::string)
}

pub(crate) fn preview(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let flat: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if flat.chars().count() > max {
        format!("{}…", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

fn list(out: &mut Out, browse: &Browse, filter: &Filter, index: &mut usize) {
    for letter in filter.chosen(&browse.letters) {
        *index += 1;
        let d = &letter.delivery;
        let field = |name| header(d, name).unwrap_or_else(|| "-".to_owned());
        let copies = if letter.copies.is_empty() {
            String::new()
        } else {
            format!(" (+{} copies)", letter.copies.len())
        };
        let replayed = match replays(d) {
            0 => String::new(),
            n => format!(" replayed={n}"),
        };
        say!(out,
            "#{index} {} queue={} handler={} attempts={}{replayed} at={}{copies}\n    error: {}\n    body:  {}",
            field(headers::ERROR_KIND),
            letter.queue.as_deref().unwrap_or("?"),
            field(headers::HANDLER),
            field(headers::ATTEMPTS),
            field(headers::LAST_FAILURE),
            preview(field(headers::ERROR).as_bytes(), 160),
            preview(&d.data, 160),
        );
    }
}

fn show(out: &mut Out, browse: &Browse, wanted: usize, index: &mut usize) {
    for letter in &browse.letters {
        *index += 1;
        if *index != wanted {
            continue;
        }
        let d = &letter.delivery;
        say!(
            out,
            "dead letter #{wanted} in '{}' from queue {} ({} bytes, {} more copies)",
            browse.dlq,
            letter.queue.as_deref().unwrap_or("? (unknown)"),
            d.data.len(),
            letter.copies.len()
        );
        let p = &d.properties;
        for (name, value) in [
            ("message_id", p.message_id().as_ref().map(|v| v.to_string())),
            ("correlation_id", p.correlation_id().as_ref().map(|v| v.to_string())),
            ("content_type", p.content_type().as_ref().map(|v| v.to_string())),
            ("type", p.kind().as_ref().map(|v| v.to_string())),
            ("reply_to", p.reply_to().as_ref().map(|v| v.to_string())),
        ] {
            if let Some(value) = value {
                say!(out, "  {name}: {value}");
            }
        }
        say!(out, "  dead-lettered: {}", history(d));
        if let Some(table) = p.headers() {
            // The broker's delivery count is not the letter's: see below.
            for name in table.inner().keys().filter(|name| name.as_str() != headers::DELIVERY_COUNT) {
                say!(
                    out,
                    "  {name}: {}",
                    shown_header(name.as_str(), &header(d, name.as_str()).unwrap_or_default())
                );
            }
        }
        if let Some(returns) = header(d, headers::DELIVERY_COUNT) {
            say!(out,
                "  browsed before: {returns} times (the DLQ's {}: each `dlq` command that reads the letter \
                 returns it, and the broker counts each return; it says nothing of how often the message failed)",
                headers::DELIVERY_COUNT
            );
        }
        say!(out, "body:\n{}", String::from_utf8_lossy(&d.data));
    }
}

/// The headers a replay drops, so the message starts again at attempt 1.
const STRIPPED: [&str; 5] =
    [headers::DELIVERY_COUNT, "x-death", headers::ATTEMPTS, headers::RETRY_OF, headers::REPLAY];

pub(crate) async fn replay(
    out: &mut Out,
    connection: &Connection,
    browse: &Browse,
    filter: &Filter,
    options: &Options,
) -> CliResult {
    let publisher = connection.create_channel().await?;
    publisher.confirm_select(ConfirmSelectOptions::default()).await?;
    let (mut replayed, mut left) = (std::collections::BTreeMap::<&str, usize>::new(), 0);
    let dlq = &browse.dlq;
    for letter in filter.chosen(&browse.letters) {
        let d = &letter.delivery;
        let describe = || {
            let id = d.properties.message_id().as_ref().map_or("-".to_owned(), ToString::to_string);
            format!("the dead letter (message_id {id}, {})", preview(&d.data, 60))
        };
        let Some(queue) = letter.queue.as_deref() else {
            say!(out,
                "left {} in '{dlq}': its queue is unknown (no {} header it names, and '{dlq}' serves several queues); \
                 republish it by hand",
                describe(),
                headers::QUEUE
            );
            left += 1;
            continue;
        };
        let generation = replays(d);
        if generation >= options.max_replays {
            say!(out,
                "left {} in '{dlq}': replayed {generation} times already (--max-replays {}); fix what fails it, \
                 or purge it",
                describe(),
                options.max_replays
            );
            left += 1;
            continue;
        }
        if options.dry_run {
            say!(out, "would replay {} to '{queue}' (replay {})", describe(), generation + 1);
            *replayed.entry(queue).or_default() += 1;
            continue;
        }
        let mut table = FieldTable::default();
        if let Some(original) = d.properties.headers() {
            for (name, value) in original.inner() {
                if !STRIPPED.contains(&name.as_str()) {
                    table.insert(name.clone(), value.clone());
                }
            }
        }
        // A new generation: a lineage of its own, whose attempt 1 no copy of the
        // letter's first life can settle.
        table.insert(headers::REPLAY.into(), AMQPValue::LongLongInt(i64::from(generation + 1)));
        // The replay goes to the queue by its name: the key the message was first
        // published with stays in a header, which routes it on a queue several typed
        // handlers consume. idemq's letters carry it; one the broker dead-lettered
        // (its delivery limit) has it only in the `x-death` it drops.
        if !table.contains_key(headers::ORIGINAL_ROUTING_KEY) {
            if let Some(key) = first_death_routing_key(d) {
                table.insert(headers::ORIGINAL_ROUTING_KEY.into(), AMQPValue::LongString(key.into()));
            }
        }
        let properties = d.properties.clone().with_headers(table).with_delivery_mode(2);
        let options = BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() };
        let confirm =
            publisher.basic_publish("".into(), queue.into(), options, &d.data, properties).await?.await?;
        match confirm {
            Confirmation::Ack(None) => {}
            Confirmation::Ack(Some(_)) => {
                return Err(format!("queue '{queue}' does not exist: replayed nothing more").into())
            }
            other => {
                return Err(format!("the broker did not confirm a replay to '{queue}': {other:?}").into())
            }
        }
        // Published and confirmed: only now out of the DLQ (with its copies).
        browse.remove(letter).await?;
        *replayed.entry(queue).or_default() += 1;
    }
    let _ = publisher.close(200, "replayed".into()).await;
    let verb = if options.dry_run { "would replay" } else { "replayed" };
    for (queue, count) in &replayed {
        say!(out, "{verb} {count} dead letters to '{queue}'");
    }
    if replayed.is_empty() && !browse.letters.is_empty() && left == 0 {
        say!(out, "{verb} 0 dead letters from '{dlq}'");
    }
    Ok(())
}

pub(crate) async fn purge(out: &mut Out, browse: &Browse, filter: &Filter, options: &Options) -> CliResult {
    let chosen = filter.chosen(&browse.letters);
    let count: usize = chosen.iter().map(|letter| 1 + letter.copies.len()).sum();
    let dlq = &browse.dlq;
    if options.dry_run {
        for letter in &chosen {
            let copies = letter.copies.len();
            say!(
                out,
                "would purge the dead letter {} from queue {} (+{copies} copies): {}",
                header(&letter.delivery, headers::ERROR_KIND).unwrap_or_else(|| "-".to_owned()),
                letter.queue.as_deref().unwrap_or("?"),
                preview(&letter.delivery.data, 60)
            );
        }
        say!(out, "would purge {count} dead letters from '{dlq}'");
        return Ok(());
    }
    if count > 0 && !options.yes && !confirmed(count, dlq)? {
        say!(out, "purged nothing from '{dlq}'");
        return Ok(());
    }
    for letter in &chosen {
        browse.remove(letter).await?;
    }
    if count > 0 || !browse.letters.is_empty() {
        say!(out, "purged {count} dead letters from '{dlq}'");
    }
    Ok(())
}

/// Asks on the terminal whether to purge; without one, refuses.
fn confirmed(count: usize, dlq: &str) -> Result<bool, Box<dyn std::error::Error + Send + Sync>> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        return Err(format!(
            "purge would delete {count} dead letters from '{dlq}' for good, and there is no terminal to ask: \
             look first with `dlq purge --dry-run`, then confirm with `dlq purge --yes`"
        )
        .into());
    }
    print!("delete {count} dead letters from '{dlq}' for good? [y/N] ");
    std::io::stdout().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes"))
}
