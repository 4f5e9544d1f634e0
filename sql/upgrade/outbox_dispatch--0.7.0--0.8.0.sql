-- outbox_dispatch 0.7.0 → 0.8.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- The inbox (README, "Effects once"; sql/inbox.sql).

-- One row per message and consumer claimed, kept for outbox.inbox_retention
-- (longer than any message may come again: README, "Effects once"), then
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
SELECT pg_catalog.pg_extension_config_dump('outbox.inbox', '');

CREATE FUNCTION @extschema@."outbox_inbox_claim"(
    "id" uuid,
    "consumer" TEXT DEFAULT ''
) RETURNS bool
VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_inbox_claim_wrapper';

REVOKE ALL ON FUNCTION @extschema@.outbox_inbox_claim(uuid, text) FROM PUBLIC;
