DROP TABLE idemq_console_audit;
