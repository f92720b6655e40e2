-- Back to a bigserial (its sequence, idemq_outbox_id_seq, owned by the column),
-- continuing after every id handed out so far. Roles that insert into the outbox
-- need USAGE on that sequence again.
DO $$
DECLARE
    identity_sequence text := pg_get_serial_sequence('idemq_outbox', 'id');
    last_id bigint;
    next_id bigint;
BEGIN
    LOCK TABLE idemq_outbox IN ACCESS EXCLUSIVE MODE;
    EXECUTE format('SELECT last_value FROM %s', identity_sequence) INTO last_id;
    SELECT greatest(coalesce(max(id), 0), last_id) + 1 INTO next_id FROM idemq_outbox;
    ALTER TABLE idemq_outbox ALTER COLUMN id DROP IDENTITY;
    EXECUTE format('CREATE SEQUENCE idemq_outbox_id_seq OWNED BY idemq_outbox.id START WITH %s', next_id);
    ALTER TABLE idemq_outbox ALTER COLUMN id SET DEFAULT nextval('idemq_outbox_id_seq');
END
$$;
