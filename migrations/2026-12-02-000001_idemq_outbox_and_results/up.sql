-- The transactional outbox: messages written in a handler's transaction (or any
-- application transaction) and published by the relay after COMMIT, with
-- publisher confirms. A row exists until the broker confirmed its message (then it
-- is deleted), so a crash anywhere publishes it again, with the same message_id.
CREATE TABLE idemq_outbox (
    id             bigserial   PRIMARY KEY,
    -- Sent as the AMQP message_id: deterministic inside a handler (handler scope,
    -- input key, index), so a downstream consumer can dedup relay re-sends.
    message_id     text        NOT NULL,
    exchange       text        NOT NULL,
    routing_key    text        NOT NULL,
    body           bytea       NOT NULL,
    content_type   text,
    correlation_id text,
    -- A JSON object of string values, sent as AMQP headers.
    headers        text,
    -- false: best effort (replies to direct reply-to): published once without
    -- `mandatory`, never retried.
    mandatory      boolean     NOT NULL DEFAULT true,
    attempts       integer     NOT NULL DEFAULT 0,
    -- A row that failed to publish waits until then (backoff).
    available_at   timestamptz NOT NULL DEFAULT now(),
    last_error     text,
    created_at     timestamptz NOT NULL DEFAULT now()
);

-- The relay claims rows by availability, oldest first.
CREATE INDEX idemq_outbox_available ON idemq_outbox (available_at, id);

-- Stored results: what the handler returned (JSON), replayed as the reply to a
-- duplicated request. `failed`: the row records a permanent failure of a request
-- (`result` holds the error reply), so a duplicate gets the same error reply.
ALTER TABLE idemq_dedup
    ADD COLUMN result bytea,
    ADD COLUMN failed boolean NOT NULL DEFAULT false;
