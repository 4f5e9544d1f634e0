-- Pending events in line where no claim will read them: rows a data-only
-- restore brought with their triggers disabled (pg_restore
-- --disable-triggers), or any insert made with events_pending_again off,
-- keep the transaction id they came with. One in this cluster's future is
-- not read until the cluster's ids catch up; one before every window (below
-- the oldest batch's `prev` or, with no batch, the cursor's) is never read:
-- every batch that read an id saw it in progress or not yet begun, and
-- retention deletes a batch's events with it. Id 2 is the 0.10.0 update's
-- batches of events already sent, while they last. An event with an outcome is done. Up to
-- $1 of each are put in line now, as if this transaction had made them
-- pending. Served by events_pending_xid_idx, read from its two ends.
WITH floor AS (
    SELECT coalesce((SELECT pg_catalog.pg_snapshot_xmin(b.prev)
                       FROM outbox.batches AS b
                      WHERE pg_catalog.pg_snapshot_xmin(b.prev) > '2'
                      ORDER BY b.id
                      LIMIT 1),
                    (SELECT pg_catalog.pg_snapshot_xmin(c.prev) FROM outbox.cursor AS c)) AS xid
), future AS (
    SELECT e.id
      FROM outbox.log AS e
     WHERE e.status = 'pending'
       AND e.key_state IS DISTINCT FROM 'waiting'
       AND e.pending_xid >= pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())
     ORDER BY e.pending_xid DESC
     LIMIT $1
       FOR UPDATE SKIP LOCKED
), past AS (
    SELECT e.id
      FROM outbox.log AS e, floor
     WHERE e.status = 'pending'
       AND e.key_state IS DISTINCT FROM 'waiting'
       -- Id 2 with no batch of the update left (they come first by id): a
       -- data-only restore's copy of an event the update had sent.
       AND (e.pending_xid > '2'
            OR (SELECT b.dispatcher FROM outbox.batches AS b ORDER BY b.id LIMIT 1) IS DISTINCT FROM -1)
       AND e.pending_xid < floor.xid
       AND NOT EXISTS (SELECT FROM outbox.outcomes AS o WHERE o.batch = outbox.batch_of(e.pending_xid, e.id, true) AND e.id = ANY (o.events))
     ORDER BY e.pending_xid
     LIMIT $1
       FOR UPDATE OF e SKIP LOCKED
)
UPDATE outbox.log AS e
   SET pending_xid = pg_catalog.pg_current_xact_id()
  FROM (SELECT future.id FROM future UNION ALL SELECT past.id FROM past) AS strays
 WHERE e.id = strays.id
