//! The dead letters as the console shows them: every DLQ browsed as `dlq list`
//! browses it (taken unacked, given back by closing the channel), the letters
//! grouped by the handler and the error kind idemq wrote in their headers, and the
//! actions — replay and purge — run by `dlq`'s own code, so a page keeps the CLI's
//! guarantees: a dry run first, a replay published and confirmed before the letter
//! leaves the DLQ, the replay cap, true copies replayed once.

use idemq_core::headers;

use crate::common::{connect_broker, Out};
use crate::dlq::{self, Browse, Filter, Options};
use crate::status::Inventory;

/// One dead letter, read.
#[derive(Debug, Clone)]
pub(super) struct LetterView {
    pub(super) message_id: Option<String>,
    /// What names it for an action on it alone ([`dlq::letter_key`]).
    pub(super) key: Option<String>,
    /// The queue it came from (where a replay sends it).
    pub(super) queue: Option<String>,
    pub(super) copies: usize,
    /// When it was dead-lettered (`x-idemq-last-failure`).
    pub(super) at: Option<String>,
    pub(super) error: Option<String>,
    pub(super) history: String,
    /// Each header, credentials hidden.
    pub(super) headers: Vec<(String, String)>,
    pub(super) body: String,
    pub(super) body_bytes: usize,
}

/// The letters of one DLQ with one handler and one error kind.
#[derive(Debug, Clone)]
pub(super) struct Group {
    pub(super) dlq: String,
    /// `x-idemq-handler`; `None` for the broker's own dead letters (expired,
    /// rejected by a queue limit).
    pub(super) handler: Option<String>,
    /// `x-idemq-error-kind`; `None` likewise.
    pub(super) kind: Option<String>,
    pub(super) letters: Vec<LetterView>,
}

impl Group {
    /// The number of dead letters, copies included.
    pub(super) fn count(&self) -> usize {
        self.letters.iter().map(|letter| 1 + letter.copies).sum()
    }
}

/// A DLQ that could not be read, and why.
pub(super) type Unread = (String, String);

/// Every DLQ's letters, grouped; and the DLQs that could not be read.
pub(super) async fn groups(inventory: &Inventory) -> Result<(Vec<Group>, Vec<Unread>), String> {
    let connection = connect_broker(&inventory.amqp_url).await.map_err(|err| err.report())?;
    let dlqs = dlq::dead_letter_queues(&inventory.consumed);
    let taken = futures_util::future::join_all(
        dlqs.iter().map(|(dlq, owners)| Browse::take(&connection, dlq, owners)),
    )
    .await;
    let (mut groups, mut unread) = (Vec::<Group>::new(), Vec::new());
    let mut browses = Vec::new();
    for ((dlq, _), browse) in dlqs.iter().zip(taken) {
        match browse {
            Ok(browse) => {
                for letter in &browse.letters {
                    let d = &letter.delivery;
                    let (handler, kind) =
                        (dlq::header(d, headers::HANDLER), dlq::header(d, headers::ERROR_KIND));
                    let view = view(letter);
                    match groups.iter_mut().find(|g| g.dlq == *dlq && g.handler == handler && g.kind == kind)
                    {
                        Some(group) => group.letters.push(view),
                        None => groups.push(Group { dlq: dlq.clone(), handler, kind, letters: vec![view] }),
                    }
                }
                browses.push(browse);
            }
            Err(err) => unread.push((dlq.clone(), err.to_string())),
        }
    }
    futures_util::future::join_all(browses.into_iter().map(|browse| browse.end(&connection))).await;
    let _ = connection.close(200, "browsed".into()).await;
    groups.sort_by(|a, b| b.count().cmp(&a.count()).then_with(|| a.dlq.cmp(&b.dlq)));
    Ok((groups, unread))
}

fn view(letter: &dlq::Letter) -> LetterView {
    let d = &letter.delivery;
    let mut headers: Vec<(String, String)> = d
        .properties
        .headers()
        .iter()
        .flat_map(|table| table.inner().keys())
        .filter(|name| name.as_str() != headers::DELIVERY_COUNT)
        .map(|name| {
            let value = dlq::header(d, name.as_str()).unwrap_or_default();
            (name.to_string(), dlq::shown_header(name.as_str(), &value))
        })
        .collect();
    headers.sort();
    let p = &d.properties;
    for (name, value) in [
        ("message_id", p.message_id().as_ref().map(ToString::to_string)),
        ("correlation_id", p.correlation_id().as_ref().map(ToString::to_string)),
        ("content_type", p.content_type().as_ref().map(ToString::to_string)),
        ("type", p.kind().as_ref().map(ToString::to_string)),
    ] {
        if let Some(value) = value {
            headers.insert(0, (format!("({name})"), value));
        }
    }
    const SHOWN: usize = 16 * 1024;
    LetterView {
        message_id: p.message_id().as_ref().map(ToString::to_string),
        key: dlq::letter_key(d),
        queue: letter.queue.clone(),
        copies: letter.copies.len(),
        at: dlq::header(d, headers::LAST_FAILURE),
        error: dlq::header(d, headers::ERROR),
        history: dlq::history(d),
        headers,
        body: dlq::preview(&d.data, SHOWN),
        body_bytes: d.data.len(),
    }
}

/// What an action is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Act {
    Replay { max_replays: u32 },
    Purge,
}

/// Which letters an action takes: a group, or one message of it.
#[derive(Debug, Clone)]
pub(super) struct Target {
    pub(super) dlq: String,
    pub(super) handler: Option<String>,
    pub(super) kind: Option<String>,
    pub(super) message_id: Option<String>,
}

impl Target {
    /// In words, for the audit and the pages.
    pub(super) fn describe(&self) -> String {
        let mut words = format!(
            "{} handler={} kind={}",
            self.dlq,
            self.handler.as_deref().unwrap_or("(none)"),
            self.kind.as_deref().unwrap_or("(none)")
        );
        if let Some(key) = &self.message_id {
            words.push_str(&format!(" letter={key}"));
        }
        words
    }
}

/// Runs `act` on `target` (a dry run when `dry_run`): `dlq replay`/`dlq purge`'s
/// lines.
pub(super) async fn act(
    inventory: &Inventory,
    target: &Target,
    act: &Act,
    dry_run: bool,
) -> Result<Vec<String>, String> {
    let owners = dlq::dead_letter_queues(&inventory.consumed)
        .into_iter()
        .find(|(dlq, _)| *dlq == target.dlq)
        .map(|(_, owners)| owners)
        .ok_or_else(|| format!("'{}' is not a dead-letter queue of this application", target.dlq))?;
    let connection = connect_broker(&inventory.amqp_url).await.map_err(|err| err.report())?;
    let browse = Browse::take(&connection, &target.dlq, &owners).await.map_err(|err| err.to_string())?;
    let filter = Filter::group(target.kind.clone(), target.handler.clone(), target.message_id.clone());
    let mut out = Out::captured();
    let result = match act {
        Act::Replay { max_replays } => {
            let options = Options { dry_run, yes: true, max_replays: *max_replays };
            dlq::replay(&mut out, &connection, &browse, &filter, &options).await
        }
        Act::Purge => {
            let options = Options { dry_run, yes: true, max_replays: dlq::DEFAULT_MAX_REPLAYS };
            dlq::purge(&mut out, &browse, &filter, &options).await
        }
    };
    browse.end(&connection).await;
    let _ = connection.close(200, "done".into()).await;
    let mut lines = out.lines();
    if let Err(err) = result {
        lines.push(format!("stopped: {err}"));
        return Err(lines.join("\n"));
    }
    Ok(lines)
}
