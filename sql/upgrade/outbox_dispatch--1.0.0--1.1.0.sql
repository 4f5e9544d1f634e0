-- outbox_dispatch 1.0.0 → 1.1.0 (CHANGELOG.md). Runs with search_path
-- pinned, as every script of the extension: each name below is
-- pg_catalog's or the extension's. `outbox-dispatch install` runs this
-- same file to update an outbox the sidecar installed at 1.0.0, without
-- the regions marked "extension only" (sidecar/src/script.rs), then
-- sql/standalone/updates/1.0.0--1.1.0.sql.
-- extension only: begin
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit
-- extension only: end
SET LOCAL search_path = pg_catalog, pg_temp;

-- A batch says whether what it sent awaits acknowledgements, as they were
-- when it was marked (sql/worker/mark_dispatched.sql): raising
-- outbox.ack_timeout from 0 no longer sends again what went out before.
ALTER TABLE outbox.batches ADD COLUMN awaits_ack boolean NOT NULL DEFAULT false;
CREATE INDEX batches_unacked_idx ON outbox.batches (marked_at)
    WHERE settled_at IS NULL AND awaits_ack;
-- extension only: begin
-- What awaits an acknowledgement now (the setting above 0 where the
-- update runs) keeps awaiting it; the sidecar's own update reads the
-- setting where it keeps it (sql/standalone/updates/).
UPDATE outbox.batches AS b
   SET awaits_ack = true
 WHERE b.settled_at IS NULL AND b.marked_at IS NOT NULL
   AND pg_catalog.current_setting('outbox.ack_timeout', true)::pg_catalog.interval > interval '0';
-- extension only: end
CREATE OR REPLACE FUNCTION outbox.unfinished(generation smallint, acks boolean)
RETURNS TABLE (id uuid)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT e.id FROM outbox.log AS e WHERE e.generation = $1 AND e.status = 'failed'
UNION ALL
SELECT e.id FROM outbox.log AS e WHERE e.generation = $1 AND e.key_state IS NOT NULL AND e.status <> 'failed'
UNION ALL
-- (key_state IS DISTINCT FROM 'waiting' as well: the predicate of the
-- indexes, which the planner does not prove from IS NULL.)
SELECT e.id
  FROM outbox.log AS e
 WHERE e.generation = $1
   AND e.pending_xid IS NULL AND e.status = 'pending'
   AND e.key_state IS DISTINCT FROM 'waiting' AND e.key_state IS NULL
UNION ALL
SELECT e.id
  FROM outbox.cursor AS c
  JOIN outbox.log AS e ON e.pending_xid >= pg_snapshot_xmin(c.prev)
 WHERE e.generation = $1
   AND e.status = 'pending' AND e.key_state IS DISTINCT FROM 'waiting' AND e.key_state IS NULL
   AND NOT pg_visible_in_snapshot(e.pending_xid, c.prev)
UNION ALL
SELECT m.id
  FROM (SELECT b.id, b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id
          FROM outbox.batches AS b
         WHERE b.marked_at IS NULL AND b.abandoned_at IS NULL
        UNION ALL
        SELECT b.id, b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id
          FROM outbox.batches AS b
         WHERE $2 AND b.settled_at IS NULL AND b.awaits_ack) AS b
 CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
 CROSS JOIN LATERAL (SELECT FROM outbox.log AS e, outbox.cursor AS c
                      WHERE e.generation = $1 AND e.id = m.id
                        AND e.status = 'pending' AND e.key_state IS NULL
                        -- Not the set above: read by a claim.
                        AND (e.pending_xid < pg_snapshot_xmin(c.prev) OR pg_visible_in_snapshot(e.pending_xid, c.prev))
                      LIMIT 1) AS e
 -- The outcomes of those batches read once, into a hash
 -- (sql/worker/settle_reported.sql; a lookup per member would read every
 -- outcome row of its batch).
 WHERE (b.id, m.id) NOT IN (SELECT o.batch, r.id
                              FROM outbox.outcomes AS o CROSS JOIN LATERAL unnest(o.events) AS r(id)
                             WHERE o.batch IN (SELECT b.id FROM outbox.batches AS b
                                                WHERE (b.marked_at IS NULL AND b.abandoned_at IS NULL)
                                                   OR ($2 AND b.settled_at IS NULL AND b.awaits_ack))
                               AND r.id IS NOT NULL)
$$;

-- An acknowledgement names the send it acknowledges (sql/ack.sql): the
-- library's outbox_ack(id, send) beside outbox_ack(id); the sidecar's are
-- in sql/standalone/updates/.
-- extension only: begin
CREATE FUNCTION @extschema@."outbox_ack"(
    "id" uuid,
    "send" uuid
) RETURNS bool
STRICT VOLATILE PARALLEL UNSAFE SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_ack_send_wrapper';
REVOKE ALL ON FUNCTION @extschema@.outbox_ack(uuid, uuid) FROM PUBLIC;
-- extension only: end

-- (outbox.owner() was the sidecar's alone.)
-- The role that installed the outbox (the owner of its schema): the
-- extension's owner, or the role that ran `outbox-dispatch install`.
CREATE OR REPLACE FUNCTION outbox.owner() RETURNS oid
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT n.nspowner FROM pg_namespace AS n WHERE n.nspname = 'outbox' $$;

-- A turn is the owner's to give: a row that a role without the owner's
-- privileges inserts (a writer, through outbox.events or outbox_enqueue())
-- with a key_seq or a key_state takes its turn afresh, as one without
-- them does, however large or well placed the one it brings: a writer
-- never puts its event before one committed earlier. The owner's own
-- inserts (a restore, the routing's deliveries) keep theirs when they fit
-- (outbox_turn_fits()). Named to fire before the other insert triggers;
-- the WHEN is evaluated without a function call.
CREATE FUNCTION outbox.writers_take_turns() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user, outbox.owner(), 'USAGE') THEN
        NEW.key_seq := NULL;
        NEW.key_state := NULL;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER events_from_writers
    BEFORE INSERT ON outbox.log
    FOR EACH ROW WHEN (NEW.key_seq IS NOT NULL OR NEW.key_state IS NOT NULL)
    EXECUTE FUNCTION outbox.writers_take_turns();
-- Also where triggers are off for replication.
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_from_writers;
REVOKE ALL ON FUNCTION outbox.writers_take_turns() FROM PUBLIC;

-- The extension's schema again, for what follows (as after an install).
SET LOCAL search_path = @extschema@;
