-- Claim up to $1 events in line for dispatcher $2: the next page of the
-- window outbox.cursor is reading, as one batch (docs/design/how-it-works.md).
-- Run right after lock_cursor.sql, in the same transaction: claims run one
-- at a time, each with a snapshot taken once the one before committed, and
-- nothing is read twice or skipped. Nothing is written to the events: the
-- batch's row records which they are (the window, its two positions), and
-- the cursor moves past them.
--
-- The window is what the cursor's `target` snapshot sees and its `prev`
-- does not (no `target`: the window starts now, with this statement's
-- snapshot), read in (pending_xid, id) order after the cursor's position,
-- in ranges of events_pending_xid_idx: each transaction `prev` saw in
-- progress that `target` sees ended (behind), then those from `prev`'s
-- xmax up to `target`'s (fresh). Each range stops at $1 rows, however many
-- events lie before it: no claim walks what an earlier one read.
--
-- The page is cut after the event that brings it past $3 bytes (what the
-- dispatcher reads of each: its payload, args and headers as text), so
-- that a dispatcher holds what outbox.max_batch_bytes allows whatever
-- outbox.batch_size says; an event larger than that comes alone. The cut
-- is made on the stored sizes first, which cost nothing to read (no text
-- is made of an event past it), then on the text, which compression may
-- make many times larger.
--
-- A page shorter than $1 that nothing cut ends its window: its `target`
-- becomes the next `prev`, and the next claim starts a window of its own.
-- Returns the events with the batch (none: one row of NULLs), in no order:
-- the dispatcher puts them in the page's (a sort here of rows this wide
-- cost a tenth of a drain). Functions and relations are qualified;
-- operators and types resolve in pg_catalog through the search_path every
-- dispatcher pins (src/worker/setup.rs).
WITH cursor AS MATERIALIZED (
    SELECT w.position, w.prev, w.target, w.after_xid, w.after_id,
           -- Positions as index bounds: after (after_xid, after_id), or
           -- before everything; and where the fresh range starts, which is
           -- after the last row of the transaction before `prev`'s xmax.
           coalesce(w.after_xid, '0'::xid8) AS read_xid,
           coalesce(w.after_id, '00000000-0000-0000-0000-000000000000'::uuid) AS read_id,
           CASE WHEN w.after_xid >= pg_catalog.pg_snapshot_xmax(w.prev) THEN w.after_xid
                ELSE outbox.xid_before(pg_catalog.pg_snapshot_xmax(w.prev)) END AS fresh_xid,
           CASE WHEN w.after_xid >= pg_catalog.pg_snapshot_xmax(w.prev) THEN w.after_id
                ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END AS fresh_id,
           ARRAY(SELECT x FROM pg_catalog.pg_snapshot_xip(w.prev) AS x
                  WHERE pg_catalog.pg_visible_in_snapshot(x, w.target)) AS behind
      FROM (SELECT c.position, c.prev, coalesce(c.target, pg_catalog.pg_current_snapshot()) AS target,
                   c.after_xid, c.after_id
              FROM outbox.cursor AS c) AS w
), read AS (
    -- Up to $1 events in line after the position, in order (the columns
    -- the dispatcher reads: the windows copy each row), each with its
    -- stored size, the page's up to it, and whether another follows.
    SELECT p.*, pg_catalog.lead(p.id) OVER w IS NOT NULL AS more,
           pg_catalog.pg_column_size(p.payload) + coalesce(pg_catalog.pg_column_size(p.args), 0)
               + coalesce(pg_catalog.pg_column_size(p.headers), 0) AS stored,
           pg_catalog.sum(pg_catalog.pg_column_size(p.payload) + coalesce(pg_catalog.pg_column_size(p.args), 0)
                          + coalesce(pg_catalog.pg_column_size(p.headers), 0)) OVER w AS through
      FROM (SELECT p.*
              FROM ((SELECT e.id, e.pending_xid, e.event_type, e.payload, e.queue, e.task, e.headers, e.priority,
                            e.retry_count, e.created_at, e.args, e.expires_at, e.key_state, e.ordering_key,
                            e.subscription_id, e.event_id, e.generation
                       FROM cursor AS c
                      CROSS JOIN LATERAL pg_catalog.unnest(c.behind) AS b(xid)
                      CROSS JOIN LATERAL (
                            SELECT e.*
                              FROM outbox.log AS e
                             WHERE e.status = 'pending'
                               AND e.key_state IS DISTINCT FROM 'waiting'
                               AND e.pending_xid = b.xid
                               AND (e.pending_xid, e.id) > (c.read_xid, c.read_id)
                             ORDER BY e.pending_xid, e.id
                             LIMIT $1) AS e
                      ORDER BY e.pending_xid, e.id
                      LIMIT $1)
                    UNION ALL
                    (SELECT e.id, e.pending_xid, e.event_type, e.payload, e.queue, e.task, e.headers, e.priority,
                            e.retry_count, e.created_at, e.args, e.expires_at, e.key_state, e.ordering_key,
                            e.subscription_id, e.event_id, e.generation
                       FROM cursor AS c
                      CROSS JOIN LATERAL (
                            SELECT e.*
                              FROM outbox.log AS e
                             WHERE e.status = 'pending'
                               AND e.key_state IS DISTINCT FROM 'waiting'
                               AND (e.pending_xid, e.id) > (c.fresh_xid, c.fresh_id)
                               AND e.pending_xid < pg_catalog.pg_snapshot_xmax(c.target)
                               AND pg_catalog.pg_visible_in_snapshot(e.pending_xid, c.target)
                             ORDER BY e.pending_xid, e.id
                             LIMIT $1) AS e)) AS p
             ORDER BY p.pending_xid, p.id
             LIMIT $1) AS p
    WINDOW w AS (ORDER BY p.pending_xid, p.id ROWS UNBOUNDED PRECEDING)
), page AS MATERIALIZED (
    -- The texts' cut, each text made once (OFFSET 0: the subquery is not
    -- pulled up into this one), and never sorted (the ORDER BY is the
    -- order `read` gives).
    SELECT x.*
      FROM (SELECT x.*,
                   pg_catalog.octet_length(x.payload) + coalesce(pg_catalog.octet_length(x.args), 0)
                       + coalesce(pg_catalog.octet_length(x.headers), 0) AS bytes,
                   pg_catalog.sum(pg_catalog.octet_length(x.payload) + coalesce(pg_catalog.octet_length(x.args), 0)
                                  + coalesce(pg_catalog.octet_length(x.headers), 0))
                       OVER (ORDER BY x.pending_xid, x.id ROWS UNBOUNDED PRECEDING) AS through
              FROM (SELECT r.id, r.pending_xid, r.event_type, r.payload::pg_catalog.text AS payload, r.queue,
                           r.task, r.headers::pg_catalog.text AS headers, r.priority, r.retry_count, r.created_at,
                           r.args::pg_catalog.text AS args, r.expires_at, r.key_state, r.ordering_key,
                           r.subscription_id, r.event_id, r.generation, r.more
                      FROM read AS r
                     WHERE r.through - r.stored < $3
                     ORDER BY r.pending_xid, r.id
                    OFFSET 0) AS x) AS x
     WHERE x.through - x.bytes < $3
), last AS (
    SELECT p.pending_xid, p.id, p.more, (SELECT pg_catalog.count(*) FROM page) AS events
      FROM page AS p
     ORDER BY p.pending_xid DESC, p.id DESC
     LIMIT 1
), batch AS (
    INSERT INTO outbox.batches (send, dispatcher, claimed_at, prev, target, from_xid, from_id, to_xid, to_id, events,
                                read_past)
    SELECT pg_catalog.gen_random_uuid(), $2, pg_catalog.now(), c.prev, c.target, c.after_xid, c.after_id,
           last.pending_xid, last.id, last.events,
           -- The transactions behind it read the last events of before
           -- its own last (outbox.held_by()).
           (SELECT pg_catalog.array_agg(DISTINCT p.pending_xid)
              FROM page AS p
             WHERE p.pending_xid < pg_catalog.pg_snapshot_xmax(c.prev)
               AND p.pending_xid < last.pending_xid)
      FROM cursor AS c, last
    RETURNING id, send, claimed_at
), ended AS (
    -- Short, and not for its bytes: nothing was read after its last.
    SELECT coalesce((SELECT last.events FROM last), 0) < $1
           AND NOT coalesce((SELECT last.more FROM last), false) AS ended
), moved AS (
    -- The new position, which replaces the one read (a claim that read
    -- nothing moves `prev` too: the transactions still running at its
    -- snapshot are then read once they end, not walked by every claim).
    INSERT INTO outbox.positions (prev, target, after_xid, after_id)
    SELECT CASE WHEN ended.ended THEN w.target ELSE w.prev END,
           CASE WHEN ended.ended THEN NULL ELSE w.target END,
           CASE WHEN ended.ended THEN NULL ELSE (SELECT last.pending_xid FROM last) END,
           CASE WHEN ended.ended THEN NULL ELSE (SELECT last.id FROM last) END
      FROM cursor AS w, ended
), replaced AS (
    -- By its key, a constant to the plan: as a join the planner may walk
    -- the whole index, every position a pinned xmin keeps.
    DELETE FROM outbox.positions AS p
     WHERE p.position = (SELECT w.position FROM cursor AS w)
)
SELECT p.id,
       p.event_type,
       p.payload,
       p.queue,
       coalesce(p.task, p.event_type) AS task,
       p.headers,
       p.priority,
       p.retry_count,
       p.created_at::pg_catalog.text,
       pg_catalog.date_part('epoch', p.created_at) AS created_epoch,
       p.args,
       pg_catalog.to_char(pg_catalog.timezone('UTC', p.expires_at), 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"') AS expires,
       pg_catalog.date_part('epoch', p.expires_at) AS expires_epoch,
       p.pending_xid::pg_catalog.text,
       p.key_state = 'head' AS head,
       p.ordering_key,
       coalesce(p.subscription_id, 0) AS subscription,
       batch.id AS batch,
       -- Each message's send is derived from it by the dispatcher
       -- (outbox_core::report::send_of, as outbox.send_of()).
       batch.send,
       (SELECT ended.ended FROM ended) AS ended,
       p.generation,
       p.event_id
  FROM (SELECT 1) AS one
  LEFT JOIN page AS p ON true
  LEFT JOIN batch ON true
