ALTER TABLE idemq_outbox DROP COLUMN message_type;
