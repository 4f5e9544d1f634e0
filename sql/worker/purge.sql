-- Delete up to $2 finished events older than $1 milliseconds: processed ones,
-- and dispatched ones when $3 (acknowledgements are off). Small batches,
-- each its own transaction, so no lock is held for long. $4 and $5 resume a
-- round where its last batch ended (processed_at, dispatched_at; NULL: from
-- the start): the index entries of the rows deleted before stay until a
-- vacuum, and every batch would otherwise walk past all of them again.
-- Returns, per row, whether it was processed and its time, for the next $4
-- and $5. A batch's members go with it. Served by events_processed_idx and
-- events_dispatched_idx, and batch_members_batch_idx.
WITH expired AS (
    (SELECT id
       FROM outbox.log
      WHERE status = 'processed'
        AND processed_at < pg_catalog.now() - $1 * interval '1 millisecond'
        AND ($4::timestamptz IS NULL OR processed_at >= $4)
      ORDER BY processed_at
      LIMIT $2)
    UNION ALL
    (SELECT id
       FROM outbox.log
      WHERE $3
        AND status = 'dispatched'
        AND dispatched_at < pg_catalog.now() - $1 * interval '1 millisecond'
        AND ($5::timestamptz IS NULL OR dispatched_at >= $5)
      ORDER BY dispatched_at
      LIMIT $2)
), purged AS (
    DELETE FROM outbox.log AS e
     USING (SELECT id FROM expired LIMIT $2) AS batch
     WHERE e.id = batch.id
    RETURNING e.id, e.status, e.processed_at, e.dispatched_at, e.subscription_id, e.event_id
), members AS (
    DELETE FROM outbox.batch_members AS m
     USING purged
     WHERE purged.subscription_id IS NOT NULL
       AND purged.event_id IS NULL
       AND m.batch_id = purged.id
)
SELECT status = 'processed', coalesce(processed_at, dispatched_at)
  FROM purged
