ALTER TABLE idemq_outbox DROP COLUMN due_at;
