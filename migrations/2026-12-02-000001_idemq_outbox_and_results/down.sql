ALTER TABLE idemq_dedup DROP COLUMN failed, DROP COLUMN result;
DROP TABLE idemq_outbox;
