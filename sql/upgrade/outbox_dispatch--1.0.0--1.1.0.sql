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

-- What a page read past (the transactions behind whose last events it read
-- before its own last): outbox.held_by() finds the page of such an event
-- at once. Pages claimed before the update say nothing; held_by() walks
-- batches_to_idx for theirs, as 1.0.0 did.
ALTER TABLE outbox.batches ADD COLUMN read_past pg_catalog.xid8[];
CREATE INDEX batches_read_past_idx ON outbox.batches USING gin (read_past) WITH (fastupdate = off)
    WHERE read_past IS NOT NULL;

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
AS $$ SELECT unnest('{events_pending_again,events_pending_again_updated,events_pending_again_moved,events_from_writers,events_moving_refused}'::name[]) $$;

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

REVOKE ALL ON FUNCTION outbox.fire_always(smallint) FROM PUBLIC;

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

-- What is written of an event's status is never more than pending, failed
-- or processed: a constraint the planner reads (validated while inserts
-- go on).
ALTER TABLE outbox.log ADD CONSTRAINT events_status_written CHECK (status IN ('pending', 'failed', 'processed')) NOT VALID;
ALTER TABLE outbox.log VALIDATE CONSTRAINT events_status_written;

-- outbox.events read at the speed of the table (sql/events.sql): a batch's place found by
-- outbox.held_by(), inlined where it is called.
-- The page that read past the end of transaction $1's events in line (a
-- transaction its window read behind: outbox.batches.read_past), if any:
-- one at most. GIN is read by bitmap alone, which the dispatchers turn
-- off for their sessions (src/worker/setup.rs): on here, for this query,
-- which has no LIMIT for the planner to walk another index to.
CREATE FUNCTION outbox.read_past(xid pg_catalog.xid8) RETURNS pg_catalog.int8
LANGUAGE sql STABLE STRICT
SET search_path = pg_catalog, pg_temp
SET enable_bitmapscan = on
AS $$
SELECT b.id FROM outbox.batches AS b WHERE b.read_past @> ARRAY[$1]
$$;

-- The batch that read an event in line at ($1, $2): the page of a window
-- that holds its place (the first batch whose last place is at or after
-- it, of the window that read its transaction). No row: none yet (or
-- out of line). Looked for among the first pages from its place in
-- batches_to_idx (where it is, but for the event of a transaction that
-- ran while many others were claimed), then as the page that read past
-- its transaction's end (outbox.read_past()), then walked for (a page
-- claimed before 1.1.0, which did not say what it read past; none yet).
-- Plain SQL with every name qualified and no SET clause, so that a
-- caller inlines it (outbox.batch_of(), and the library's
-- outbox.state_at() when a place is not the last batch's it found).
CREATE FUNCTION outbox.held_by(xid pg_catalog.xid8, event pg_catalog.uuid)
RETURNS TABLE (id pg_catalog.int8, from_xid pg_catalog.xid8, from_id pg_catalog.uuid, to_xid pg_catalog.xid8,
               to_id pg_catalog.uuid, prev pg_catalog.pg_snapshot, target pg_catalog.pg_snapshot,
               marked_at pg_catalog.timestamptz, abandoned_at pg_catalog.timestamptz)
LANGUAGE sql STABLE ROWS 1
AS $$
SELECT h.id, h.from_xid, h.from_id, h.to_xid, h.to_id, h.prev, h.target, h.marked_at, h.abandoned_at
  FROM ((SELECT b.id, b.from_xid, b.from_id, b.to_xid, b.to_id, b.prev, b.target, b.marked_at, b.abandoned_at
           FROM (SELECT c.*
                   FROM outbox.batches AS c
                  WHERE (c.to_xid, c.to_id) OPERATOR(pg_catalog.>=) ($1, $2)
                  ORDER BY c.to_xid, c.to_id
                  LIMIT 16) AS b
          WHERE pg_catalog.pg_visible_in_snapshot($1, b.target)
            AND NOT pg_catalog.pg_visible_in_snapshot($1, b.prev)
            AND ((b.from_xid, b.from_id) OPERATOR(pg_catalog.<) ($1, $2)) IS NOT FALSE
          ORDER BY b.to_xid, b.to_id
          LIMIT 1)
        UNION ALL
        (SELECT b.id, b.from_xid, b.from_id, b.to_xid, b.to_id, b.prev, b.target, b.marked_at, b.abandoned_at
           FROM outbox.batches AS b
          WHERE b.id OPERATOR(pg_catalog.=) outbox.read_past($1)
            AND (b.to_xid, b.to_id) OPERATOR(pg_catalog.>=) ($1, $2)
            AND pg_catalog.pg_visible_in_snapshot($1, b.target)
            AND NOT pg_catalog.pg_visible_in_snapshot($1, b.prev)
            AND ((b.from_xid, b.from_id) OPERATOR(pg_catalog.<) ($1, $2)) IS NOT FALSE)
        UNION ALL
        (SELECT b.id, b.from_xid, b.from_id, b.to_xid, b.to_id, b.prev, b.target, b.marked_at, b.abandoned_at
           FROM outbox.batches AS b
          WHERE (b.to_xid, b.to_id) OPERATOR(pg_catalog.>=) ($1, $2)
            AND pg_catalog.pg_visible_in_snapshot($1, b.target)
            AND NOT pg_catalog.pg_visible_in_snapshot($1, b.prev)
            AND ((b.from_xid, b.from_id) OPERATOR(pg_catalog.<) ($1, $2)) IS NOT FALSE
          ORDER BY b.to_xid, b.to_id
          LIMIT 1)) AS h
 LIMIT 1
$$;

-- Its id; an abandoned batch (its events went back in line, but those
-- with an outcome) only with $3: what became of the event at that place.
CREATE OR REPLACE FUNCTION outbox.batch_of(pending_xid xid8, id uuid, abandoned boolean DEFAULT false) RETURNS bigint
LANGUAGE sql STABLE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT h.id FROM outbox.held_by($1, $2) AS h WHERE $3 OR h.abandoned_at IS NULL
$$;

-- An event written out of line says so to the dispatchers until its
-- transaction ends (a shared advisory lock): their scans of
-- events_due_idx start above what a pinned xmin keeps there
-- (sql/worker/due_bound.sql).
CREATE OR REPLACE FUNCTION @extschema@.outbox_pending_again() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF NEW.available_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() THEN
        IF coalesce(pg_catalog.current_setting('outbox_due.locked_by', true), '') OPERATOR(pg_catalog.<>)
               pg_catalog.pg_current_xact_id()::pg_catalog.text THEN
            FOR attempt IN 1..3 LOOP
                IF pg_catalog.pg_try_advisory_xact_lock_shared(
                       1869968482,
                       (pg_catalog.random() OPERATOR(pg_catalog.*) 2147483647::pg_catalog.float8)::pg_catalog.int4) THEN
                    PERFORM pg_catalog.set_config('outbox_due.locked_by',
                                                  pg_catalog.pg_current_xact_id()::pg_catalog.text, true);
                    EXIT;
                END IF;
            END LOOP;
        END IF;
        IF pg_catalog.current_setting('outbox_due.locked_by', true) OPERATOR(pg_catalog.=)
               pg_catalog.pg_current_xact_id()::pg_catalog.text THEN
            NEW.pending_xid := NULL;
            RETURN NEW;
        END IF;
        RAISE WARNING 'outbox: event % goes in line now, not at %: other sessions hold the advisory locks (1869968482, n) by which this transaction would say that it delays an event',
            NEW.id, NEW.available_at
            USING HINT = 'Revoke CONNECT from PUBLIC on the outbox''s database (docs/operations/security.md).';
    END IF;
    NEW.pending_xid := pg_catalog.pg_current_xact_id();
    RETURN NEW;
END
$$;

-- An update through the view writes every column: only one that changes
-- an event's place puts it in line again.
DROP TRIGGER events_pending_again ON outbox.log;
CREATE TRIGGER events_pending_again
    BEFORE INSERT ON outbox.log
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       AND (NEW.pending_xid IS DISTINCT FROM pg_catalog.pg_current_xact_id()
                            OR NEW.available_at > pg_catalog.clock_timestamp())
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- An update that sets the status (a retry, a release, a DBA's UPDATE
-- ... SET status = 'pending', which sends an event again).
CREATE TRIGGER events_pending_again_updated
    BEFORE UPDATE OF status ON outbox.log
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       AND (NEW.pending_xid IS DISTINCT FROM pg_catalog.pg_current_xact_id()
                            OR NEW.available_at > pg_catalog.clock_timestamp())
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- An update that moves when it falls due or its place: one that leaves
-- them as they were (an edit of its payload through outbox.events, whose
-- rule writes every column but the status) leaves the event where it is.
CREATE TRIGGER events_pending_again_moved
    BEFORE UPDATE OF available_at, pending_xid ON outbox.log
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       AND (OLD.available_at IS DISTINCT FROM NEW.available_at
                            OR OLD.pending_xid IS DISTINCT FROM NEW.pending_xid)
                       AND (NEW.pending_xid IS DISTINCT FROM pg_catalog.pg_current_xact_id()
                            OR NEW.available_at > pg_catalog.clock_timestamp())
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- Also where triggers are off for replication (a logical replication
-- subscriber applying the rows of another server's history).
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again;
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again_updated;
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again_moved;

-- What became of the event at ($1, $2), a place in line the claims have
-- read or not: pending (not read yet, no batch holds it, or its batch was
-- abandoned and it has no outcome), processing, dispatched or processed;
-- and the batch that holds it (NULL: none, or abandoned). In SQL, each
-- call asks outbox.cursor, outbox.held_by() (inlined) and the batch's
-- outcomes; the library
-- replaces both with functions that answer from the last batch each call
-- site found (src/state.rs), and ask only for a place outside it: a
-- statement reads the log mostly in place order, a hundred events a
-- batch. As their caller: a role that reads outbox.events reads
-- outbox.batches and outbox.outcomes.
CREATE FUNCTION outbox.state_at(pending_xid xid8, id uuid) RETURNS outbox.event_status
LANGUAGE sql STABLE STRICT PARALLEL RESTRICTED
SET search_path = pg_catalog, pg_temp
AS $$
SELECT CASE WHEN NOT EXISTS (SELECT FROM outbox.cursor AS c
                              WHERE pg_visible_in_snapshot($1, c.prev)
                                 OR (pg_visible_in_snapshot($1, c.target) AND ($1, $2) <= (c.after_xid, c.after_id)))
            THEN 'pending'
            ELSE coalesce((SELECT CASE WHEN EXISTS (SELECT FROM outbox.outcomes AS o
                                                     WHERE o.batch = h.id AND $2 = ANY (o.events)) THEN 'processed'
                                       WHEN h.abandoned_at IS NOT NULL THEN 'pending'
                                       WHEN h.marked_at IS NULL THEN 'processing'
                                       ELSE 'dispatched' END::outbox.event_status
                             FROM outbox.held_by($1, $2) AS h),
                          'pending')
       END
$$;

CREATE FUNCTION outbox.batch_at(pending_xid xid8, id uuid) RETURNS bigint
LANGUAGE sql STABLE STRICT PARALLEL RESTRICTED
SET search_path = pg_catalog, pg_temp
AS $$ SELECT h.id FROM outbox.held_by($1, $2) AS h WHERE h.abandoned_at IS NULL $$;
-- extension only: begin
CREATE OR REPLACE FUNCTION outbox.state_at(pending_xid xid8, id uuid) RETURNS outbox.event_status
LANGUAGE c STABLE STRICT PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'outbox_state_at';

CREATE OR REPLACE FUNCTION outbox.batch_at(pending_xid xid8, id uuid) RETURNS bigint
LANGUAGE c STABLE STRICT PARALLEL RESTRICTED
AS 'MODULE_PATHNAME', 'outbox_batch_at';
-- extension only: end

-- The events in line that no claim has read yet (outbox.cursor): each
-- range of events_pending_xid_idx from where its unread rows start. A
-- window reads the transactions its `prev` saw in progress (behind), then
-- those from `prev`'s xmax on (fresh), each in (pending_xid, id) order, up
-- to the cursor's position; what its target does not see, a later window
-- reads. A large transaction the window has read is not walked again.
-- As its owner (outbox.status reads it for pg_monitor, which may not read
-- outbox.log): granted to nobody by default.
CREATE VIEW outbox.unread AS
-- Behind: a transaction the target sees and the position passed is read;
-- the one at the position, from there on; any other, whole.
SELECT e.*
  FROM outbox.cursor AS c
 CROSS JOIN LATERAL pg_snapshot_xip(c.prev) AS b(xid)
 CROSS JOIN LATERAL (
       SELECT coalesce(pg_visible_in_snapshot(b.xid, c.target) AND b.xid = c.after_xid, false) AS at_position,
              coalesce(pg_visible_in_snapshot(b.xid, c.target) AND b.xid < c.after_xid, false) AS passed) AS r
  JOIN outbox.log AS e
    ON e.pending_xid = b.xid
   AND (e.pending_xid, e.id) > (b.xid, CASE WHEN r.at_position THEN c.after_id
                                            ELSE '00000000-0000-0000-0000-000000000000'::uuid END)
 WHERE NOT r.passed
   AND e.status = 'pending'
   AND e.key_state IS DISTINCT FROM 'waiting'
UNION ALL
-- Fresh, beyond the position (from prev's xmax while the window is still
-- reading behind, or has not begun).
SELECT e.*
  FROM outbox.cursor AS c
  JOIN outbox.log AS e
    ON (e.pending_xid, e.id)
       > (CASE WHEN c.target IS NOT NULL AND c.after_xid >= pg_snapshot_xmax(c.prev) THEN c.after_xid
               ELSE outbox.xid_before(pg_snapshot_xmax(c.prev)) END,
          CASE WHEN c.target IS NOT NULL AND c.after_xid >= pg_snapshot_xmax(c.prev) THEN c.after_id
               ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END)
 WHERE e.status = 'pending'
   AND e.key_state IS DISTINCT FROM 'waiting'
UNION ALL
-- Fresh, before the position, of transactions the target does not see.
SELECT e.*
  FROM outbox.cursor AS c
 CROSS JOIN LATERAL pg_snapshot_xip(c.target) AS t(xid)
  JOIN outbox.log AS e ON e.pending_xid = t.xid
 WHERE t.xid >= pg_snapshot_xmax(c.prev)
   AND t.xid < c.after_xid
   AND e.status = 'pending'
   AND e.key_state IS DISTINCT FROM 'waiting';

COMMENT ON VIEW outbox.unread IS
    'Events in line that no claim has read yet (outbox.cursor), as outbox.log holds them.';

-- A write to a column of outbox.events that the outbox keeps: what became
-- of the event, or, in an update, its place in line and its key's turn
-- (called by the rules below, which evaluate it only then). A role granted
-- UPDATE on the view (operators: docs/operations/security.md) edits what an
-- event carries, never the order it goes in.
CREATE FUNCTION outbox.refuse_derived(column_ text) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'cannot write column "%" of view "outbox.events": the outbox keeps it (what became of the event, its place in line, its key''s turn)', column_
        USING ERRCODE = 'feature_not_supported',
              HINT = 'outbox_retry() and outbox_resend() send an event again, outbox_skip() passes its key on; outbox.log holds what was written of an event.';
END
$$;

-- Each branch: the row of outbox.log, with what became of it (status_now,
-- deliveries_now: sends so far, batch_now: the batch that sent it, while
-- not abandoned). The statement a caller writes sees the columns of the
-- view alone. It acts as its caller: a role granted SELECT on it reads
-- what it is made of, outbox.log, outbox.unread, outbox.batches,
-- outbox.outcomes and outbox.cursor (docs/operations/security.md).
CREATE OR REPLACE VIEW outbox.events WITH (security_invoker = true) AS
SELECT e.id, e.event_type, e.payload, e.queue, e.task, e.headers, e.priority, e.status_now AS status,
       e.retry_count, e.created_at, e.available_at, e.last_error, e.args, e.expires_at, e.event_id,
       e.subscription_id, e.routed_to, e.deliveries_now AS deliveries, e.pending_xid, e.ordering_key,
       e.key_seq, e.key_state, e.batch_now AS batch
  FROM (
        -- What was written of it: a dead letter, the record of a routed
        -- event (events_failed_idx, events_recorded_idx).
        SELECT l.*, l.status AS status_now, l.deliveries AS deliveries_now, NULL::bigint AS batch_now
          FROM outbox.log AS l
         WHERE l.status <> 'pending'
        UNION ALL
        -- Waiting for its key's turn (events_key_state_idx).
        SELECT l.*, 'pending'::outbox.event_status, l.deliveries, NULL::bigint
          FROM outbox.log AS l
         WHERE l.status = 'pending'
           AND l.key_state = 'waiting'
        UNION ALL
        -- Out of line until due: delayed, backing off (events_due_idx).
        SELECT l.*, 'pending'::outbox.event_status, l.deliveries, NULL::bigint
          FROM outbox.log AS l
         WHERE l.status = 'pending'
           AND l.key_state IS DISTINCT FROM 'waiting'
           AND l.pending_xid IS NULL
        UNION ALL
        -- In line, not read yet (events_pending_xid_idx, from the cursor).
        SELECT u.*, 'pending'::outbox.event_status, u.deliveries, NULL::bigint
          FROM outbox.unread AS u
        UNION ALL
        -- In a batch not marked: being pushed (batches_unmarked_idx, then
        -- each batch's range), but those acknowledged already.
        SELECT l.*, 'processing'::outbox.event_status, l.deliveries + 1, b.id
          FROM outbox.batches AS b
         CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
          JOIN outbox.log AS l ON l.pending_xid = m.pending_xid AND l.id = m.id
         WHERE b.marked_at IS NULL
           AND b.abandoned_at IS NULL
           AND NOT EXISTS (SELECT FROM outbox.outcomes AS o WHERE o.batch = b.id AND l.id = ANY (o.events))
        UNION ALL
        -- Read by a claim: sent, and processed once a worker reports it or
        -- a consumer acknowledges it. (One relation each: an ORDER BY id
        -- LIMIT reads the primary keys in order.)
        SELECT l.*, 'dispatched'::outbox.event_status, l.deliveries + 1, outbox.batch_at(l.pending_xid, l.id)
          FROM outbox.log AS l
         WHERE l.status = 'pending'
           AND l.key_state IS DISTINCT FROM 'waiting'
           AND outbox.state_at(l.pending_xid, l.id) = 'dispatched'
        UNION ALL
        SELECT l.*, 'processed'::outbox.event_status,
               l.deliveries + (outbox.batch_at(l.pending_xid, l.id) IS NOT NULL)::integer,
               outbox.batch_at(l.pending_xid, l.id)
          FROM outbox.log AS l
         WHERE l.status = 'pending'
           AND l.key_state IS DISTINCT FROM 'waiting'
           AND outbox.state_at(l.pending_xid, l.id) = 'processed'
        UNION ALL
        -- Read, but no batch holds it: a row a restore wrote with the
        -- triggers off inside windows read already, until the dispatchers
        -- put it in line (outbox.triggers_off() says one may be there).
        SELECT l.*, 'pending'::outbox.event_status, l.deliveries, NULL::bigint
          FROM outbox.cursor AS c, outbox.log AS l
         WHERE EXISTS (SELECT FROM outbox.triggers_off())
           AND l.status = 'pending'
           AND l.key_state IS DISTINCT FROM 'waiting'
           AND (pg_visible_in_snapshot(l.pending_xid, c.prev)
                OR (pg_visible_in_snapshot(l.pending_xid, c.target)
                    AND (l.pending_xid, l.id) <= (c.after_xid, c.after_id)))
           AND outbox.state_at(l.pending_xid, l.id) = 'pending'
       ) AS e;

COMMENT ON VIEW outbox.events IS
    'Outbox events. Insert with outbox_enqueue() or a plain INSERT; committed rows are dispatched.';

-- Writes through the view are writes of outbox.log, as its owner checks
-- them (a writer is granted the view alone: docs/operations/security.md),
-- with the table's defaults (copied onto the view's columns by
-- sql/api.sql, once the last is set),
-- constraints and triggers, which see the writer as current_user. The
-- columns that say what became of the event (status, deliveries, batch)
-- are not written, and a write that sets one is refused. An update edits
-- what the event carries (event_type, payload, queue, task, headers,
-- priority, args, retry_count, last_error, expires_at; available_at while
-- it is not sent) and refuses the rest: its id, its place in line and its
-- key's turn (pending_xid, ordering_key, key_seq, key_state,
-- subscription_id), what routed it (event_id, routed_to) and when it was
-- made, which the owner writes in outbox.log. A column the outbox writes
-- too is written only where the update changes it: the row it finds
-- after waiting for another's update keeps what that one wrote.
CREATE RULE events_insert AS ON INSERT TO outbox.events DO INSTEAD
INSERT INTO outbox.log (id, event_type, payload, queue, task, headers, priority, retry_count, created_at,
                        available_at, last_error, args, expires_at, event_id, subscription_id, routed_to,
                        pending_xid, ordering_key, key_seq, key_state)
VALUES (NEW.id, NEW.event_type, NEW.payload, NEW.queue, NEW.task, NEW.headers, NEW.priority,
        CASE WHEN NEW.status IS NOT NULL THEN outbox.refuse_derived('status')
             WHEN NEW.deliveries IS NOT NULL THEN outbox.refuse_derived('deliveries')
             WHEN NEW.batch IS NOT NULL THEN outbox.refuse_derived('batch')
             ELSE NEW.retry_count END,
        NEW.created_at, NEW.available_at, NEW.last_error, NEW.args, NEW.expires_at, NEW.event_id,
        NEW.subscription_id, NEW.routed_to, NEW.pending_xid, NEW.ordering_key, NEW.key_seq, NEW.key_state)
RETURNING log.id, log.event_type, log.payload, log.queue, log.task, log.headers, log.priority, log.status,
          log.retry_count, log.created_at, log.available_at, log.last_error, log.args, log.expires_at,
          log.event_id, log.subscription_id, log.routed_to, log.deliveries, log.pending_xid, log.ordering_key,
          log.key_seq, log.key_state, NULL::bigint;

CREATE RULE events_update AS ON UPDATE TO outbox.events DO INSTEAD
UPDATE outbox.log AS l
   SET event_type = NEW.event_type, payload = NEW.payload, queue = NEW.queue, task = NEW.task,
       headers = NEW.headers, priority = NEW.priority, args = NEW.args,
       retry_count = CASE WHEN NEW.id IS DISTINCT FROM OLD.id THEN outbox.refuse_derived('id')
                          WHEN NEW.status IS DISTINCT FROM OLD.status THEN outbox.refuse_derived('status')
                          WHEN NEW.deliveries IS DISTINCT FROM OLD.deliveries THEN outbox.refuse_derived('deliveries')
                          WHEN NEW.batch IS DISTINCT FROM OLD.batch THEN outbox.refuse_derived('batch')
                          WHEN NEW.pending_xid IS DISTINCT FROM OLD.pending_xid THEN outbox.refuse_derived('pending_xid')
                          WHEN NEW.ordering_key IS DISTINCT FROM OLD.ordering_key
                              THEN outbox.refuse_derived('ordering_key')
                          WHEN NEW.key_seq IS DISTINCT FROM OLD.key_seq THEN outbox.refuse_derived('key_seq')
                          WHEN NEW.key_state IS DISTINCT FROM OLD.key_state THEN outbox.refuse_derived('key_state')
                          WHEN NEW.subscription_id IS DISTINCT FROM OLD.subscription_id
                              THEN outbox.refuse_derived('subscription_id')
                          WHEN NEW.event_id IS DISTINCT FROM OLD.event_id THEN outbox.refuse_derived('event_id')
                          WHEN NEW.routed_to IS DISTINCT FROM OLD.routed_to THEN outbox.refuse_derived('routed_to')
                          WHEN NEW.created_at IS DISTINCT FROM OLD.created_at THEN outbox.refuse_derived('created_at')
                          WHEN NEW.available_at IS DISTINCT FROM OLD.available_at
                               AND OLD.status IN ('processing', 'dispatched', 'processed')
                              THEN outbox.refuse_derived('available_at')
                          WHEN NEW.retry_count IS DISTINCT FROM OLD.retry_count THEN NEW.retry_count
                          ELSE l.retry_count END,
       available_at = CASE WHEN NEW.available_at IS DISTINCT FROM OLD.available_at THEN NEW.available_at
                           ELSE l.available_at END,
       last_error = CASE WHEN NEW.last_error IS DISTINCT FROM OLD.last_error THEN NEW.last_error
                         ELSE l.last_error END,
       expires_at = CASE WHEN NEW.expires_at IS DISTINCT FROM OLD.expires_at THEN NEW.expires_at
                         ELSE l.expires_at END
 WHERE l.id = OLD.id
RETURNING l.id, l.event_type, l.payload, l.queue, l.task, l.headers, l.priority,
          outbox.event_status(l.status, l.pending_xid, l.id, l.key_state), l.retry_count, l.created_at,
          l.available_at, l.last_error, l.args, l.expires_at, l.event_id, l.subscription_id, l.routed_to,
          l.deliveries + (outbox.batch_of(l.pending_xid, l.id) IS NOT NULL)::integer, l.pending_xid,
          l.ordering_key, l.key_seq, l.key_state, outbox.batch_of(l.pending_xid, l.id);

CREATE RULE events_delete AS ON DELETE TO outbox.events DO INSTEAD
DELETE FROM outbox.log AS l
 WHERE l.id = OLD.id
RETURNING l.id, l.event_type, l.payload, l.queue, l.task, l.headers, l.priority,
          outbox.event_status(l.status, l.pending_xid, l.id, l.key_state), l.retry_count, l.created_at,
          l.available_at, l.last_error, l.args, l.expires_at, l.event_id, l.subscription_id, l.routed_to,
          l.deliveries + (outbox.batch_of(l.pending_xid, l.id) IS NOT NULL)::integer, l.pending_xid,
          l.ordering_key, l.key_seq, l.key_state, outbox.batch_of(l.pending_xid, l.id);

-- The defaults of outbox.log's columns are those of the view outbox.events
-- (sql/events.sql: a rule's NEW has a view's, not the table's); not those of the columns that say
-- what became of the event, which are never written.
DO $$
DECLARE
    column_ record;
BEGIN
    FOR column_ IN
        SELECT a.attname, pg_get_expr(d.adbin, d.adrelid) AS default_
          FROM pg_attribute AS a
          JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE a.attrelid = 'outbox.log'::regclass
           AND a.attname IN (SELECT v.attname FROM pg_attribute AS v
                              WHERE v.attrelid = 'outbox.events'::regclass AND v.attnum > 0)
           AND a.attname NOT IN ('status', 'deliveries')
    LOOP
        EXECUTE format('ALTER VIEW outbox.events ALTER COLUMN %I SET DEFAULT %s', column_.attname, column_.default_);
    END LOOP;
END
$$;

CREATE OR REPLACE VIEW outbox.status AS
WITH waiting AS (
    -- In line, not read yet.
    SELECT u.created_at, u.available_at FROM outbox.unread AS u
    UNION ALL
    -- Out of line until due.
    SELECT e.created_at, e.available_at
      FROM outbox.log AS e
     WHERE e.pending_xid IS NULL
       AND e.status = 'pending'
       AND e.key_state IS DISTINCT FROM 'waiting'
), exact AS (
    SELECT 'pending'::outbox.event_status AS status, pg_catalog.count(*) AS count,
           pg_catalog.min(w.created_at) AS oldest_created_at,
           coalesce(pg_catalog.now() - pg_catalog.min(w.available_at)
                        FILTER (WHERE w.available_at <= pg_catalog.now()),
                    interval '0') AS lag
      FROM waiting AS w
    UNION ALL
    SELECT 'processing', coalesce(pg_catalog.sum(b.events), 0)::bigint, NULL, NULL
      FROM outbox.batches AS b WHERE b.marked_at IS NULL AND b.abandoned_at IS NULL
    UNION ALL
    SELECT 'failed', pg_catalog.count(*), pg_catalog.min(e.created_at), NULL
      FROM outbox.log AS e WHERE e.status = 'failed'
), reported AS (
    -- The outcome rows as stored, with how many events they hold up to
    -- each (read as far as the first that takes them over 1000).
    SELECT o.events,
           pg_catalog.sum(pg_catalog.cardinality(o.events)) OVER (ROWS UNBOUNDED PRECEDING) AS events_so_far
      FROM outbox.outcomes AS o
), beyond AS (
    SELECT r.events_so_far FROM reported AS r WHERE r.events_so_far > 1000 LIMIT 1
), finished AS (
    -- Processed: the events of the outcome rows, exactly while they are at
    -- most 1000 (each once, though a row of a rotation's move may repeat
    -- one until its generation is truncated), plus those stored processed.
    SELECT (SELECT pg_catalog.count(*)
              FROM (SELECT FROM outbox.batches AS b WHERE b.marked_at IS NOT NULL LIMIT 1001) AS f) AS batches,
           coalesce((SELECT b.events_so_far FROM beyond AS b),
                    (SELECT pg_catalog.count(DISTINCT x.id)
                       FROM reported AS r CROSS JOIN LATERAL pg_catalog.unnest(r.events) AS x(id)))
           + (SELECT pg_catalog.count(*)
                FROM (SELECT FROM outbox.log AS e WHERE e.status = 'processed' LIMIT 1001) AS f) AS processed
), sent AS (
    -- Exact while small: the members of the marked batches without an
    -- outcome.
    SELECT pg_catalog.count(*) AS dispatched
      FROM outbox.batches AS b
     CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
     WHERE b.marked_at IS NOT NULL
       AND (SELECT f.batches FROM finished AS f) <= 1000
       -- The outcomes of those batches read once, into a hash
       -- (sql/worker/settle_reported.sql).
       AND (b.id, m.id) NOT IN (SELECT o.batch, r.id
                                  FROM outbox.outcomes AS o CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
                                 WHERE o.batch IN (SELECT b.id FROM outbox.batches AS b WHERE b.marked_at IS NOT NULL)
                                   AND r.id IS NOT NULL)
), estimate AS (
    -- Finished: outbox.log's rows less those counted; processed: those
    -- with an outcome (outbox.outcome_events_estimate()).
    SELECT GREATEST((SELECT pg_catalog.sum(GREATEST(c.reltuples, 0))::bigint
                       FROM pg_catalog.pg_partition_tree('outbox.log'::pg_catalog.regclass) AS p
                       JOIN pg_catalog.pg_class AS c ON c.oid = p.relid
                      WHERE p.isleaf)
                    - (SELECT pg_catalog.sum(x.count) FROM exact AS x)::bigint, 0) AS finished,
           outbox.outcome_events_estimate() AS processed
)
SELECT status, count, oldest_created_at, pg_catalog.now() - oldest_created_at AS age, lag,
       false AS estimated
  FROM exact
UNION ALL
SELECT 'dispatched',
       CASE WHEN f.batches <= 1000 THEN (SELECT s.dispatched FROM sent AS s)
            ELSE GREATEST(e.finished - GREATEST(e.processed, f.processed), 0) END,
       NULL, NULL, NULL, f.batches > 1000
  FROM finished AS f, estimate AS e
UNION ALL
SELECT 'processed',
       CASE WHEN f.processed <= 1000 THEN f.processed ELSE GREATEST(e.processed, f.processed) END,
       NULL, NULL, NULL, f.processed > 1000
  FROM finished AS f, estimate AS e
 ORDER BY status;

-- A reader of outbox.events reads what it is made of (it acts as its
-- caller): each role granted SELECT on it is granted SELECT on
-- outbox.unread, outbox.batches, outbox.outcomes and outbox.cursor too.
DO $$
DECLARE
    grant_ record;
BEGIN
    FOR grant_ IN
        SELECT a.grantee, a.is_grantable
          FROM pg_catalog.pg_class AS c
         CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS a
         WHERE c.oid OPERATOR(pg_catalog.=) 'outbox.events'::pg_catalog.regclass
           AND a.grantee OPERATOR(pg_catalog.<>) c.relowner
           AND a.privilege_type OPERATOR(pg_catalog.=) 'SELECT'
    LOOP
        EXECUTE pg_catalog.format('GRANT SELECT ON outbox.unread, outbox.batches, outbox.outcomes, outbox.cursor TO %s%s',
                                  CASE WHEN grant_.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                       ELSE grant_.grantee::pg_catalog.regrole::pg_catalog.text END,
                                  CASE WHEN grant_.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$$;

-- Sending again and discarding events by filter.
-- Refuses a caller that is not the outbox's owner, naming the function
-- it called (an invoker's statement on the log would be refused before it
-- runs, in PostgreSQL's words, which name no owner).
CREATE FUNCTION outbox.only_owner(caller text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user, outbox.owner(), 'USAGE') THEN
        RAISE EXCEPTION '%: only the outbox''s owner (role %) may, not role %', caller, outbox.owner()::regrole,
            current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END
$$;

-- The events outbox_resend() and outbox_discard() act on: those of
-- outbox.events with `status` (or any of `statuses` when NULL) that the
-- given filters name, oldest first, up to `max_events`: ids, and the
-- positions of their rows. Only the filters given are written into the
-- statement, so that it reads the indexes they allow (each status its
-- own: sql/events.sql). Refuses, naming the argument and its limit, a call
-- that names no event, a status the caller cannot act on, and a bound out
-- of range.
CREATE FUNCTION outbox.chosen(caller text, statuses outbox.event_status[], ids uuid[], queue text, task text,
                              event_type text, status outbox.event_status, created_after timestamptz,
                              created_before timestamptz, max_events integer)
RETURNS TABLE (id uuid, generation smallint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    filters text[] := '{}';
BEGIN
    IF num_nonnulls(ids, queue, task, event_type, status, created_after, created_before) = 0 THEN
        RAISE EXCEPTION '%: name the events: ids, queue, task, event_type, status, created_after or created_before',
            caller
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF status IS NOT NULL AND NOT status = ANY (statuses) THEN
        RAISE EXCEPTION '%: status is %, it must be one of %', caller, status, array_to_string(statuses, ', ')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF max_events IS NULL OR max_events < 1 OR max_events > 100000 THEN
        RAISE EXCEPTION '%: max_events is %, it must be 1 to 100000 (call again for more)', caller,
            coalesce(max_events::text, 'null')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF ids IS NOT NULL THEN filters := array_append(filters, 'e.id = ANY ($1)'); END IF;
    IF queue IS NOT NULL THEN filters := array_append(filters, 'e.queue = $2'); END IF;
    IF task IS NOT NULL THEN filters := array_append(filters, 'coalesce(e.task, e.event_type) = $3'); END IF;
    IF event_type IS NOT NULL THEN filters := array_append(filters, 'e.event_type = $4'); END IF;
    IF created_after IS NOT NULL THEN filters := array_append(filters, 'e.created_at >= $6'); END IF;
    IF created_before IS NOT NULL THEN filters := array_append(filters, 'e.created_at < $7'); END IF;
    RETURN QUERY EXECUTE
        'SELECT e.id, l.generation FROM outbox.events AS e JOIN outbox.log AS l ON l.id = e.id '
        || 'WHERE e.status = ANY ($5) AND ' || array_to_string(array_append(filters, 'true'), ' AND ')
        || ' ORDER BY e.created_at, e.id LIMIT $8'
        USING ids, queue, task, event_type, CASE WHEN status IS NULL THEN statuses ELSE ARRAY[status] END,
              created_after, created_before, max_events;
END
$$;

-- Sends again up to `max_events` events already sent or dead-lettered
-- (dispatched, processed, failed) that the filters name: each back in
-- line now, with its retries reset and its sends counted, and a
-- last_error that says who sent it again; one of a key whose key went on
-- without it takes a new turn behind the key's events (as outbox_retry()),
-- a head its key waits for is sent again as its head. The outbox's owner
-- alone; logged. Returns how many; call again while it returns
-- max_events. What is pending or processing is on its way already.
CREATE FUNCTION @extschema@.outbox_resend(
    ids            uuid[] DEFAULT NULL,
    queue          text DEFAULT NULL,
    task           text DEFAULT NULL,
    event_type     text DEFAULT NULL,
    status         outbox.event_status DEFAULT NULL,
    created_after  timestamptz DEFAULT NULL,
    created_before timestamptz DEFAULT NULL,
    max_events     integer DEFAULT 1000
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    chosen record;
    resent bigint := 0;
BEGIN
    PERFORM outbox.only_owner('outbox_resend');
    -- One at a time, oldest first: those of a key take their new turns in
    -- the order they were enqueued.
    FOR chosen IN
        SELECT c.id, c.generation
          FROM outbox.chosen('outbox_resend', '{dispatched,processed,failed}', outbox_resend.ids, outbox_resend.queue, outbox_resend.task, outbox_resend.event_type,
                             outbox_resend.status, outbox_resend.created_after, outbox_resend.created_before, outbox_resend.max_events) AS c
    LOOP
        UPDATE outbox.log AS e
           SET status = 'pending',
               retry_count = 0,
               available_at = clock_timestamp(),
               -- Out of its batch: its send counted, its place taken anew
               -- (the trigger puts it in line as this transaction's).
               deliveries = e.deliveries + (outbox.batch_of(e.pending_xid, e.id) IS NOT NULL)::integer,
               pending_xid = NULL,
               key_seq = CASE WHEN e.key_state IS NULL THEN NULL ELSE e.key_seq END,
               last_error = format('sent again by outbox_resend() (role %s, %s)', current_user, now())
         WHERE e.id = chosen.id
           AND e.generation = chosen.generation;
        resent := resent + 1;
    END LOOP;
    RAISE LOG 'outbox_resend: role % sent % events again (ids %, queue %, task %, event_type %, status %, created % to %)',
        current_user, resent, ids, queue, task, event_type, status, created_after, created_before;
    IF resent > 0 THEN
        PERFORM @extschema@.outbox_wake();
    END IF;
    RETURN resent;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_resend(uuid[], text, text, text, outbox.event_status, timestamptz, timestamptz, integer) IS
    'Send again up to max_events events already sent or dead-lettered that the filters name (the outbox''s owner alone).';

-- Deletes up to `max_events` events not sent yet, or dead-lettered
-- (pending, failed), that the filters name: they are never sent. A key
-- whose head goes passes to the event behind it within seconds (the
-- dispatchers' sweep of keys). The outbox's owner alone; logged, since
-- nothing of the events is left. Returns how many; call again while it
-- returns max_events. What is processing is being pushed: not taken. A
-- claim reads the events it takes without writing them: the discard locks
-- the rows it chose (SKIP LOCKED: one another session holds is left for
-- the next call), then takes the claims' turn (outbox.claim_turn, as
-- sql/worker/lock_cursor.sql does; rows, then the turn, the order a
-- dispatcher takes them in), so that its delete reads what every claim
-- that committed took, and deletes only what is still pending or failed.
-- In READ COMMITTED alone, where each statement reads what committed
-- before it. No claim runs until its transaction ends.
CREATE FUNCTION @extschema@.outbox_discard(
    ids            uuid[] DEFAULT NULL,
    queue          text DEFAULT NULL,
    task           text DEFAULT NULL,
    event_type     text DEFAULT NULL,
    status         outbox.event_status DEFAULT NULL,
    created_after  timestamptz DEFAULT NULL,
    created_before timestamptz DEFAULT NULL,
    max_events     integer DEFAULT 1000
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    locked_ids uuid[];
    locked_generations smallint[];
    discarded bigint;
BEGIN
    PERFORM outbox.only_owner('outbox_discard');
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'outbox_discard: the transaction is %, it must be read committed', current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'A snapshot taken before a claim committed would delete an event being pushed.';
    END IF;
    SELECT array_agg(l.id), array_agg(l.generation)
      INTO locked_ids, locked_generations
      FROM (SELECT l.id, l.generation
              FROM outbox.chosen('outbox_discard', '{pending,failed}', outbox_discard.ids, outbox_discard.queue,
                                 outbox_discard.task, outbox_discard.event_type, outbox_discard.status,
                                 outbox_discard.created_after, outbox_discard.created_before,
                                 outbox_discard.max_events) AS c
              JOIN outbox.log AS l ON l.id = c.id AND l.generation = c.generation
               FOR UPDATE OF l SKIP LOCKED) AS l;
    PERFORM FROM outbox.claim_turn FOR UPDATE;
    WITH gone AS (
        DELETE FROM outbox.log AS e
         USING unnest(locked_ids, locked_generations) AS k(id, generation)
         WHERE e.id = k.id
           AND e.generation = k.generation
           AND outbox.event_status(e.status, e.pending_xid, e.id, e.key_state) IN ('pending', 'failed')
        RETURNING e.id
    )
    SELECT count(*) INTO discarded FROM gone;
    RAISE LOG 'outbox_discard: role % discarded % events (ids %, queue %, task %, event_type %, status %, created % to %)',
        current_user, discarded, ids, queue, task, event_type, status, created_after, created_before;
    RETURN discarded;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_discard(uuid[], text, text, text, outbox.event_status, timestamptz, timestamptz, integer) IS
    'Delete up to max_events events not sent yet, or dead-lettered, that the filters name (the outbox''s owner alone).';

REVOKE ALL ON FUNCTION
    @extschema@.outbox_resend(uuid[], text, text, text, outbox.event_status, timestamptz, timestamptz, integer),
    @extschema@.outbox_discard(uuid[], text, text, text, outbox.event_status, timestamptz, timestamptz, integer)
    FROM PUBLIC;

-- Whether the batch that sent an event awaits acknowledgements
-- (sql/schema.sql): what pg_dump keeps of what was sent, whatever
-- outbox.ack_timeout says when it runs.
CREATE FUNCTION outbox.awaits_ack(pending_xid xid8, id uuid) RETURNS boolean
LANGUAGE sql STABLE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT coalesce((SELECT b.awaits_ack FROM outbox.batches AS b WHERE b.id OPERATOR(pg_catalog.=) outbox.batch_of($1, $2)),
                false)
$$;
-- extension only: begin
DO $$
DECLARE
    partition_ pg_catalog.regclass;
BEGIN
    FOR partition_ IN SELECT p.relid FROM pg_catalog.pg_partition_tree('outbox.log') AS p WHERE p.isleaf LOOP
        PERFORM pg_catalog.pg_extension_config_dump(partition_,
            'WHERE status OPERATOR(pg_catalog.<>) ''pending'' '
            'OR outbox.event_status(status, pending_xid, id, key_state) OPERATOR(pg_catalog.=) '
            'ANY (ARRAY[''pending'', ''processing'']::outbox.event_status[]) '
            'OR (outbox.event_status(status, pending_xid, id, key_state) OPERATOR(pg_catalog.=) '
            '''dispatched''::outbox.event_status AND outbox.awaits_ack(pending_xid, id))');
    END LOOP;
END
$$;
-- extension only: end

-- 1.0.0's docs granted operators UPDATE on outbox.log; 1.1.0's grant them
-- UPDATE on outbox.events, which edits what an event carries and refuses
-- its place in line and its key's turn (sql/events.sql). An UPDATE of the
-- table writes those: no role but the owner keeps it, each one named in a
-- WARNING (docs/operations/upgrades.md). Every such grant comes from the
-- owner's (a superuser's GRANT is recorded as the owner's): revoking those
-- with CASCADE takes what their holders granted on. INSERT stays: a row a
-- writer inserts takes its turn afresh (sql/keys.sql) and one that copies
-- an id is refused unsent (sql/worker/reused.sql).
DO $$
DECLARE
    held record;
BEGIN
    FOR held IN
        SELECT c.oid::pg_catalog.regclass AS relation, g.grantee, pg_catalog.bool_or(g.grantor = c.relowner) AS owners
          FROM pg_catalog.pg_class AS c
          LEFT JOIN pg_catalog.pg_attribute AS a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
         CROSS JOIN LATERAL (SELECT x.grantee, x.grantor, x.privilege_type FROM pg_catalog.aclexplode(c.relacl) AS x
                             UNION ALL
                             SELECT x.grantee, x.grantor, x.privilege_type
                               FROM pg_catalog.aclexplode(a.attacl) AS x) AS g
         WHERE c.oid IN (SELECT p.relid FROM pg_catalog.pg_partition_tree('outbox.log') AS p)
           AND g.privilege_type = 'UPDATE'
           AND g.grantee <> c.relowner
         GROUP BY 1, 2
         ORDER BY 1, 2
    LOOP
        RAISE WARNING 'outbox_dispatch 1.1.0: UPDATE on % revoked from %', held.relation,
            CASE WHEN held.grantee = 0 THEN 'PUBLIC' ELSE pg_catalog.pg_get_userbyid(held.grantee)::pg_catalog.text END
            USING HINT = 'Grant UPDATE on outbox.events instead (docs/operations/security.md).';
        IF held.owners THEN
            EXECUTE pg_catalog.format('REVOKE UPDATE ON %s FROM %s CASCADE', held.relation,
                                      CASE WHEN held.grantee = 0 THEN 'PUBLIC'
                                           ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(held.grantee)) END);
        END IF;
    END LOOP;
END
$$;

-- Operators retry dead letters without a privilege on outbox.log (the
-- update above revokes theirs): the retries run as the owner.
ALTER FUNCTION @extschema@.outbox_retry(uuid) SECURITY DEFINER;
ALTER FUNCTION @extschema@.outbox_retry_failed(interval) SECURITY DEFINER;

-- The extension's schema again, for what follows (as after an install).
SET LOCAL search_path = @extschema@;
