-- Claims older than $1 milliseconds belong to a dispatcher that died or
-- hung: give up to $2 of them back. SKIP LOCKED: never wait on a live claim.
-- Served by events_processing_idx.
WITH stuck AS (
    SELECT id
      FROM outbox.log
     WHERE status = 'processing'
       AND processing_started_at < pg_catalog.now() - $1 * interval '1 millisecond'
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox.log AS e
   SET status = 'pending',
       processing_started_at = NULL,
       claimed_by = NULL
  FROM stuck
 WHERE e.id = stuck.id
