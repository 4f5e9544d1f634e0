-- Dispatched more than $1 milliseconds ago and never acknowledged with
-- outbox_ack(): send up to $2 of them again, under the same task id.
-- Served by events_dispatched_idx.
WITH unacked AS (
    SELECT id
      FROM outbox.events
     WHERE status = 'dispatched'
       AND dispatched_at < pg_catalog.now() - $1 * interval '1 millisecond'
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox.events AS e
   SET status = 'pending',
       available_at = pg_catalog.now(),
       processing_started_at = NULL,
       claimed_by = NULL
  FROM unacked
 WHERE e.id = unacked.id
