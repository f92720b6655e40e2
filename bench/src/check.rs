//! Every run's correctness check: the ledger, the contender's own counts, and what
//! was left in the run's queues. Each function returns the problems it found.

use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemq::Handler;
use idemq_example_payments::{accounts, apply_payment};

use crate::child::ChildReport;
use crate::contenders::Events;
use crate::plan::Run;
use crate::workload::{Leftovers, Workload};
use crate::BenchError;

#[derive(QueryableByName)]
struct Rows {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    ledger_rows: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    ledger_payments: i64,
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    dedup_rows: i64,
}

/// Ledger rows = distinct payments (each once), dedup rows = distinct payments, and
/// every account's balance = the sum of its payments.
pub(crate) async fn ledger(
    db: &mut AsyncPgConnection,
    workload: &Workload,
) -> Result<Vec<String>, BenchError> {
    let pattern = format!("{}%", workload.prefix);
    let rows: Rows = diesel::sql_query(
        "SELECT (SELECT count(*) FROM ledger WHERE payment_id LIKE $1) AS ledger_rows, \
                (SELECT count(DISTINCT payment_id) FROM ledger WHERE payment_id LIKE $1) AS ledger_payments, \
                (SELECT count(*) FROM idemq_dedup WHERE handler = $2 AND key LIKE $1) AS dedup_rows",
    )
    .bind::<diesel::sql_types::Text, _>(&pattern)
    .bind::<diesel::sql_types::Text, _>(apply_payment.name())
    .get_result(db)
    .await?;
    let balances: BTreeMap<String, i64> = accounts::table
        .filter(accounts::account.like(&pattern))
        .select((accounts::account, accounts::balance_cents))
        .load::<(String, i64)>(db)
        .await?
        .into_iter()
        .collect();

    let distinct = workload.distinct() as i64;
    let mut issues = Vec::new();
    if rows.ledger_rows != distinct || rows.ledger_payments != distinct {
        issues.push(format!(
            "ledger has {} rows for {} payments, expected {distinct} for {distinct}",
            rows.ledger_rows, rows.ledger_payments
        ));
    }
    if rows.dedup_rows != distinct {
        issues.push(format!("idemq_dedup has {} rows, expected {distinct}", rows.dedup_rows));
    }
    let wrong: Vec<String> = workload
        .balances
        .iter()
        .filter(|&(account, &expected)| balances.get(account) != Some(&expected))
        .map(|(account, expected)| format!("{account}: {:?}, expected {expected}", balances.get(account)))
        .collect();
    if !wrong.is_empty() || balances.len() != workload.balances.len() {
        issues.push(format!(
            "balances wrong: {} of {} accounts ({}), {} accounts found",
            wrong.len(),
            workload.balances.len(),
            wrong.iter().take(3).cloned().collect::<Vec<_>>().join(", "),
            balances.len()
        ));
    }
    Ok(issues)
}

/// The contender's own counts agree with the workload, and nothing was returned,
/// dead-lettered or cut off by shutdown.
pub(crate) fn counts(run: &Run, workload: &Workload, report: &ChildReport) -> Vec<String> {
    let c = &report.counts;
    let mut issues = Vec::new();
    match run.expected_counts(workload) {
        Some((applied, duplicates)) if (c.applied, c.duplicates) != (applied, duplicates) => {
            issues.push(format!(
                "counted {} applied / {} duplicates, expected {applied} / {duplicates}",
                c.applied, c.duplicates
            ))
        }
        None if c.acked != workload.deliveries() => {
            issues.push(format!("acked {}, expected {}", c.acked, workload.deliveries()));
        }
        _ => {}
    }
    if c.failed > 0 {
        issues.push(format!("{} deliveries dead-lettered or otherwise settled", c.failed));
    }
    if c.returned > 0 {
        issues
            .push(format!("{} deliveries returned to the queue (requeued, retried or cut off)", c.returned));
    }
    if !report.drained {
        issues.push("the consumer did not shut down in time after the last delivery; aborted".into());
    }
    issues
}

/// A run with an events queue: one event per distinct payment (the outbox
/// contenders; a relay re-send would add copies, none is expected in a clean run), or
/// one per delivery (the broker's ceiling, which has no dedup).
pub(crate) fn events(left: &Leftovers, workload: &Workload, expected: Option<Events>) -> Vec<String> {
    let (want, per) = match expected {
        Some(Events::PerPayment) => (workload.distinct(), "payments"),
        Some(Events::PerDelivery) => (workload.deliveries(), "deliveries"),
        None => return Vec::new(),
    };
    match left.events {
        Some(events) if u64::from(events) != want => {
            vec![format!("{events} events published for {want} {per}")]
        }
        None => vec!["the events queue was not counted".to_owned()],
        _ => Vec::new(),
    }
}

/// Nothing left in the run's queue, its dead-letter queue or its wait queues.
pub(crate) fn leftovers(left: &Leftovers) -> Vec<String> {
    [
        (left.queue, "left in the queue"),
        (left.dead_letters, "in the DLQ"),
        (left.waiting, "in retry wait queues"),
    ]
    .into_iter()
    .filter(|&(n, _)| n > 0)
    .map(|(n, what)| format!("{n} messages {what}"))
    .collect()
}
