//! `declare [--apply] [--missing]`: the topology the code declares, one line per
//! queue (its dead-letter queue and retry wait queues folded in while they exist),
//! then the exchanges and bindings, each checked against the broker with a passive
//! declare; `--apply` declares what is missing, as `run` would.

use crate::common::{connect_broker, exchange_exists, passive_queue, say, CliResult, Out};
use idemq_core::__private::sibling::human;
use idemq_core::__private::sibling::{BuilderPlan as _, QueueText as _};
use idemq_core::RuntimeBuilder;

/// Prints what the topology declares and whether it exists (only what is missing
/// with `only_missing`); with `apply`, declares it.
pub(super) async fn declare(builder: &RuntimeBuilder, apply: bool, only_missing: bool) -> CliResult {
    let connection = connect_broker(builder.configured_amqp_url()).await?;
    let plans = builder.queue_plans();
    let exchanges = builder.exchanges();
    let width = name_width(plans.iter().flat_map(|plan| plan.names()));
    let what_width = plans.iter().map(|plan| plan.queue.describe().len()).max().unwrap_or(0).clamp(40, 72);
    let mut out = Out::new();
    let absent = if apply { "missing: declaring" } else { "missing: would be declared" };
    let (mut missing, mut elsewhere_missing, mut checked) = (0_usize, 0_usize, 0_usize);
    let mut existing = std::collections::HashSet::new();
    for plan in &plans {
        let name = plan.queue.name();
        let exists = passive_queue(&connection, name).await?.is_some();
        checked += 1;
        if exists {
            existing.insert(name.to_owned());
        }
        // Its parts: the dead-letter queue (declared with it) and the wait queues
        // (declared for its consumers), each checked.
        let mut parts = Vec::new();
        if plan.declared_here {
            let what = "its dead-letter queue (a delivery limit no browsing reaches)".to_owned();
            parts.push(("dlq", plan.queue.dead_letter_name().to_owned(), what));
        }
        for (wait, delay) in &plan.waits {
            parts.push(("wait", wait.clone(), format!("retries of {name} after {}", human(*delay))));
        }
        let mut states = Vec::new();
        for (_, part, _) in &parts {
            let there = passive_queue(&connection, part).await?.is_some();
            checked += 1;
            missing += usize::from(!there);
            states.push(there);
        }
        let (what, state) = if plan.declared_here {
            missing += usize::from(!exists);
            (plan.queue.describe(), if exists { "exists".to_owned() } else { absent.to_owned() })
        } else {
            elsewhere_missing += usize::from(!exists);
            let state = if exists {
                "exists"
            } else {
                "missing: idemq never declares it; create it where it is declared"
            };
            ("declared elsewhere (idemq never declares it)".to_owned(), state.to_owned())
        };
        let all_parts = states.iter().all(|there| *there);
        if only_missing && exists && all_parts {
            continue;
        }
        let folded = match (exists && all_parts, plan.declared_here, plan.waits.len()) {
            (false, _, _) | (true, false, 0) => String::new(),
            (true, true, 0) => "; its dead-letter queue exists too".to_owned(),
            (true, dlq, waits) => format!(
                "; {}{waits} retry wait queue{} ({}) exist{} too",
                if dlq { "its dead-letter queue and " } else { "its " },
                if waits == 1 { "" } else { "s" },
                plan.wait_delays(),
                if waits == 1 && !dlq { "s" } else { "" },
            ),
        };
        say!(out, "queue {name:<width$} {what:<what_width$} {state}{folded}");
        if exists && all_parts {
            continue;
        }
        for ((kind, part, what), there) in parts.iter().zip(states) {
            if only_missing && there {
                continue;
            }
            let state = if there { "exists" } else { absent };
            say!(out, "{kind:>5} {part:<width$} {what:<what_width$} {state}");
        }
    }
    let mut exchanges_there = std::collections::HashSet::new();
    for (exchange, kind) in &exchanges {
        let exists = exchange_exists(&connection, exchange).await?;
        checked += 1;
        missing += usize::from(!exists);
        if exists {
            exchanges_there.insert(exchange.clone());
        }
        let state = match exists {
            true if only_missing => continue,
            true => "exists".to_owned(),
            false => format!("{absent} (publishing to it fails until it exists)"),
        };
        say!(out, "exchange {exchange:<w$} {kind:<what_width$} {state}", w = width.saturating_sub(3));
    }
    for (queue, exchange, routing_key) in builder.bindings() {
        let ends_there =
            (exchange.is_empty() || exchanges_there.contains(exchange)) && existing.contains(queue);
        if only_missing && ends_there {
            continue;
        }
        let exchange = if exchange.is_empty() { "(default)" } else { exchange };
        let state = match ends_there {
            // AMQP 0-9-1 has no passive bind: a binding cannot be checked without
            // making it.
            true => "(declared with the topology)",
            false if apply => "(declared with its queue and exchange)",
            false => "(would be declared with its queue and exchange)",
        };
        say!(out, "binding {queue} to exchange {exchange} with routing key '{routing_key}' {state}");
    }
    if apply {
        builder.declare_all(&connection).await?;
        say!(out, "declared ({missing} were missing)");
    } else if missing > 0 {
        say!(out, "{missing} missing; `declare --apply` declares them (`run` does too)");
    } else if elsewhere_missing == 0 {
        say!(
            out,
            "all exist: {} with their dead-letter and retry wait queues ({checked} checked in all), {}",
            count(plans.len(), "queue"),
            count(exchanges.len(), "exchange")
        );
    }
    if elsewhere_missing > 0 {
        say!(out, "{elsewhere_missing} queues declared elsewhere are not there: idemq does not declare them");
    }
    let _ = connection.close(200, "declared".into()).await;
    Ok(())
}

/// The width of the name column: the longest of `names`, within reason.
pub(super) fn name_width<'a>(names: impl Iterator<Item = &'a str>) -> usize {
    names.map(str::len).max().unwrap_or(0).clamp(24, 56)
}

/// `n` things: `1 queue`, `3 queues`.
fn count(n: usize, thing: &str) -> String {
    match n {
        1 => format!("1 {thing}"),
        n => format!("{n} {thing}s"),
    }
}
