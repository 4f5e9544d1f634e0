-- outbox_dispatch: the rotation (docs/operations/retention.md). Space comes back by
-- TRUNCATE of the oldest partition of outbox.log and outbox.outcomes,
-- never by a DELETE of what was delivered: a delivered event is written
-- once, and leaves nothing for vacuum.
--
-- Three generations take turns: rows are inserted in the current one (the
-- column's default, from the sequence outbox.generation); after
-- outbox.retention / 2 the next one, empty, becomes current; the one after
-- that, the oldest, once it ended outbox.retention ago, gives up what is
-- still needed of it (moved to the current generation, a write per row)
-- and is truncated. A finished event is kept at least outbox.retention
-- after its generation ended.

-- Every name below resolves in pg_catalog or is qualified: nothing binds an
-- object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- When each generation became the current one (NULL: never, since it was
-- truncated), stopped being it, the transaction that last moved events out
-- of it, and whether it gave up all it still needed to keep (drained);
-- first_batch:
-- batches from this id on were claimed once it had begun
-- (outbox.forget_batches()). Not dumped: a restore creates the extension,
-- which starts again at generation 0.
CREATE TABLE outbox.generations (
    generation  smallint PRIMARY KEY CHECK (generation BETWEEN 0 AND 2),
    started_at  timestamptz,
    ended_at    timestamptz,
    moved_xid   xid8,
    drained     boolean NOT NULL DEFAULT false,
    first_batch bigint
);
INSERT INTO outbox.generations (generation, started_at, first_batch)
VALUES (0, pg_catalog.now(), 1), (1, NULL, NULL), (2, NULL, NULL);

-- The events moved out of a generation not yet truncated, where they went:
-- an outcome written for one by a statement whose snapshot did not see it
-- move (an acknowledgement, a report) went to the generation it was in,
-- and follows it before the truncation. Emptied with the truncation.
CREATE TABLE outbox.moved (
    event      uuid NOT NULL,
    generation smallint NOT NULL,  -- where it was
    moved_to   smallint NOT NULL,
    id         uuid NOT NULL,      -- its id there (a new one if its own was taken)
    PRIMARY KEY (generation, event)
);

COMMENT ON TABLE outbox.moved IS
    'Events the rotation moved out of a generation not yet truncated, and where they went.';

COMMENT ON TABLE outbox.generations IS
    'The generations of outbox.log: when each became current and ended, which transaction last moved events out, and whether it is drained.';

-- The events of generation $1 still needed, which a truncation of it must
-- not take: dead letters; events holding or waiting for their key's turn;
-- events out of line (delayed, backing off); events in line the claims
-- have not read (the transactions the cursor's `prev` does not see); and
-- events in a batch not marked, or (acknowledgements on, $2) marked while
-- they were on and not settled, without an outcome. Everything else is finished: sent
-- (reported or not), processed, or the record of a routed event. Each set
-- through an index (the dead letters', the keys', the due one, the
-- claim's from `prev`'s xmin on, the batches' in flight), and no event in
-- two of them: read under a LIMIT, they stop at it.
CREATE FUNCTION outbox.unfinished(generation smallint, acks boolean)
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

-- Moves up to $3 of the events of generation $1 still needed to generation
-- $2 (their outcomes follow them at the truncation); returns how many. A
-- moved event keeps everything but its generation, and passes none of the
-- insert triggers (outbox.moving, set for the move alone): it stays in line
-- or out of it, in its batch, with its key's turn. What generation $2 already holds is
-- never refused there, so that the rotation never stops on it (an insert
-- that named a generation of its own, a copy of a row): an event whose id
-- is taken there is moved with a new id, and one whose key's turn is taken
-- (its key_seq, or the key's head) without it, as an event without a key
-- would be (one pending takes a new turn, after the key's others); its
-- last_error says which.
CREATE FUNCTION outbox.move_unfinished(source smallint, target smallint, moves integer, acks boolean) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    moved bigint;
BEGIN
    PERFORM set_config('outbox.moving', 'on', true);
    WITH needed AS (
        SELECT u.id,
               EXISTS (SELECT FROM outbox.log AS t WHERE t.generation = target AND t.id = u.id) AS id_taken,
               EXISTS (SELECT
                         FROM outbox.log AS e
                         JOIN outbox.log AS t
                           ON t.generation = target
                          AND t.ordering_key = e.ordering_key
                          AND coalesce(t.subscription_id, 0) = coalesce(e.subscription_id, 0)
                          AND (t.key_seq = e.key_seq OR (t.key_state = 'head' AND e.key_state = 'head'))
                        WHERE e.generation = source AND e.id = u.id) AS turn_taken
          FROM (SELECT u.id FROM outbox.unfinished(source, acks) AS u LIMIT moves) AS u
    ), carried AS (
        UPDATE outbox.log AS e
           SET generation = target,
               id = CASE WHEN n.id_taken THEN @extschema@.outbox_uuid_v7() ELSE e.id END,
               key_seq = CASE WHEN n.turn_taken THEN NULL ELSE e.key_seq END,
               key_state = CASE WHEN n.turn_taken THEN NULL ELSE e.key_state END,
               last_error = CASE WHEN n.id_taken
                                 THEN format('moved to generation %s with a new id: %s was taken there', target, e.id)
                                 WHEN n.turn_taken
                                 THEN format('moved to generation %s without its turn of key %s: %s was taken there',
                                             target, e.ordering_key, e.key_seq)
                                 ELSE e.last_error
                            END
          FROM needed AS n
         WHERE e.generation = source
           AND e.id = n.id
        RETURNING n.id AS was, e.id
    ), recorded AS (
        INSERT INTO outbox.moved (event, generation, moved_to, id)
        SELECT c.was, source, target, c.id FROM carried AS c
        ON CONFLICT (generation, event) DO UPDATE SET moved_to = excluded.moved_to, id = excluded.id
    )
    SELECT count(*) INTO moved FROM carried;
    PERFORM set_config('outbox.moving', 'off', true);
    RETURN moved;
END
$$;

-- One step of the rotation, in the caller's transaction (each step its own
-- transaction, so that no lock is held for long): what it did, and how
-- many events it truncated. The steps, in the order they come:
--   started    the current generation had no start (after an install, or
--              an advance that did not commit): it starts now;
--   ended      the oldest generation, never current, holds rows (a
--              restore's, an insert that named it): it counts as ended
--              now, and is kept outbox.retention as the others;
--   advanced   the current generation is outbox.retention / 2 old and the
--              next one is empty: the next one is current;
--   waiting    the oldest generation is due, but its triggers are off
--              (a restore's rows, outbox.triggers_off()), or a transaction that began
--              before it ended (one that may still write it) or, once it
--              is drained, a snapshot that may not see the last moves (one
--              that may still read it as it was) is open: the moves or the
--              truncation would take rows from under it;
--   moved      up to $2 events still needed were moved from the oldest
--              generation to the current one (fewer: it is drained);
--   truncated  the oldest generation, drained, is truncated, unless
--              something in it became needed since (then: moved again);
--   NULL       nothing is due.
CREATE FUNCTION outbox.rotate(retention interval, moves integer, acks boolean,
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

-- Batches whose events are all gone (truncated with their generation),
-- up to $1: claimed before the oldest generation left began (an id below
-- its first_batch), marked or abandoned, and none of their events left in
-- any generation (an event moved forward keeps its batch). Returns how
-- many were deleted. A range of the primary key.
CREATE FUNCTION outbox.forget_batches(batches integer) RETURNS bigint
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
WITH gone AS (
    DELETE FROM outbox.batches AS b
     WHERE b.id IN (SELECT c.id
                      FROM outbox.batches AS c
                     WHERE c.id < (SELECT min(g.first_batch) FROM outbox.generations AS g)
                       AND (c.marked_at IS NOT NULL OR c.abandoned_at IS NOT NULL)
                       AND NOT EXISTS (SELECT FROM outbox.batch_members(c.prev, c.target, c.from_xid, c.from_id,
                                                                         c.to_xid, c.to_id))
                     ORDER BY c.id
                     LIMIT $1)
    RETURNING b.id
)
SELECT count(*) FROM gone
$$;

REVOKE ALL ON FUNCTION outbox.unfinished(smallint, boolean),
    outbox.move_unfinished(smallint, smallint, integer, boolean), outbox.rotate(interval, integer, boolean),
    outbox.forget_batches(integer) FROM PUBLIC;

-- The extension's schema again, for the functions pgrx declares next.
SET LOCAL search_path = @extschema@;
