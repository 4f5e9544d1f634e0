-- outbox_dispatch 0.5.0 → 0.6.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- outbox.workers names the database of each dispatcher: one launcher per
-- server serves every database outbox.database covers (README, "Several
-- databases"). Its rows change shape, so the view and its function are
-- made again, with the same privileges.
DROP VIEW outbox.workers;
DROP FUNCTION @extschema@.outbox_workers();

CREATE FUNCTION @extschema@.outbox_workers() RETURNS TABLE (
    "database" TEXT,
    "worker" INT,
    "pid" INT,
    "state" TEXT,
    "connected" bool,
    "started_at" timestamp with time zone,
    "last_heartbeat" timestamp with time zone,
    "last_error" TEXT,
    "events_dispatched" bigint,
    "broker_persistence" TEXT
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_workers_wrapper';

CREATE VIEW outbox.workers AS
SELECT * FROM @extschema@.outbox_workers();

COMMENT ON VIEW outbox.workers IS
    'One row per dispatcher of every database served, then one per database outbox.database names that is not served (state not served, last_error says why).';

REVOKE ALL ON FUNCTION @extschema@.outbox_workers() FROM PUBLIC;
GRANT SELECT ON outbox.workers TO pg_monitor;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_workers() TO pg_monitor;
