-- The dedup table: one row per (handler, key) that was applied.
-- The primary key is the unique index that settles concurrent duplicates:
-- the runtime inserts with ON CONFLICT DO NOTHING RETURNING inside the
-- handler's own transaction, so the row exists if and only if the effect does.
CREATE TABLE idemq_dedup (
    handler      text        NOT NULL,
    key          text        NOT NULL,
    -- SHA-256 of the message body, to tell a true duplicate from the same key
    -- reused with a different payload.
    fingerprint  bytea,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, key)
);

-- Retention (gc) deletes by age.
CREATE INDEX idemq_dedup_processed_at ON idemq_dedup (processed_at);
