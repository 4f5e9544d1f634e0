-- outbox_dispatch: the inbox (docs/guides/effects-once.md; src/inbox.rs).
--
-- Delivery is at least once: a task may run twice. A task whose effects are
-- writes to this database claims its message in the transaction that makes
-- them (outbox_inbox_claim(id, consumer)); a second run's claim waits for
-- the first's transaction and finds the message claimed once that commits,
-- or claims it when that rolled back. Effects here happen exactly once;
-- effects elsewhere (an email, another service) stay at least once.

-- Every name below resolves in pg_catalog or is qualified: nothing binds an
-- object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- One row per message and consumer claimed, kept for outbox.inbox_retention
-- (longer than any message may come again: docs/guides/effects-once.md), then
-- deleted by the dispatchers' lifecycle sweeper.
CREATE TABLE outbox.inbox (
    id         uuid NOT NULL,  -- the message: a Celery task id (an event's id)
    consumer   text NOT NULL
               CONSTRAINT inbox_consumer_length CHECK (octet_length(consumer) <= 255),
    claimed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id, consumer)
)
WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02
);

COMMENT ON TABLE outbox.inbox IS
    'Messages claimed by outbox_inbox_claim(): each (id, consumer) once; deleted after outbox.inbox_retention.';

-- The purge, oldest first.
CREATE INDEX inbox_claimed_at_idx ON outbox.inbox (claimed_at);

-- A restored dump keeps what was claimed: a message sent again after the
-- restore is not run twice.
-- extension only: begin (what pg_dump keeps; sql/standalone/ goes without)
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox', '');
-- extension only: end

-- The extension's schema again, for the functions pgrx declares next.
SET LOCAL search_path = @extschema@;
