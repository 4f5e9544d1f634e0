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

-- Copies: the database whose events these are (see sql/schema.sql). 0.5.0
-- served one database, outbox.database: that one is the original. Another
-- may be a copy made under 0.5.0, whose events were never sent from it:
-- with events to send or confirm it records 0, and waits for
-- outbox_adopt(); with none, its own OID.
CREATE TABLE outbox.installed_in (
    database oid NOT NULL,
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row)
);
INSERT INTO outbox.installed_in (database)
SELECT CASE
         WHEN d.datname OPERATOR(pg_catalog.=) ANY (pg_catalog.string_to_array(
                  pg_catalog.replace(pg_catalog.current_setting('outbox.database', true), ' ', ''), ','))
           OR (NOT EXISTS (SELECT FROM outbox.events AS e WHERE e.status OPERATOR(pg_catalog.=) 'pending')
               AND NOT EXISTS (SELECT FROM outbox.events AS e WHERE e.status OPERATOR(pg_catalog.=) 'processing')
               AND NOT EXISTS (SELECT FROM outbox.events AS e WHERE e.status OPERATOR(pg_catalog.=) 'dispatched')
               AND NOT EXISTS (SELECT FROM outbox.batch_members AS m WHERE m.batch_id IS NULL))
         THEN d.oid
         ELSE 0
       END
  FROM pg_catalog.pg_database AS d
 WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database();

DO $$
BEGIN
    IF (SELECT i.database FROM outbox.installed_in AS i) OPERATOR(pg_catalog.=) 0 THEN
        RAISE WARNING 'outbox_dispatch: database "%" is not outbox.database and holds events to send or confirm: '
                     'taken for a copy, its events are not sent until outbox_adopt() is run in it',
                     pg_catalog.current_database();
    END IF;
END
$$;

COMMENT ON TABLE outbox.installed_in IS
    'The OID of the database CREATE EXTENSION ran in: a copy of it is not dispatched until outbox_adopt().';

-- A copy of a database (CREATE DATABASE ... TEMPLATE) holds the events of
-- the database it copied, sent from there already: its dispatchers send
-- nothing until this makes them the copy's own. Its events pending,
-- processing or dispatched (and unconfirmed) are then sent from here too.
-- Returns whether the database was a copy not yet adopted.
CREATE FUNCTION @extschema@.outbox_adopt() RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE outbox.installed_in AS i
       SET database = d.oid
      FROM pg_catalog.pg_database AS d
     WHERE d.datname = pg_catalog.current_database()
       AND i.database <> d.oid;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM @extschema@.outbox_wake();
    RETURN true;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_adopt() IS
    'In a copy of a database (CREATE DATABASE ... TEMPLATE): send the events it holds from here.';

REVOKE ALL ON FUNCTION @extschema@.outbox_adopt() FROM PUBLIC;
