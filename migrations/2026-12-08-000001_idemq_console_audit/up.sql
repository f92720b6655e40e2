-- The operations console's audit list: every action an operator took (replay,
-- purge), who, on what, when, and what came of it. A row is written before the
-- action runs (result 'started') and completed after it: an action whose row
-- cannot be written is refused, so none goes unrecorded.
CREATE TABLE idemq_console_audit (
    id       bigserial   PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    who      text        NOT NULL,
    action   text        NOT NULL,
    target   text        NOT NULL,
    result   text        NOT NULL
);
