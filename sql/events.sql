-- outbox_dispatch: outbox.events, the name applications, ORMs and DBAs
-- use, read at the speed of the table it shows.
--
-- What became of an event is written of it only when something
-- exceptional happens (a dead letter, the record of a routed event); else
-- its batch says it (docs/design/how-it-works.md). The view derives it a
-- set of rows at a time: one branch per kind of row, each found through
-- the index of its kind, so that a filter on `status` reads only the
-- branches that may hold that status (PostgreSQL drops a branch whose
-- status, a constant, cannot match): `status = 'failed'` reads the dead
-- letters' index, `status = 'pending'` the indexes of the line, of what
-- waits and of what is due later, `status = 'processing'` the batches not
-- marked. Only the events sent are derived row by row, by the batch that
-- holds their place (outbox.state_at(), outbox.batch_at()).

-- Every name below resolves in pg_catalog or is qualified.
SET LOCAL search_path = pg_catalog, pg_temp;

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
CREATE VIEW outbox.events WITH (security_invoker = true) AS
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

-- The extension's schema again, for the files that follow.
SET LOCAL search_path = @extschema@;
