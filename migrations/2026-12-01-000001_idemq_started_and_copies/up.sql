-- Handler starts of redelivered messages: poison detection that counts only what
-- a handler actually started, not every redelivery the broker counts. A row is
-- written (and committed on its own) before the handler of a redelivered message
-- runs, and deleted once the message has an outcome; a message whose handler
-- started `delivery_limit` times without one is poison.
CREATE TABLE idemq_started (
    handler         text        NOT NULL,
    key             text        NOT NULL,
    starts          integer     NOT NULL,
    last_started_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, key)
);

-- Copies (retry copies and dead letters) confirmed by the broker, by copy id
-- (lineage + attempt). A redelivered original whose copy is recorded here is
-- acked without running its handler again: one lineage, one dead letter.
CREATE TABLE idemq_copies (
    copy_id   text        PRIMARY KEY,
    copied_at timestamptz NOT NULL DEFAULT now()
);

-- Retention (gc) deletes by age.
CREATE INDEX idemq_copies_copied_at ON idemq_copies (copied_at);
