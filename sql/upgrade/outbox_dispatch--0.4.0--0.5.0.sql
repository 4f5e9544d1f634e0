-- outbox_dispatch 0.4.0 → 0.5.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- The claim keeps its place in (pending_xid, id) order, so that it never
-- walks again the dead entries its earlier claims left (core/src/frontier.rs).
-- No rewrite: rows from before read pending_xid 1, before every position;
-- a dispatcher's first claim after the update sweeps them all.
ALTER TABLE outbox.events ADD COLUMN pending_xid xid8 NOT NULL DEFAULT '1';
ALTER TABLE outbox.events ALTER COLUMN pending_xid SET DEFAULT pg_catalog.pg_current_xact_id();

DROP INDEX outbox.events_pending_idx;
CREATE INDEX events_pending_xid_idx ON outbox.events (pending_xid, id) WHERE status = 'pending';
CREATE INDEX events_pending_idx ON outbox.events (available_at, id) WHERE status = 'pending';

CREATE FUNCTION @extschema@.outbox_pending_again() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    NEW.pending_xid := pg_catalog.pg_current_xact_id();
    RETURN NEW;
END
$$;
CREATE TRIGGER events_pending_again
    BEFORE INSERT OR UPDATE OF status, available_at ON outbox.events
    FOR EACH ROW WHEN (NEW.status = 'pending' AND NEW.pending_xid <> pg_catalog.pg_current_xact_id())
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
REVOKE ALL ON FUNCTION @extschema@.outbox_pending_again() FROM PUBLIC;
