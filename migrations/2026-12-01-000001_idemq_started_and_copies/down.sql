DROP TABLE IF EXISTS idemq_copies;
DROP TABLE IF EXISTS idemq_started;
