-- Stream consumers: the last offset of each stream a handler applied (or
-- dead-lettered), written in the same transaction as the effects of the messages
-- up to it. A consumer resumes after it; a transaction that finds it moved by
-- another consumer (compare-and-set on the offset it started from) rolls back.
-- -1: nothing applied yet.
CREATE TABLE idemq_stream_offsets (
    handler     text        NOT NULL,
    stream      text        NOT NULL,
    last_offset bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (handler, stream)
);
