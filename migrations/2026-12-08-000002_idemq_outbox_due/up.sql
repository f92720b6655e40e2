-- Scheduled messages: a row written with a due time (`Outgoing::deliver`,
-- `Context::schedule`) keeps it here, and waits (available_at) until then. NULL: not
-- scheduled, due when written. The relay's lag counts from when a row was due —
-- coalesce(due_at, created_at) — so a message scheduled for tomorrow is no backlog
-- today; available_at alone cannot say it, since a failed publish moves it too.
ALTER TABLE idemq_outbox ADD COLUMN due_at timestamptz;
