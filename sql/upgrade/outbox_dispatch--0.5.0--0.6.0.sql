-- outbox_dispatch 0.5.0 → 0.6.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- outbox.workers names the database of each dispatcher: one launcher per
-- server serves every database outbox.database covers (README, "Several
-- databases"). The view gains a last column, read from a new function;
-- outbox_workers() stays as it was. Replaced in place: views built on it
-- and its privileges stay.
CREATE FUNCTION @extschema@."outbox_dispatchers"() RETURNS TABLE (
    "worker" INT,
    "pid" INT,
    "state" TEXT,
    "connected" bool,
    "started_at" timestamp with time zone,
    "last_heartbeat" timestamp with time zone,
    "last_error" TEXT,
    "events_dispatched" bigint,
    "broker_persistence" TEXT,
    "database" TEXT
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_dispatchers_wrapper';

CREATE OR REPLACE VIEW outbox.workers AS
SELECT * FROM @extschema@.outbox_dispatchers();

COMMENT ON VIEW outbox.workers IS
    'One row per dispatcher of every database served, then one per database outbox.database names that is not served (state not served, last_error says why).';

REVOKE ALL ON FUNCTION @extschema@.outbox_dispatchers() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_dispatchers() TO pg_monitor;
