//! The console's HTML: one function per page, each escaped by maud (a value is text,
//! never markup), in one frame with the navigation and who is looking.

use std::time::Duration;

use idemq_core::__private::sibling::human;
use idemq_core::__private::sibling::pages::PREFIX;
use maud::{html, Markup, PreEscaped, DOCTYPE};

use super::auth::Who;
use super::facts::{AuditRow, Database, Figure};
use super::letters::{Act, Group, Target, Unread};
use super::live::Figures;
use super::{GroupKey, Page};

const STYLE: &str = "
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#1d2433;background:#f6f7f9}
header{background:#1d2433;color:#fff;padding:10px 20px;display:flex;gap:22px;align-items:baseline;flex-wrap:wrap}
header b{font-size:16px}header a{color:#c9d3ea;text-decoration:none}header a.on{color:#fff;border-bottom:2px solid #7fb0ff}
header .who{margin-left:auto;color:#9fb0d0;font-size:12px}
main{padding:16px 20px;max-width:1300px}
h1{font-size:19px;margin:4px 0 12px}h2{font-size:16px;margin:20px 0 8px}
table{border-collapse:collapse;background:#fff;width:100%;margin-bottom:12px}
th,td{border-bottom:1px solid #e3e6ec;padding:6px 8px;text-align:left;vertical-align:top}
th{background:#eef1f6;font-weight:600;font-size:12px;text-transform:uppercase;color:#4a5368}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;border-radius:9px;padding:1px 8px;font-size:12px;font-weight:600}
.ok{background:#dcf3e3;color:#17602e}.bad{background:#fde0df;color:#8c1d18}.warn{background:#fff1cc;color:#7a5200}
.muted{color:#6b7385}.note{background:#fff;border-left:4px solid #7fb0ff;padding:8px 12px;margin:10px 0}
.error{background:#fde0df;border-left:4px solid #c0392b;padding:8px 12px;margin:10px 0}
pre{background:#fff;border:1px solid #e3e6ec;padding:10px;overflow:auto;white-space:pre-wrap;word-break:break-word}
form.inline{display:inline}button{font:inherit;padding:3px 10px;border:1px solid #8a94a8;border-radius:4px;background:#fff;cursor:pointer}
button.danger{border-color:#c0392b;color:#8c1d18}input{font:inherit;padding:3px 6px}
td.k{font-weight:600;color:#4a5368;width:230px;word-break:break-all}
details{background:#fff;border:1px solid #e3e6ec;margin:6px 0;padding:6px 10px}summary{cursor:pointer}
";

/// The most letters a group's page shows (the actions take them all).
const SHOWN_LETTERS: usize = 50;

/// The frame around every page.
fn frame(page: &Page<'_>, on: &str, title: &str, body: Markup) -> Markup {
    let link = |path: &str, name: &str| {
        html! { a class=@if on == path { "on" } href=(format!("{PREFIX}{path}")) { (name) } }
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " — " (page.app) " — idemq console" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    b { (page.app) " · idemq console" }
                    (link("", "Handlers"))
                    (link("/dead-letters", "Dead letters"))
                    (link("/queues", "Queues & streams"))
                    (link("/database", "Database & outbox"))
                    (link("/audit", "Audit"))
                    span.who {
                        @match page.who {
                            Who::Local => "local, read-only",
                            Who::Operator(name) => (name),
                            Who::Nobody => "not logged in",
                        }
                        " · "
                        @if page.access.actions { "actions on" } @else { "read-only console" }
                        @if let Who::Operator(_) = page.who {
                            " · "
                            form.inline method="post" action=(format!("{PREFIX}/logout")) { button type="submit" { "log out" } }
                        } @else if page.access.actions && page.access.has_token() {
                            " · " a href=(format!("{PREFIX}/login")) { "log in to act" }
                        }
                    }
                }
                main { h1 { (title) } (body) }
            }
        }
    }
}

/// A handler's row on the handlers page.
pub(super) struct HandlerRow {
    pub(super) handler: String,
    pub(super) queue: String,
    pub(super) settings: Vec<String>,
    /// `None`: no runtime in this process (the `console` command); `Some(None)`:
    /// no figures for it yet.
    pub(super) figures: Option<Option<Figures>>,
}

fn seconds(value: Option<f64>) -> String {
    match value {
        None => "—".to_owned(),
        Some(s) if s < 0.001 => format!("{:.0} µs", s * 1e6),
        Some(s) if s < 1.0 => format!("{:.1} ms", s * 1e3),
        Some(s) => format!("{s:.2} s"),
    }
}

fn rate(figures: &Figures, outcome: &str) -> String {
    match (figures.over, figures.per_minute.get(outcome)) {
        (None, _) => "—".to_owned(),
        (Some(_), None) => "0".to_owned(),
        (Some(_), Some(n)) if *n >= 10.0 || *n == 0.0 => format!("{n:.0}"),
        (Some(_), Some(n)) => format!("{n:.1}"),
    }
}

pub(super) fn handlers(page: &Page<'_>, rows: &[HandlerRow], waiting: Option<&str>) -> Markup {
    let running = rows.iter().any(|row| row.figures.is_some());
    let over = rows.iter().find_map(|row| row.figures.as_ref()?.as_ref()?.over);
    frame(
        page,
        "",
        "Handlers",
        html! {
            @if let Some(why) = waiting {
            p.error { "Not consuming: " (why) }
        }
        @if !running {
                p.note { "This console runs without a consumer (the " code { "console" } " command): the settings below are \
                          the code's. Live figures are on the console of a running service (" code { "run --http-addr" } ")." }
            } @else {
                p.muted {
                    "Rates per minute over the last "
                    (over.map_or("— (measuring: a few seconds)".to_owned(), |over| human(Duration::from_secs(over.as_secs().max(1))).to_string()))
                    "; handler time over the same window (since start when the window saw none). Refreshes every 10 s."
                }
            }
            table {
                thead { tr {
                    th { "handler" } th { "queue" } th { "state" }
                    @if running { th { "applied/min" } th { "duplicate/min" } th { "retried/min" } th { "dead-lettered/min" } th { "p50" } th { "p99" } th { "in flight" } }
                    th { "settings" }
                } }
                tbody {
                    @for row in rows {
                        tr {
                            td { b { (row.handler) } }
                            td { (row.queue) }
                            td {
                                @match &row.figures {
                                    Some(Some(f)) if f.paused => span.badge.bad title="its kill switch opened: the queue is left alone until a trial message succeeds" { "paused (kill switch)" },
                                    Some(Some(_)) if waiting.is_some() => span.badge.warn title=(waiting.unwrap_or_default()) { "waiting" },
                                    Some(Some(f)) => {
                                        span.badge.ok { "running" }
                                        @if f.trips > 0.0 {
                                            br; span.muted { "kill switch opened " (f.trips) " times since start" }
                                        }
                                        @if let Some((messages, seconds)) = f.stream_lag {
                                            br;
                                            span.muted title="messages after the last applied; at least this far behind in time (read every 15 s)" {
                                                "lag " (messages) " messages, " (human(Duration::from_secs_f64(seconds.max(0.0))))
                                            }
                                        }
                                    },
                                    Some(None) => span.badge.warn { "not started" },
                                    None => span.muted { "—" },
                                }
                            }
                            @if running {
                                @if let Some(Some(f)) = &row.figures {
                                    td.n { (rate(f, "applied")) }
                                    td.n { (rate(f, "duplicate")) }
                                    td.n { (rate(f, "retried")) }
                                    td.n { (rate(f, "dead_lettered")) }
                                    td.n { (seconds(f.p50)) }
                                    td.n { (seconds(f.p99)) }
                                    td.n { (f.in_flight) }
                                } @else {
                                    td.n { "—" } td.n { "—" } td.n { "—" } td.n { "—" } td.n { "—" } td.n { "—" } td.n { "—" }
                                }
                            }
                            td.muted { (row.settings.join("; ")) }
                        }
                    }
                }
            }
        },
    )
}

pub(super) fn dead_letters(
    page: &Page<'_>,
    groups: &Result<(Vec<Group>, Vec<Unread>), String>,
    chosen: Option<&GroupKey>,
) -> Markup {
    let (groups, unread) = match groups {
        Ok((groups, unread)) => (groups.as_slice(), unread.as_slice()),
        Err(why) => {
            return frame(
                page,
                "/dead-letters",
                "Dead letters",
                html! { p.error { "The broker could not be read: " (why) } },
            )
        }
    };
    let key = |group: &Group| GroupKey {
        dlq: group.dlq.clone(),
        handler: group.handler.clone(),
        kind: group.kind.clone(),
    };
    let shown = chosen.and_then(|chosen| groups.iter().find(|group| key(group) == *chosen));
    frame(
        page,
        "/dead-letters",
        "Dead letters",
        html! {
            @for (dlq, why) in unread { p.error { "Dead-letter queue " code { (dlq) } " could not be read: " (why) } }
            @if groups.is_empty() {
                p.note { "No dead letters." }
            } @else {
                p.muted { "Grouped by the handler and the error kind idemq wrote in each letter's headers ("
                    code { "x-idemq-handler" } ", " code { "x-idemq-error-kind" } "). A count includes the true copies of a message (dead-lettered more than once); a replay sends each message once." }
                table {
                    thead { tr { th { "dead-letter queue" } th { "handler" } th { "error kind" } th { "letters" } th { "latest error" } th { "" } } }
                    tbody {
                        @for group in groups {
                            tr {
                                td { (group.dlq) }
                                td { (group.handler.as_deref().unwrap_or("— (the broker's)")) }
                                td { (group.kind.as_deref().unwrap_or("—")) }
                                td.n { (group.count()) }
                                td.muted { (group.letters.last().and_then(|l| l.error.as_deref()).map(|e| truncate(e, 140)).unwrap_or_default()) }
                                td { a href=(format!("{PREFIX}/dead-letters?{}", key(group).query())) { "letters" } }
                            }
                        }
                    }
                }
            }
            @if let Some(chosen) = chosen {
                @if let Some(group) = shown {
                    h2 { (group.count()) " letters (" (group.letters.len()) " messages) in " (group.dlq) " · " (group.handler.as_deref().unwrap_or("the broker's")) " · " (group.kind.as_deref().unwrap_or("no kind")) }
                    (actions(page, chosen, None, &format!("Replay these {} messages", group.letters.len()), &format!("Purge these {} letters", group.count())))
                    @if group.letters.len() > SHOWN_LETTERS {
                        p.muted { "The first " (SHOWN_LETTERS) " of " (group.letters.len()) " messages; the actions take the whole group." }
                    }
                    @for (n, letter) in group.letters.iter().take(SHOWN_LETTERS).enumerate() {
                        details open[n == 0] {
                            summary {
                                b { "#" (n + 1) } " "
                                (letter.message_id.as_deref().unwrap_or("(no message_id)"))
                                " · from " (letter.queue.as_deref().unwrap_or("? (unknown queue)"))
                                @if letter.copies > 0 { " · +" (letter.copies) " copies" }
                                @if let Some(at) = &letter.at { " · " (at) }
                            }
                            @if let Some(error) = &letter.error { p.error { (error) } }
                            p { b { "Lineage: " } "dead-lettered " (letter.history) }
                            table { tbody { @for (name, value) in &letter.headers { tr { td.k { (name) } td { code { (value) } } } } } }
                            p.muted { "body, " (letter.body_bytes) " bytes:" }
                            pre { (letter.body) }
                            @if let Some(key) = &letter.key {
                                (actions(page, chosen, Some(key), "Replay this message", "Purge this message"))
                            }
                        }
                    }
                } @else {
                    p.note { "That group has no dead letters now." }
                }
            }
        },
    )
}

/// The replay and purge buttons for a group (or one message of it): each opens a
/// dry run, which asks for the confirmation.
fn actions(page: &Page<'_>, key: &GroupKey, message_id: Option<&str>, replay: &str, purge: &str) -> Markup {
    if !page.access.actions {
        return html! {};
    }
    if !page.access.has_token() {
        return html! { p.muted { "Replay and purge need the console's token: set " code { "IDEMQ_CONSOLE_TOKEN" } " where it runs." } };
    }
    if !matches!(page.who, Who::Operator(_)) {
        return html! { p.muted { a href=(format!("{PREFIX}/login")) { "Log in" } " to replay or purge." } };
    }
    html! {
        p {
            form.inline method="post" action=(format!("{PREFIX}/dead-letters/replay")) {
                (hidden(page, key, message_id))
                label.muted title="a letter already replayed this often stays in the DLQ" {
                    "replay cap " input type="number" name="max_replays" min="0" style="width:4em" value=(crate::dlq::DEFAULT_MAX_REPLAYS);
                }
                " "
                button type="submit" { (replay) "…" }
            }
            " "
            form.inline method="post" action=(format!("{PREFIX}/dead-letters/purge")) {
                (hidden(page, key, message_id))
                button.danger type="submit" { (purge) "…" }
            }
        }
    }
}

fn hidden(page: &Page<'_>, key: &GroupKey, message_id: Option<&str>) -> Markup {
    html! {
        input type="hidden" name="form_key" value=(page.access.form_key);
        input type="hidden" name="dlq" value=(key.dlq);
        @if let Some(handler) = &key.handler { input type="hidden" name="handler" value=(handler); }
        @if let Some(kind) = &key.kind { input type="hidden" name="kind" value=(kind); }
        @if let Some(id) = message_id { input type="hidden" name="message_id" value=(id); }
    }
}

/// The dry run of an action, and the confirmation.
pub(super) fn confirm(
    page: &Page<'_>,
    target: &Target,
    act: &Act,
    key: &GroupKey,
    lines: Result<Vec<String>, String>,
) -> Markup {
    let (verb, path) = match act {
        Act::Replay { .. } => ("Replay", "replay"),
        Act::Purge => ("Purge", "purge"),
    };
    frame(
        page,
        "/dead-letters",
        &format!("{verb}: dry run"),
        html! {
            p { "What " b { (verb.to_lowercase()) } " would do to " code { (target.describe()) } ", as " code { "dlq " (path) " --dry-run" } " says it:" }
            @match &lines {
                Ok(lines) => pre { @for line in lines { (line) "\n" } },
                Err(why) => p.error { (why) },
            }
            @if lines.is_ok() {
                form method="post" action=(format!("{PREFIX}/dead-letters/{path}")) {
                    (hidden(page, key, target.message_id.as_deref()))
                    input type="hidden" name="confirm" value="yes";
                    @if let Act::Replay { max_replays } = act {
                        p {
                            label { "Replay cap (a letter replayed this often already stays in the DLQ): "
                                input type="number" name="max_replays" min="0" value=(max_replays); }
                        }
                    }
                    p.muted { "Letters that arrive in the meantime and match are included; each is replayed (published and confirmed, then removed from the DLQ) or purged once." }
                    button class=@if path == "purge" { "danger" } type="submit" { "Yes, " (verb.to_lowercase()) }
                    " " a href=(format!("{PREFIX}/dead-letters?{}", key.query())) { "cancel" }
                }
            }
        },
    )
}

/// What an action did.
pub(super) fn done(
    page: &Page<'_>,
    action: &str,
    target: &Target,
    lines: &[String],
    unrecorded: Option<String>,
) -> Markup {
    frame(
        page,
        "/dead-letters",
        &format!("{action}: done"),
        html! {
            p { code { (target.describe()) } ":" }
            pre { @for line in lines { (line) "\n" } }
            @if let Some(why) = unrecorded { p.error { "The audit row could not be completed: " (why) } }
            p { a href=(format!("{PREFIX}/dead-letters")) { "back to the dead letters" } " · " a href=(format!("{PREFIX}/audit")) { "audit list" } }
        },
    )
}

pub(super) fn queues(page: &Page<'_>, lines: &[String], failed: Option<String>) -> Markup {
    frame(
        page,
        "/queues",
        "Queues & streams",
        html! {
            p.muted { "As " code { (page.app) " status" } " prints it: each queue's ready messages, consumers, dead letters and waiting retries; \
                       each stream's end, and each handler's stored offset, lag (messages) and owner." }
            pre { @for line in lines { (line) "\n" } }
            @if let Some(why) = failed { p.error { (why) } }
        },
    )
}

fn figure<T>(figure: &Figure<T>, show: impl Fn(&T) -> Markup) -> Markup {
    match figure {
        Ok(value) => show(value),
        Err(why) => html! { span.badge.warn { "unknown" } " " span.muted { (why) } },
    }
}

fn age(seconds: Option<i64>) -> String {
    seconds.map_or("—".to_owned(), |s| human(Duration::from_secs(s.max(0).unsigned_abs())).to_string())
}

pub(super) fn database(
    page: &Page<'_>,
    database: &Database,
    relay_per_minute: Option<f64>,
    brokers: &[String],
    readiness: Option<(Option<String>, String)>,
) -> Markup {
    frame(
        page,
        "/database",
        "Database & outbox",
        html! {
            table { tbody {
                tr { th { "outbox backlog" } td { (figure(&database.outbox, |(rows, oldest)| html! { (rows) " rows due, waiting; the oldest due for " (age(*oldest)) " (the relay's lag)" })) } }
                tr { th { "scheduled" } td { (figure(&database.scheduled, |(rows, next)| html! {
                (rows) " messages scheduled, not yet due"
                @if *rows > 0 { "; the next in " (age(*next)) }
            })) } }
            tr { th { "relay" } td {
                @match relay_per_minute {
                    Some(rate) => { (format!("{rate:.0}")) " messages published per minute over the last minute" },
                    None => span.muted { "— (the relay's rate is on a running service's console)" },
                }
            } }
            tr { th { "outbox failing" } td { (figure(&database.outbox_failing, |(rows, error)| html! {
                    (rows) " rows failed to publish at least once"
                    @if let Some(error) = error { "; last error: " code { (error) } }
                })) } }
                tr { th { "dedup rows" } td { (figure(&database.dedup, |(rows, oldest)| html! { (rows) " rows; oldest " (age(*oldest)) " (" code { "gc --keep" } " or the retention setting deletes old ones)" })) } }
                tr { th { "replication" } td { (figure(&database.replication, |(words, concerns)| html! {
                    (words)
                    @if concerns.is_empty() { " " span.badge.ok { "no concern" } }
                    @for concern in concerns { p.error { (concern) } }
                })) } }
                tr { th { "standbys" } td { (figure(&database.standbys, |standbys| html! {
                    @if standbys.is_empty() { "none streaming" }
                    @for s in standbys {
                        div { b { (s.name) } " " (s.state.as_deref().unwrap_or("?")) ", " (s.sync_state.as_deref().unwrap_or("?")) ", replay lag " (s.replay_lag.as_deref().unwrap_or("—")) }
                    }
                })) } }
            } }
            h2 { "Broker and readiness" }
            p { "Broker addresses (the first that answers is used; passwords hidden): "
                @for (n, address) in brokers.iter().enumerate() { @if n > 0 { ", " } code { (address) } } }

            @match readiness {
                Some((None, report)) => { p { span.badge.ok { "ready" } } pre { (report) } },
                Some((Some(why), report)) => { p { span.badge.bad { "not ready" } " " (why) } pre { (report) } },
                None => p.note { "No runtime in this process: readiness is on a running service's " code { "/readyz" } "." },
            }
        },
    )
}

pub(super) fn audit(page: &Page<'_>, rows: &Figure<Vec<AuditRow>>) -> Markup {
    frame(
        page,
        "/audit",
        "Audit",
        html! {
            p.muted { "Every replay and purge taken on a console, newest first (table " code { "idemq_console_audit" } ")." }
            (figure(rows, |rows| html! {
                @if rows.is_empty() { p.note { "No action taken yet." } }
                @else {
                    table {
                        thead { tr { th { "when" } th { "who" } th { "action" } th { "on" } th { "result" } } }
                        tbody { @for row in rows { tr { td { (row.at) } td { (row.who) } td { (row.action) } td { code { (row.target) } } td { (row.result) } } } }
                    }
                }
            }))
        },
    )
}

pub(super) fn login(page: &Page<'_>, error: Option<&str>) -> Markup {
    frame(
        page,
        "/login",
        "Log in",
        html! {
            @if let Some(error) = error { p.error { (error) } }
            form method="post" action=(format!("{PREFIX}/login")) {
                p { label { "Token " input type="password" name="token" autocomplete="current-password" autofocus; } }
                p { label { "Your name (for the audit list) " input type="text" name="name" autocomplete="username"; } }
                button type="submit" { "Log in" }
            }
            p.muted { "The token is the console's " code { "IDEMQ_CONSOLE_TOKEN" } ". Scripts may send it as " code { "Authorization: Bearer …" } " or as basic auth's password." }
        },
    )
}

pub(super) fn message(page: &Page<'_>, title: &str, text: &str) -> Markup {
    frame(page, "", title, html! { p.note { (text) } })
}

fn truncate(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}
