//! Sagas: long-running processes whose every step happens exactly once.
//!
//! A saga is a typed state (serde) in `idemq_saga`, keyed by the saga's name and a
//! correlation key read from each message it takes. Its steps are ordinary
//! `#[idempotent_handler]`s that take a `saga: &mut Saga<S>` argument. For each
//! message, inside the handler's transaction, on its connection:
//!
//! ```text
//! dedup claim ─ new ─> lock the saga's row (SELECT … FOR UPDATE)
//!   │                    ├─ running ─────────────> the handler's fn ─> write the state ─> COMMIT ─> ack
//!   duplicate: acked     ├─ none, `start` ───────> S::default(), new ─┘   (or finish it: kept
//!   (no step runs)       ├─ none ──> missing = retry | dead_letter | ignore     `keep_finished`, its
//!                        └─ finished ─> finished = ignore | dead_letter         timeouts cancelled)
//! ```
//!
//! So a step's state change, what it publishes or schedules (the outbox) and the
//! dedup row of the message that caused it commit together, or not at all: a
//! duplicate or a redelivery runs no step twice, a crash between COMMIT and ack
//! redelivers a message whose dedup row is there, and two consumers racing on one
//! saga's messages take its row lock in turn, each reading what the other wrote
//! (no update is lost). Two starting messages racing are settled by the primary key:
//! the second waits for the first's COMMIT and continues the saga it started.
//!
//! Timeouts are scheduled messages addressed to the saga
//! ([`Saga::schedule`]): written to the outbox with the step, published by the relay
//! when due, taken by one of the saga's handlers like any message; when the saga
//! completes, those still waiting are cancelled in the same transaction.
//!
//! The state is declared with `#[derive(Saga)]`; see the guide's "Sagas and timeouts"
//! chapter for a whole order saga.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::base::observe::SagaStepKind;
use crate::base::outgoing::{Message, PublishError, When};
use crate::handler::context::{Context, SagaRecord};
use crate::handler::key::{Key, KeyError, Metadata};
use crate::handler::HandlerError;
use crate::store::db::{SagaRow, SagaWrite};

pub use idemq_macros::Saga;

/// A saga's state: what `#[derive(Saga)]` implements (with [`Takes`] for each
/// message it takes). Stored as JSON: keep changes to it compatible
/// (`#[serde(default)]` on a new field), as for any stored data.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a saga's state",
    note = "derive it: #[derive(Default, Serialize, Deserialize, idemq::saga::Saga)] with #[saga(name = \"...\", key = \"...\", takes(...))]"
)]
pub trait SagaState: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The saga's name in `idemq_saga` (`#[saga(name = "order")]`): keep it stable.
    const NAME: &'static str;

    /// How long a finished saga is kept (`keep_finished = "7d"`, the default): a
    /// late message finds it finished (`finished = ...` decides) rather than missing.
    /// Zero deletes it when it completes.
    const KEEP_FINISHED: Duration = Duration::from_secs(7 * 86_400);

    /// The names of the message types it takes, for the AsyncAPI document.
    const TAKES: &'static [&'static str] = &[];

    /// The names of the message types its steps send (`sends(..)`), for the
    /// AsyncAPI document.
    const SENDS: &'static [&'static str] = &[];
}

/// A message type `M` the saga takes, and how its correlation key is read from it
/// (`#[saga(key = "order_id")]`, or `takes(M(key = "..."))` for this type): the same
/// key forms as `#[idempotent_handler(key = ...)]`.
#[diagnostic::on_unimplemented(
    message = "the saga `{Self}` does not take `{M}`",
    label = "a step of `{Self}` for a message it does not take",
    note = "list it in the saga's #[saga(takes({M}, ...))]"
)]
pub trait Takes<M>: SagaState {
    /// The key path as written, for error messages.
    const KEY_PATH: &'static str;

    /// The saga's correlation key in `message`.
    ///
    /// # Errors
    /// A missing or unusable key: the message is dead-lettered (kind `key`).
    fn correlate(message: &M, metadata: &Metadata<'_>) -> Result<Key, KeyError>;
}

/// What a step does with a message for a saga that does not exist
/// (`#[idempotent_handler(saga(missing = "..."))]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum IfMissing {
    /// Start it (`saga(start)`): the state is `S::default()` and
    /// [`Saga::is_new`] says so.
    Start,
    /// Retry the message on the handler's retry schedule, then dead-letter it (the
    /// default): a message that overtook the one starting the saga waits for it.
    Retry,
    /// Dead-letter it at once, the reason in its headers.
    DeadLetter,
    /// Ack it without running the step (logged at INFO).
    Ignore,
}

/// What a step does with a message for a saga that has finished and is kept
/// (`#[idempotent_handler(saga(finished = "..."))]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum IfFinished {
    /// Ack it without running the step (the default; logged at INFO): a late
    /// timeout or reply after the end.
    Ignore,
    /// Dead-letter it, the reason in its headers.
    DeadLetter,
}

/// A saga as one of its steps sees it: its state (through `Deref`/`DerefMut`), its
/// key, and what the step may do to it — complete it, schedule a timeout. Written
/// back when the step's fn returns `Ok`, in the same transaction.
#[derive(Debug)]
pub struct Saga<S> {
    key: String,
    state: S,
    version: i64,
    timeouts: Vec<String>,
    /// Timeouts scheduled by this step (still in the context's buffer).
    scheduled_now: Vec<String>,
    completed: bool,
    /// This step's message is one of the saga's timeouts.
    fired: bool,
}

impl<S: SagaState> Saga<S> {
    /// A saga of no table, for unit tests of a step's logic (call the step's fn as
    /// `step::call(..)` with it and a [`Context::standalone`]): `new` as if this step
    /// started it ([`Saga::is_new`]), else as one that took a step before.
    pub fn standalone(key: impl Into<String>, state: S, new: bool) -> Self {
        Self {
            key: key.into(),
            state,
            version: if new { 0 } else { 1 },
            timeouts: Vec::new(),
            scheduled_now: Vec::new(),
            completed: false,
            fired: false,
        }
    }

    /// The saga's name (`#[saga(name = ...)]`).
    pub fn name(&self) -> &'static str {
        S::NAME
    }

    /// The saga's correlation key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// This step started the saga (its state is `S::default()`).
    pub fn is_new(&self) -> bool {
        self.version == 0
    }

    /// The steps it took before this one.
    pub fn version(&self) -> i64 {
        self.version
    }

    /// Completes the saga when this step commits: kept finished for
    /// `keep_finished` (its state as this step leaves it), or deleted if that is
    /// zero; every timeout it scheduled and still waits for is cancelled.
    pub fn complete(&mut self) {
        self.completed = true;
    }

    /// Whether this step completes the saga.
    pub fn is_completed(&self) -> bool {
        self.completed
    }

    /// The message ids of the timeouts it scheduled that have not come yet (the
    /// message of this step removed, if it is one of them).
    pub fn timeouts(&self) -> &[String] {
        &self.timeouts
    }

    /// Schedules `message` for the saga — a timeout — with this step (see
    /// [`Context::schedule`]): published when due, unless the saga completes first
    /// (then it is cancelled with the completing step). Address it to the saga: a
    /// message type it takes, carrying its correlation key. Returns its message id.
    ///
    /// # Errors
    /// As [`Context::schedule`].
    pub fn schedule<M: Message>(
        &mut self,
        ctx: &mut Context,
        message: &M,
        when: impl Into<When>,
    ) -> Result<String, PublishError> {
        let id = ctx.schedule(message, when)?;
        self.timeouts.push(id.clone());
        self.scheduled_now.push(id.clone());
        Ok(id)
    }

    /// The state, as the step leaves it.
    pub fn state(&self) -> &S {
        &self.state
    }

    /// The state, to change.
    pub fn state_mut(&mut self) -> &mut S {
        &mut self.state
    }
}

impl<S> Deref for Saga<S> {
    type Target = S;

    fn deref(&self) -> &S {
        &self.state
    }
}

impl<S> DerefMut for Saga<S> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.state
    }
}

/// Why a step refused a message (dead-lettered, or retried for `missing =
/// "retry"`), as its dead letter's reason says.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SagaError {
    /// No saga with this key.
    #[error(
        "no saga `{saga}` with key `{key}`{why}",
        why = if *.retried { " yet: the message is retried (saga(missing = \"retry\")) and dead-lettered when its retries run out; a message that overtook the one starting the saga waits for it" } else { " (saga(missing = \"dead_letter\")): replay it once the saga exists, or take it with saga(start)" }
    )]
    Missing {
        /// The saga's name.
        saga: &'static str,
        /// The correlation key.
        key: String,
        /// Retried rather than dead-lettered at once.
        retried: bool,
    },
    /// The saga has finished.
    #[error("the saga `{saga}` with key `{key}` has finished (saga(finished = \"dead_letter\"))")]
    Finished {
        /// The saga's name.
        saga: &'static str,
        /// The correlation key.
        key: String,
    },
    /// The stored state does not decode as the saga's type.
    #[error(
        "the stored state of saga `{saga}` with key `{key}` does not decode as {ty}: {source}; \
         keep the state's changes compatible (#[serde(default)] on new fields), or fix the row and replay"
    )]
    State {
        /// The saga's name.
        saga: &'static str,
        /// The correlation key.
        key: String,
        /// The state's Rust type.
        ty: &'static str,
        /// serde's error.
        source: serde_json::Error,
    },
    /// The handler was called with no saga key (an idemq bug, or a handler called
    /// outside the runtime).
    #[error("the step of saga `{saga}` was run without a correlation key (outside idemq's runtime?)")]
    NoKey {
        /// The saga's name.
        saga: &'static str,
    },
}

/// Locks the step's saga and reads it, for the generated handler: `None` when the
/// message is to be acked without running the step. `start` is `S::default` for a
/// starting step.
#[doc(hidden)]
pub async fn __begin<S: SagaState>(
    conn: &mut AsyncPgConnection,
    ctx: &mut Context,
    if_missing: IfMissing,
    if_finished: IfFinished,
    start: Option<fn() -> S>,
) -> Result<Option<Saga<S>>, HandlerError> {
    let saga = S::NAME;
    let key = ctx.saga_key().ok_or(HandlerError::permanent(SagaError::NoKey { saga }))?.to_owned();
    let start = if if_missing == IfMissing::Start { start } else { None };
    let row = crate::store::db::lock_saga(conn, saga, &key, start.is_some()).await?;
    let Some(SagaRow { state, version, mut timeouts, finished }) = row else {
        return match if_missing {
            IfMissing::Ignore | IfMissing::Start => {
                crate::base::log::info!(saga, %key, handler = ctx.handler(), "no such saga: the message is acked without the step (saga(missing = \"ignore\"))");
                ctx.record_saga_step(ignored(saga));
                Ok(None)
            }
            IfMissing::Retry => Err(HandlerError::transient(SagaError::Missing { saga, key, retried: true })),
            IfMissing::DeadLetter => {
                Err(HandlerError::permanent(SagaError::Missing { saga, key, retried: false }))
            }
        };
    };
    if finished {
        return match if_finished {
            IfFinished::Ignore => {
                crate::base::log::info!(saga, %key, handler = ctx.handler(), "the saga has finished: the message is acked without the step (saga(finished = \"ignore\"))");
                ctx.record_saga_step(ignored(saga));
                Ok(None)
            }
            IfFinished::DeadLetter => Err(HandlerError::permanent(SagaError::Finished { saga, key })),
        };
    }
    // A timeout that came is no longer waited for.
    let waiting = timeouts.len();
    if let Some(delivered) = ctx.message_id() {
        timeouts.retain(|id| id != delivered);
    }
    let fired = timeouts.len() < waiting;
    let state = match (version, start) {
        (0, Some(new)) => new(),
        _ => serde_json::from_str(&state).map_err(|source| {
            HandlerError::permanent(SagaError::State {
                saga,
                key: key.clone(),
                ty: std::any::type_name::<S>(),
                source,
            })
        })?,
    };
    Ok(Some(Saga { key, state, version, timeouts, scheduled_now: Vec::new(), completed: false, fired }))
}

/// The record of a message acked without its step.
fn ignored(saga: &'static str) -> SagaRecord {
    SagaRecord { saga, kind: SagaStepKind::Ignored, scheduled: 0, cancelled: 0, fired: false }
}

/// Writes the step's saga back, for the generated handler, once its fn returned `Ok`.
#[doc(hidden)]
pub async fn __end<S: SagaState>(
    conn: &mut AsyncPgConnection,
    ctx: &mut Context,
    saga: Saga<S>,
) -> Result<(), HandlerError> {
    let state = serde_json::to_string(&saga.state).map_err(HandlerError::permanent)?;
    let scheduled = u32::try_from(saga.scheduled_now.len()).unwrap_or(u32::MAX);
    let (write, kind) = if saga.completed {
        // Timeouts scheduled by this very step are still in the context's buffer.
        ctx.unpublish(&saga.scheduled_now);
        let earlier: Vec<String> =
            saga.timeouts.iter().filter(|id| !saga.scheduled_now.contains(id)).cloned().collect();
        (
            SagaWrite::Finished { state: &state, keep: S::KEEP_FINISHED, timeouts: earlier },
            SagaStepKind::Completed,
        )
    } else {
        let kind = if saga.version == 0 { SagaStepKind::Started } else { SagaStepKind::Advanced };
        (SagaWrite::Running { state: &state, timeouts: &saga.timeouts }, kind)
    };
    let cancelled = crate::store::db::write_saga(conn, S::NAME, &saga.key, write).await?;
    let cancelled = u32::try_from(cancelled).unwrap_or(u32::MAX) + if saga.completed { scheduled } else { 0 };
    ctx.record_saga_step(SagaRecord {
        saga: S::NAME,
        kind,
        scheduled: if saga.completed { 0 } else { scheduled },
        cancelled,
        fired: saga.fired,
    });
    Ok(())
}
