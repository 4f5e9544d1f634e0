-- Retention: up to $2 batches settled (or abandoned) more than $1
-- milliseconds ago, or marked that long ago when acknowledgements are off
-- ($3: what was not reported by then never will be), are deleted with
-- their events and those events' outcomes; so are the records of routed events (stored processed) and
-- the events acknowledged before they were sent again, older than that.
-- Each statement its own transaction, so no lock is held for long. A
-- batch delivery's members go with it. Returns the number of events
-- deleted. Served by batches_settled_idx, batches_unsettled_idx, batches_abandoned_idx,
-- events_recorded_idx, the primary keys and batch_members_batch_idx.
WITH settled AS (
    SELECT id
      FROM outbox.batches
     WHERE settled_at < pg_catalog.now() - $1 * interval '1 millisecond'
     ORDER BY settled_at
     LIMIT $2
       FOR UPDATE SKIP LOCKED
), unsettled AS (
    SELECT id
      FROM outbox.batches
     WHERE $3
       AND settled_at IS NULL
       AND marked_at < pg_catalog.now() - $1 * interval '1 millisecond'
     ORDER BY marked_at
     LIMIT $2
       FOR UPDATE SKIP LOCKED
), expired AS (
    DELETE FROM outbox.batches AS b
     WHERE b.id IN (SELECT settled.id FROM settled UNION ALL SELECT unsettled.id FROM unsettled)
    RETURNING b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id
), gone AS (
    DELETE FROM outbox.batches AS b
     USING (SELECT id
              FROM outbox.batches
             WHERE abandoned_at < pg_catalog.now() - $1 * interval '1 millisecond'
             LIMIT $2
               FOR UPDATE SKIP LOCKED) AS due
     WHERE b.id = due.id
    RETURNING b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id
), members AS (
    SELECT m.id
      FROM expired AS b
     CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
    UNION ALL
    -- Left in an abandoned batch: events with an outcome (abandon.sql).
    SELECT m.id
      FROM gone AS b
     CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
    UNION ALL
    (SELECT e.id
       FROM outbox.log AS e
      WHERE e.status = 'processed'
        AND e.created_at < pg_catalog.now() - $1 * interval '1 millisecond'
      ORDER BY e.created_at
      LIMIT $2 * 100)
), outcomes AS (
    DELETE FROM outbox.outcomes AS o USING members AS m WHERE o.event = m.id
), purged AS (
    DELETE FROM outbox.log AS e
     USING members AS m
     WHERE e.id = m.id
    RETURNING e.id, e.subscription_id, e.event_id
), batch_members AS (
    DELETE FROM outbox.batch_members AS m
     USING purged
     WHERE purged.subscription_id IS NOT NULL
       AND purged.event_id IS NULL
       AND m.batch_id = purged.id
)
SELECT pg_catalog.count(*) FROM purged
