-- Claim up to $1 due events for dispatcher $2. FOR NO KEY UPDATE SKIP
-- LOCKED lets any number of dispatchers claim side by side without waiting
-- or claiming twice (and without waiting on a foreign key's KEY SHARE). The
-- claim's time (processing_started_at) and $2 are its token: only the
-- holder of both may record an outcome. Each claim is a new send, with a
-- new send_id: the message carries it, and a worker's report is taken only
-- when it names it. An event waiting for its key's turn (README, "Per-key
-- order") is in neither index and never claimed: a key's head is.
--
-- Where to look comes from the dispatcher's frontier (core/src/frontier.rs),
-- which says why these scans, in this order, miss nothing and walk nothing
-- twice, however many dead entries a held-back vacuum leaves:
--   came_due   rows passed (up to key $8, $9, but not the unread rows of
--              the behind transactions $10 after ids $11) that fell due
--              after ($12, $13), up to $15; events_pending_idx;
--   segmented  in (pending_xid, id) order, the ranges $3..$7 (kind, the
--              transaction a behind range waits for, after, before): each
--              behind transaction once ended and the fresh range; or a
--              step of a sweep: the passed rows again (those due by $14,
--              not of a behind transaction's unread rows);
--              events_pending_xid_idx;
-- the second with what the first left of $1. (IS TRUE keeps the planner
-- from scanning came_due by events_pending_xid_idx, which would walk every
-- entry below the frontier, dead ones included: the statistics know
-- nothing of those.) Returns the snapshot and the time the scans used,
-- how many rows they locked, and each row's segment (NULL: came due) and
-- keys: one row with NULL columns when nothing was claimed. A sweep's
-- step ($14: the start of the came-due range) runs after the claim of its
-- transaction committed, and records that claim's time $16 as its own:
-- the two make one batch with one token.
-- Names are qualified: nothing here resolves through a search_path (which
-- the dispatcher also pins).
WITH snapshot AS MATERIALIZED (
    SELECT c.s, pg_catalog.pg_snapshot_xmax(c.s)::pg_catalog.text AS xmax,
           ARRAY(SELECT x::pg_catalog.text FROM pg_catalog.pg_snapshot_xip(c.s) AS x) AS xip
      FROM (SELECT pg_catalog.pg_current_snapshot() AS s) AS c
), unread AS MATERIALIZED (
    SELECT b.xid, b.after
      FROM ROWS FROM (pg_catalog.unnest($10::pg_catalog.xid8[]), pg_catalog.unnest($11::uuid[])) AS b(xid, after)
), came_due AS MATERIALIZED (
    SELECT e.id
      FROM outbox.log AS e
     WHERE e.status = 'pending'
       AND e.key_state IS DISTINCT FROM 'waiting'
       AND (e.available_at, e.id) > ($12, $13)
       AND e.available_at <= LEAST($15, pg_catalog.now())
       AND ((e.pending_xid, e.id) <= ($8::pg_catalog.xid8, $9)) IS TRUE
       AND NOT EXISTS (SELECT FROM unread AS b
                        WHERE e.pending_xid = b.xid AND (b.after IS NULL OR e.id > b.after))
     ORDER BY e.available_at, e.id
     LIMIT $1
       FOR NO KEY UPDATE SKIP LOCKED
), segment AS (
    SELECT g.n, g.kind, g.after_xid, g.after_id, g.before_xid
      FROM ROWS FROM (pg_catalog.unnest($3::pg_catalog.text[]), pg_catalog.unnest($4::pg_catalog.xid8[]),
                      pg_catalog.unnest($5::pg_catalog.xid8[]), pg_catalog.unnest($6::uuid[]),
                      pg_catalog.unnest($7::pg_catalog.xid8[]))
           WITH ORDINALITY AS g(kind, ended, after_xid, after_id, before_xid, n)
     WHERE g.ended IS NULL
        OR pg_catalog.pg_visible_in_snapshot(g.ended, (SELECT snapshot.s FROM snapshot))
), segmented AS MATERIALIZED (
    SELECT g.n - 1 AS segment, e.id
      FROM segment AS g
     CROSS JOIN LATERAL (
           SELECT e.id
             FROM outbox.log AS e
            WHERE e.status = 'pending'
              AND e.key_state IS DISTINCT FROM 'waiting'
              AND (e.pending_xid, e.id) > (g.after_xid, g.after_id)
              AND e.pending_xid < g.before_xid
              AND e.available_at <= pg_catalog.now()
              AND (g.kind <> 'sweep'
                   OR (((e.pending_xid, e.id) <= ($8::pg_catalog.xid8, $9)) IS TRUE
                       AND e.available_at <= $14
                       AND NOT EXISTS (SELECT FROM unread AS b
                                        WHERE e.pending_xid = b.xid AND (b.after IS NULL OR e.id > b.after))))
            ORDER BY e.pending_xid, e.id
            LIMIT $1
              FOR NO KEY UPDATE SKIP LOCKED) AS e
     LIMIT $1 - (SELECT pg_catalog.count(*) FROM came_due)
), due AS (
    SELECT NULL::pg_catalog.int8 AS segment, came_due.id FROM came_due
    UNION ALL
    SELECT segmented.segment, segmented.id FROM segmented
), claimed AS (
    UPDATE outbox.log AS e
       SET status = 'processing',
           processing_started_at = coalesce($16, pg_catalog.now()),
           claimed_by = $2,
           send_id = pg_catalog.gen_random_uuid()
      FROM due
     WHERE e.id = due.id
    RETURNING e.id,
              e.event_type,
              e.payload::pg_catalog.text,
              e.queue,
              coalesce(e.task, e.event_type) AS task,
              e.headers::pg_catalog.text,
              e.priority,
              e.retry_count,
              e.created_at::pg_catalog.text,
              pg_catalog.date_part('epoch', e.created_at) AS created_epoch,
              e.args::pg_catalog.text,
              pg_catalog.to_char(pg_catalog.timezone('UTC', e.expires_at), 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')
                  AS expires,
              pg_catalog.date_part('epoch', e.expires_at) AS expires_epoch,
              e.send_id,
              due.segment,
              e.pending_xid::pg_catalog.text AS pending_xid,
              e.available_at
)
SELECT c.id, c.event_type, c.payload, c.queue, c.task, c.headers, c.priority, c.retry_count, c.created_at,
       c.created_epoch, c.args, c.expires, c.expires_epoch, c.send_id, c.segment, c.pending_xid,
       c.available_at,
       pg_catalog.now() AS now,
       coalesce($16, pg_catalog.now()) AS claimed_at,
       (SELECT pg_catalog.count(*) FROM due) AS due,
       snapshot.xmax,
       snapshot.xip
  FROM snapshot
  LEFT JOIN claimed AS c ON true
