-- Replies expire. A reply whose requester is gone (an auto-delete or exclusive
-- reply_to queue goes away with its client) is returned as unroutable on every
-- publish; without an end it would stay in the outbox, retried, for ever. The relay
-- deletes a reply row unpublished once it is older than the relay's reply TTL
-- (from created_at) or past expires_at, whichever comes first. Events are never
-- expired.
--
-- reply: the row is the reply to a request (written by idemq, never by `enqueue`).
-- expires_at: when the request's requester stops waiting, from the request's AMQP
--   `expiration` (the time of its consumption plus that many ms: an upper bound);
--   NULL when the request had none.
--
-- Both columns have defaults: processes still running the previous version keep
-- writing rows that never expire, as they did.
ALTER TABLE idemq_outbox
    ADD COLUMN reply      boolean     NOT NULL DEFAULT false,
    ADD COLUMN expires_at timestamptz;

-- Replies written before this migration, told by what idemq wrote for them (the
-- default exchange, a correlation id, and the status header alone): they expire by
-- the reply TTL, counted from when they were written.
UPDATE idemq_outbox SET reply = true
 WHERE exchange = ''
   AND correlation_id IS NOT NULL
   AND headers IN ('{"x-idemq-status":"ok"}', '{"x-idemq-status":"error"}');
