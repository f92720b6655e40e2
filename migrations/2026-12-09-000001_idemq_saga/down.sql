DROP TABLE idemq_saga;
