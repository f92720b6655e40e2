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
        /// What the handler returned (JSON), or the error reply of a failed request.
        result -> Nullable<Bytea>,
        /// The row records a request's permanent failure (`result`: its error reply).
        failed -> Bool,
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

diesel::table! {
    /// Messages waiting to be published by the relay (deleted once confirmed).
    idemq_outbox (id) {
        /// Commit-time order (a sequence; no order is promised, see the crate docs).
        id -> Int8,
        /// The AMQP `message_id` it is published with.
        message_id -> Text,
        /// The exchange.
        exchange -> Text,
        /// The routing key.
        routing_key -> Text,
        /// The body.
        body -> Bytea,
        /// The AMQP `content_type`.
        content_type -> Nullable<Text>,
        /// The AMQP `correlation_id`.
        correlation_id -> Nullable<Text>,
        /// A JSON object of string headers.
        headers -> Nullable<Text>,
        /// `false`: best effort (direct reply-to), never retried.
        mandatory -> Bool,
        /// Failed publishes so far.
        attempts -> Integer,
        /// When the relay may try it (again).
        available_at -> Timestamptz,
        /// Why the last publish failed.
        last_error -> Nullable<Text>,
        /// When its transaction wrote it.
        created_at -> Timestamptz,
        /// The reply to a request: deleted unpublished once it expires (events never do).
        reply -> Bool,
        /// When a reply's requester stops waiting, from the request's `expiration`
        /// (`None`: it had none). The relay's reply TTL, from `created_at`, applies too.
        expires_at -> Nullable<Timestamptz>,
        /// The AMQP `type` (a message type's name on the wire), if it has one.
        message_type -> Nullable<Text>,
        // `due_at` (a scheduled message's due time, NULL: due when written) is
        // read and written by SQL of its own: diesel's tables stop at 16 columns
        // without a feature that doubles its build.
    }
}
