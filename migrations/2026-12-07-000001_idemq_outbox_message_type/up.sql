-- The AMQP `type` property an outbox row is published with: a message type's name
-- on the wire (`#[message(type = "...")]`), by which a queue consumed by several
-- handlers routes each delivery to the handler of its type. NULL: no type, as every
-- row written before this migration (and by processes still running the previous
-- version, whose typed sends then go out untyped until they are upgraded).
ALTER TABLE idemq_outbox ADD COLUMN message_type text;
