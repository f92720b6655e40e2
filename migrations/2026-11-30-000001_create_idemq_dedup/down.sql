DROP TABLE IF EXISTS idemq_dedup;
