-- Sagas: one row per running (or finished, kept) saga, keyed by the saga's name and
-- its correlation key. A transition locks the row (SELECT ... FOR UPDATE) in the
-- handler's transaction, so its state change, what it publishes or schedules and
-- the dedup row of the message that caused it commit together. `state` is the
-- saga's serde state as JSON; `version` counts the transitions; `timeouts` holds the
-- message ids of the scheduled messages it asked for, cancelled when it completes.
-- A finished saga is kept until `expires_at` (the retention sweep deletes it then),
-- so a late message finds it finished rather than missing.
CREATE TABLE idemq_saga (
    saga text NOT NULL,
    key text NOT NULL,
    state jsonb NOT NULL,
    version bigint NOT NULL DEFAULT 1,
    timeouts text[] NOT NULL DEFAULT '{}',
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    expires_at timestamptz,
    PRIMARY KEY (saga, key)
);

-- `status`: running sagas by name and the oldest.
CREATE INDEX idemq_saga_running ON idemq_saga (saga, started_at) WHERE finished_at IS NULL;
-- The retention sweep.
CREATE INDEX idemq_saga_expires ON idemq_saga (expires_at) WHERE expires_at IS NOT NULL;
