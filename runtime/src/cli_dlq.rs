//! `dlq list | show | replay | purge`: dead letters, browsed without damage.
//!
//! Browsing takes the dead letters with manual acks on a channel of its own and
//! closes it, which returns every one it did not ack to the queue, in order. On a
//! quorum queue each such return counts a delivery (`x-delivery-count`): idemq
//! declares dead-letter queues without a delivery limit, so browsing can never drop
//! one on RabbitMQ 3.x. (RabbitMQ 4 gives quorum queues a default limit of 20: there,
//! declare the DLQ with a policy that lifts it before browsing it often.) A browse
//! holds the dead letters unacked for at most [`BROWSE_FOR`].
//!
//! Replay publishes each chosen dead letter to its queue (default exchange,
//! persistent, `mandatory`, confirmed) without `x-delivery-count`, `x-death`,
//! `x-idemq-attempts` and `x-idemq-retry-of` — so it starts again at attempt 1 — and
//! only then acks it in the DLQ. Copies of one lineage (the same copy id before its
//! `:attempt`) are listed once, with their count, and replayed once (the other
//! copies are removed).

use std::time::{Duration, Instant};

use clap::ArgMatches;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation, Connection};

use crate::dead_letter::headers;
use crate::runtime::RuntimeBuilder;

/// The longest a browse holds dead letters unacked.
const BROWSE_FOR: Duration = Duration::from_secs(30);

/// The most dead letters one command looks at.
const MAX_BROWSE: u16 = 10_000;

type CliResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

pub(crate) async fn run(builder: &RuntimeBuilder, matches: &ArgMatches) -> CliResult {
    let (action, sub) = matches.subcommand().ok_or("dlq needs list, show, replay or purge")?;
    let only = matches.get_one::<String>("queue");
    let queues: Vec<(String, String)> = builder
        .consumed_queues()
        .into_iter()
        .filter(|(queue, _)| only.is_none_or(|only| only == queue))
        .collect();
    if queues.is_empty() {
        return Err(match only {
            Some(queue) => format!("--queue {queue}: the code declares or consumes no such queue").into(),
            None => "the code declares and consumes no queue".into(),
        });
    }
    let connection = crate::cli::connect_broker(builder.configured_amqp_url()).await?;
    let filter = Filter::of(sub);
    let mut index = 0;
    for (queue, dlq) in &queues {
        let browse = Browse::take(&connection, dlq).await?;
        let result = match action {
            "list" => {
                list(&browse, &filter, &mut index);
                Ok(())
            }
            "show" => {
                let wanted = *sub.get_one::<usize>("index").expect("required");
                show(&browse, wanted, &mut index);
                Ok(())
            }
            "replay" => replay(&connection, &browse, &filter, queue).await,
            "purge" => purge(&browse, &filter, dlq).await,
            other => Err(format!("unknown dlq command `{other}`").into()),
        };
        browse.end().await;
        result?;
    }
    if action == "list" && index == 0 {
        println!("no dead letters{}", if filter.is_empty() { "" } else { " match" });
    }
    Ok(())
}

/// The dead letters of one DLQ, taken unacked on a channel of their own.
struct Browse {
    channel: Channel,
    letters: Vec<Letter>,
}

/// One lineage's dead letters: the first, and the count of its copies.
struct Letter {
    delivery: Delivery,
    copies: Vec<u64>,
}

impl Browse {
    async fn take(
        connection: &Connection,
        dlq: &str,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let channel = connection.create_channel().await?;
        let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
        let ready = || async {
            match channel.queue_declare(dlq.into(), passive, FieldTable::default()).await {
                Ok(queue) => Ok(queue.message_count()),
                Err(_) => {
                    Err(format!("dead-letter queue '{dlq}' does not exist (`declare --apply` creates it)"))
                }
            }
        };
        // The count is of ready messages only. Dead letters a previous browse (or
        // replay) held come back a moment after its channel closed — on a quorum
        // queue after its close was answered — so `dlq list` twice in a row once
        // said "no dead letters" (a fresh-clone CI run). Read until two readings
        // 100 ms apart agree, and give an empty queue a second to fill.
        let mut count = ready().await?;
        let settle_by = Instant::now() + Duration::from_secs(1);
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
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
            channel.basic_qos(want, BasicQosOptions::default()).await?;
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
                let lineage = lineage(&delivery);
                match letters.iter_mut().find(|l| lineage.is_some() && self::lineage(&l.delivery) == lineage)
                {
                    Some(letter) => letter.copies.push(delivery.delivery_tag),
                    None => letters.push(Letter { delivery, copies: Vec::new() }),
                }
            }
        }
        Ok(Self { channel, letters })
    }

    /// Closes the channel: what was not acked goes back to the queue.
    async fn end(self) {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.channel.close(200, "browsed".into())).await;
    }

    async fn ack(&self, tag: u64) -> Result<(), lapin::Error> {
        self.channel.basic_ack(tag, BasicAckOptions::default()).await
    }
}

/// Which dead letters a command applies to.
struct Filter {
    kind: Option<String>,
    handler: Option<String>,
    limit: Option<usize>,
}

impl Filter {
    fn of(matches: &ArgMatches) -> Self {
        let get = |id: &str| matches.try_get_one::<String>(id).ok().flatten().cloned();
        Self {
            kind: get("kind"),
            handler: get("handler"),
            limit: matches.try_get_one::<usize>("limit").ok().flatten().copied(),
        }
    }

    fn is_empty(&self) -> bool {
        self.kind.is_none() && self.handler.is_none()
    }

    fn matches(&self, delivery: &Delivery) -> bool {
        self.kind.as_ref().is_none_or(|kind| header(delivery, headers::ERROR_KIND).as_deref() == Some(kind))
            && self.handler.as_ref().is_none_or(|h| header(delivery, headers::HANDLER).as_deref() == Some(h))
    }

    fn chosen<'a>(&self, letters: &'a [Letter]) -> Vec<&'a Letter> {
        let matching = letters.iter().filter(|letter| self.matches(&letter.delivery));
        matching.take(self.limit.unwrap_or(usize::MAX)).collect()
    }
}

/// A header of `delivery` for display: text, or the value as the client shows it.
fn header(delivery: &Delivery, name: &str) -> Option<String> {
    let value = crate::amqp_value::header(&delivery.properties, name)?;
    Some(crate::amqp_value::text(value).unwrap_or_else(|| format!("{value:?}")))
}

/// The copy id's lineage (before `:attempt`).
fn lineage(delivery: &Delivery) -> Option<String> {
    let id = header(delivery, headers::COPY_ID)?;
    Some(id.rsplit_once(':').map_or(id.clone(), |(lineage, _)| lineage.to_owned()))
}

fn preview(bytes: &[u8], max: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let flat: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if flat.chars().count() > max {
        format!("{}…", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

fn list(browse: &Browse, filter: &Filter, index: &mut usize) {
    for letter in filter.chosen(&browse.letters) {
        *index += 1;
        let d = &letter.delivery;
        let field = |name| header(d, name).unwrap_or_else(|| "-".to_owned());
        let copies = if letter.copies.is_empty() {
            String::new()
        } else {
            format!(" (+{} copies)", letter.copies.len())
        };
        println!(
            "#{index} {} handler={} attempts={} at={}{copies}\n    error: {}\n    body:  {}",
            field(headers::ERROR_KIND),
            field(headers::HANDLER),
            field(headers::ATTEMPTS),
            field(headers::LAST_FAILURE),
            preview(field(headers::ERROR).as_bytes(), 160),
            preview(&d.data, 160),
        );
    }
}

fn show(browse: &Browse, wanted: usize, index: &mut usize) {
    for letter in &browse.letters {
        *index += 1;
        if *index != wanted {
            continue;
        }
        let d = &letter.delivery;
        println!("dead letter #{wanted} ({} bytes, {} more copies)", d.data.len(), letter.copies.len());
        let p = &d.properties;
        for (name, value) in [
            ("message_id", p.message_id().as_ref().map(|v| v.to_string())),
            ("correlation_id", p.correlation_id().as_ref().map(|v| v.to_string())),
            ("content_type", p.content_type().as_ref().map(|v| v.to_string())),
            ("reply_to", p.reply_to().as_ref().map(|v| v.to_string())),
        ] {
            if let Some(value) = value {
                println!("  {name}: {value}");
            }
        }
        if let Some(table) = p.headers() {
            for name in table.inner().keys() {
                println!("  {name}: {}", header(d, name.as_str()).unwrap_or_default());
            }
        }
        println!("body:\n{}", String::from_utf8_lossy(&d.data));
    }
}

/// The headers a replay drops, so the message starts again at attempt 1.
const STRIPPED: [&str; 4] = [headers::DELIVERY_COUNT, "x-death", headers::ATTEMPTS, headers::RETRY_OF];

async fn replay(connection: &Connection, browse: &Browse, filter: &Filter, queue: &str) -> CliResult {
    let publisher = connection.create_channel().await?;
    publisher.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut replayed = 0;
    for letter in filter.chosen(&browse.letters) {
        let d = &letter.delivery;
        let mut table = FieldTable::default();
        if let Some(original) = d.properties.headers() {
            for (name, value) in original.inner() {
                if !STRIPPED.contains(&name.as_str()) {
                    table.insert(name.clone(), value.clone());
                }
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
        browse.ack(d.delivery_tag).await?;
        for &copy in &letter.copies {
            browse.ack(copy).await?;
        }
        replayed += 1;
    }
    let _ = publisher.close(200, "replayed".into()).await;
    if replayed > 0 || !browse.letters.is_empty() {
        println!("replayed {replayed} dead letters to '{queue}'");
    }
    Ok(())
}

async fn purge(browse: &Browse, filter: &Filter, dlq: &str) -> CliResult {
    let mut purged = 0;
    for letter in filter.chosen(&browse.letters) {
        browse.ack(letter.delivery.delivery_tag).await?;
        for &copy in &letter.copies {
            browse.ack(copy).await?;
        }
        purged += 1 + letter.copies.len();
    }
    if purged > 0 || !browse.letters.is_empty() {
        println!("purged {purged} dead letters from '{dlq}'");
    }
    Ok(())
}
