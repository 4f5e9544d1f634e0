-- Delete up to $2 finished events older than $1 milliseconds: processed ones,
-- and dispatched ones when $3 (acknowledgements are off). Small batches,
-- each its own transaction, so no lock is held for long.
-- Served by events_processed_idx and events_dispatched_idx.
WITH expired AS (
    (SELECT id
       FROM outbox.events
      WHERE status = 'processed'
        AND processed_at < pg_catalog.now() - $1 * interval '1 millisecond'
      LIMIT $2)
    UNION ALL
    (SELECT id
       FROM outbox.events
      WHERE $3
        AND status = 'dispatched'
        AND dispatched_at < pg_catalog.now() - $1 * interval '1 millisecond'
      LIMIT $2)
)
DELETE FROM outbox.events AS e
 USING (SELECT id FROM expired LIMIT $2) AS batch
 WHERE e.id = batch.id
