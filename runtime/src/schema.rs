//! idemq's own tables, as diesel sees them (created by [`migrate`](crate::migrate)).
//! For tests and tools that read them; the runtime is their only writer.

diesel::table! {
    /// One row per (handler scope, key) applied; exists if and only if the effect does.
    idemq_dedup (handler, key) {
        /// The handler's dedup scope: its name, or `<namespace>/<name>`.
        handler -> Text,
        /// The stored key (see [`Key`](crate::Key)).
        key -> Text,
        /// SHA-256 of the canonical payload (see the crate docs, "the same payload").
        fingerprint -> Nullable<Bytea>,
    }
}

diesel::table! {
    /// Handler starts of redelivered messages, committed before the handler runs.
    idemq_started (handler, key) {
        /// The handler's dedup scope.
        handler -> Text,
        /// The stored key.
        key -> Text,
        /// Starts without an outcome so far.
        starts -> Integer,
        /// The latest start.
        last_started_at -> Timestamptz,
    }
}

diesel::table! {
    /// Copies (retry copies, dead letters) the broker confirmed.
    idemq_copies (copy_id) {
        /// The copy's `x-idemq-copy-id`.
        copy_id -> Text,
    }
}
