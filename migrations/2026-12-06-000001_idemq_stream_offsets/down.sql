DROP TABLE idemq_stream_offsets;
