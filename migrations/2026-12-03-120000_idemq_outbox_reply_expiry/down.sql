ALTER TABLE idemq_outbox DROP COLUMN expires_at, DROP COLUMN reply;
