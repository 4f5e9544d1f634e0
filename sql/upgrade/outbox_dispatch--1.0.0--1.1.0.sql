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

-- The triggers of outbox.log that fire always, also where triggers are
-- off for replication (events_from_writers in sql/keys.sql; without the
-- library, events_moving_refused in sql/standalone/tail.sql); and the
-- partitions of the log where one does not: a data-only restore with
-- --disable-triggers, or a copy made with the triggers off, leaves them
-- disabled while it writes
-- (disabled: true), then, after its ENABLE TRIGGER ALL, firing for
-- ordinary sessions only. The rows written meanwhile kept the transaction
-- ids they came with, which may lie inside windows the claims have read
-- (sql/worker/reline_restored.sql); until the dispatchers have put them
-- in line and made the triggers fire always again (outbox.fire_always()),
-- the rotation moves and truncates nothing of such a partition.
CREATE FUNCTION outbox.always_firing() RETURNS SETOF name
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT unnest('{events_pending_again,events_from_writers,events_moving_refused}'::name[]) $$;

CREATE FUNCTION outbox.triggers_off() RETURNS TABLE (generation smallint, disabled boolean, pages bigint)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT substr(c.relname, 5)::smallint, bool_or(t.tgenabled = 'D'),
       pg_relation_size(c.oid) / current_setting('block_size')::bigint
  FROM pg_inherits AS i
  JOIN pg_class AS c ON c.oid = i.inhrelid
  JOIN pg_trigger AS t ON t.tgrelid = c.oid
 WHERE i.inhparent = 'outbox.log'::regclass
   AND t.tgname IN (SELECT outbox.always_firing())
   AND t.tgenabled <> 'A'
 GROUP BY c.oid, c.relname
$$;

-- The triggers of generation $1's partition fire always again, as on the
-- log (outbox.triggers_off()).
CREATE FUNCTION outbox.fire_always(generation smallint) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    table_ name;
    trigger_ name;
BEGIN
    FOR table_, trigger_ IN
        SELECT c.relname, t.tgname
          FROM pg_trigger AS t
          JOIN pg_class AS c ON c.oid = t.tgrelid
         WHERE t.tgrelid IN ('outbox.log'::regclass, format('outbox.log_%s', generation)::regclass)
           AND t.tgname IN (SELECT outbox.always_firing())
           AND t.tgenabled <> 'A'
    LOOP
        EXECUTE format('ALTER TABLE ONLY outbox.%I ENABLE ALWAYS TRIGGER %I', table_, trigger_);
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION outbox.always_firing(), outbox.triggers_off(), outbox.fire_always(smallint) FROM PUBLIC;

-- The rotation waits for a restore's rows written with the triggers off.
CREATE OR REPLACE FUNCTION outbox.rotate(retention interval, moves integer, acks boolean,
                              OUT step text, OUT events bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    next_batch CONSTANT bigint := (SELECT coalesce(max(b.id), 0) + 1 FROM outbox.batches AS b);
    current_ smallint;
    oldest smallint;
    now_ outbox.generations;
    old outbox.generations;
BEGIN
    events := 0;
    -- One rotation at a time, whoever runs it; the generation read once
    -- the one before has committed.
    PERFORM FROM outbox.generations AS g ORDER BY g.generation FOR UPDATE;
    current_ := pg_sequence_last_value('outbox.generation'::regclass)::smallint;
    oldest := (current_ + 1) % 3;
    SELECT * INTO now_ FROM outbox.generations AS g WHERE g.generation = current_;
    SELECT * INTO old FROM outbox.generations AS g WHERE g.generation = oldest;
    IF now_.started_at IS NULL THEN
        UPDATE outbox.generations AS g SET started_at = now(), first_batch = next_batch
         WHERE g.generation = current_;
        -- The one it replaced, if that advance did not say so.
        UPDATE outbox.generations AS g SET ended_at = now()
         WHERE g.generation <> current_ AND g.started_at IS NOT NULL AND g.ended_at IS NULL;
        step := 'started';
        RETURN;
    END IF;

    -- Clean: never current since it was truncated, nothing moved out of it
    -- (which leaves dead rows a truncation takes), and nothing in it (a
    -- restore's rows, an insert that named it).
    IF old.started_at IS NULL AND old.moved_xid IS NULL AND NOT old.drained
       AND NOT EXISTS (SELECT FROM outbox.log AS e WHERE e.generation = oldest)
       AND NOT EXISTS (SELECT FROM outbox.outcomes AS o WHERE o.generation = oldest) THEN
        IF now_.started_at > now() - retention / 2 THEN
            RETURN;
        END IF;
        -- Not transactional: should this transaction not commit, the next
        -- step finds the new generation without a start, and starts it.
        PERFORM setval('outbox.generation'::regclass, oldest, true);
        UPDATE outbox.generations AS g
           SET started_at = now(), ended_at = NULL, moved_xid = NULL, drained = false, first_batch = next_batch
         WHERE g.generation = oldest;
        -- After the switch: whatever began before it may still insert
        -- into the generation it read.
        UPDATE outbox.generations AS g SET ended_at = clock_timestamp() WHERE g.generation = current_;
        step := 'advanced';
        RETURN;
    END IF;

    -- Rows in a generation that was never current (a restore's, an insert
    -- that named it): it counts as ended now, and is kept as long.
    IF old.ended_at IS NULL THEN
        UPDATE outbox.generations AS g SET ended_at = now() WHERE g.generation = oldest;
        step := 'ended';
        RETURN;
    END IF;
    IF old.ended_at > now() - retention THEN
        RETURN;
    END IF;
    -- Client sessions and other workers of this database (not autovacuum,
    -- which a TRUNCATE sends away), and prepared transactions, begun before
    -- it ended: they may still insert into it, and their rows are not
    -- visible here until they commit. For the truncation, also any snapshot
    -- that may not see the last moves as committed (its xmin at or before
    -- their transaction): it would find the moved events neither where they
    -- were nor where they went.
    -- A session of a role whose transaction this one may not see (without
    -- pg_read_all_stats: its xact_start and backend_xmin read NULL) may be
    -- as old as any while it is in a transaction (holds its virtual
    -- transaction id's lock, which pg_locks shows every role): the
    -- rotation waits for it too.
    IF EXISTS (SELECT FROM pg_stat_activity AS a
                WHERE a.datname = current_database()
                  AND a.pid <> pg_backend_pid()
                  -- (NULL in the row of a session this role may not see)
                  AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
                  AND (a.xact_start < old.ended_at
                       OR (old.drained AND age(a.backend_xmin) >= age(xid(old.moved_xid)))
                       OR (NOT (pg_has_role('pg_read_all_stats', 'USAGE') OR pg_has_role(a.usesysid, 'USAGE'))
                           AND EXISTS (SELECT FROM pg_locks AS l
                                        WHERE l.pid = a.pid AND l.locktype = 'virtualxid' AND l.granted))))
       OR EXISTS (SELECT FROM pg_prepared_xacts AS p
                   WHERE p.database = current_database()
                     AND p.prepared < old.ended_at) THEN
        step := 'waiting';
        RETURN;
    END IF;

    -- Rows a restore wrote with the triggers off wait for the dispatchers
    -- to find them (outbox.triggers_off()): they may look sent.
    IF EXISTS (SELECT FROM outbox.triggers_off() AS t WHERE t.generation = oldest) THEN
        step := 'waiting';
        RETURN;
    END IF;

    IF NOT old.drained THEN
        events := outbox.move_unfinished(oldest, current_, moves, acks);
        IF events < moves THEN
            -- The members of the oldest generation's batch deliveries go
            -- with them (they are finished: nothing above needed them).
            DELETE FROM outbox.batch_members AS m
             WHERE m.batch_id IS NOT NULL
               AND EXISTS (SELECT FROM outbox.log AS d WHERE d.generation = oldest AND d.id = m.batch_id);
        END IF;
        UPDATE outbox.generations AS g
           SET moved_xid = CASE WHEN events > 0 THEN pg_current_xact_id() ELSE g.moved_xid END,
               drained = events < moves
         WHERE g.generation = oldest;
        step := 'moved';
        RETURN;
    END IF;

    -- Drained: nothing writes it or reads it as it was. Truncated unless
    -- something in it became needed since (an UPDATE made an event pending
    -- again): that is moved, and the truncation waits for whoever may
    -- have seen it where it was.
    EXECUTE format('LOCK TABLE outbox.%I, outbox.%I IN ACCESS EXCLUSIVE MODE',
                   'log_' || oldest, 'outcomes_' || oldest);
    events := outbox.move_unfinished(oldest, current_, moves, acks);
    IF events > 0 THEN
        -- Many (a DBA's UPDATE of old events): drained again, without the
        -- lock.
        UPDATE outbox.generations AS g SET moved_xid = pg_current_xact_id(), drained = events < moves
         WHERE g.generation = oldest;
        step := 'moved';
        RETURN;
    END IF;
    -- The outcomes of the events moved out of it, recorded before the move
    -- or by a statement that did not see it (all of them have ended: the
    -- wait above), follow them, found by the batch that read them at their
    -- position. One that kept its id is recorded again where it went, in
    -- the same batch. One given a new id is out of its batch (its position
    -- changed): it is stored processed.
    PERFORM outbox.record_outcomes(array_agg(r.batch), array_agg(r.moved_to), array_agg(r.id), array_agg(r.at))
       FROM (SELECT DISTINCT ON (m.moved_to, m.id) o.batch, m.moved_to, m.id, o.at
               FROM outbox.moved AS m
               JOIN outbox.log AS e ON e.generation = m.moved_to AND e.id = m.id
               JOIN outbox.outcomes AS o
                 ON o.generation = oldest
                AND o.batch = outbox.batch_of(e.pending_xid, m.event, true)
                AND m.event = ANY (o.events)
              WHERE m.generation = oldest
                AND m.id = m.event
                AND NOT EXISTS (SELECT FROM outbox.outcomes AS t
                                 WHERE t.generation = m.moved_to AND t.batch = o.batch AND m.id = ANY (t.events))
              ORDER BY m.moved_to, m.id, o.at) AS r;
    UPDATE outbox.log AS e
       SET status = 'processed'
      FROM outbox.moved AS m
     WHERE m.generation = oldest
       AND m.id <> m.event
       AND e.generation = m.moved_to
       AND e.id = m.id
       AND e.status = 'pending'
       AND EXISTS (SELECT FROM outbox.outcomes AS o
                    WHERE o.generation = oldest
                      AND o.batch = outbox.batch_of(e.pending_xid, m.event, true)
                      AND m.event = ANY (o.events));
    DELETE FROM outbox.moved AS m WHERE m.generation = oldest;
    -- Its events as the statistics count them, kept by every insert and
    -- delete (a count would read the partition whole).
    events := pg_stat_get_live_tuples(('outbox.log_' || oldest)::regclass);
    EXECUTE format('TRUNCATE outbox.%I, outbox.%I', 'log_' || oldest, 'outcomes_' || oldest);
    UPDATE outbox.generations AS g
       SET started_at = NULL, ended_at = NULL, moved_xid = NULL, drained = false, first_batch = NULL
     WHERE g.generation = oldest;
    step := 'truncated';
END
$$;

-- The extension's schema again, for what follows (as after an install).
SET LOCAL search_path = @extschema@;
