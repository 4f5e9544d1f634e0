-- Events $1 are in Redis; recorded only where claim ($2, $3) still holds
-- them (a sweeper may have given a slow claim to someone else).
UPDATE outbox.events
   SET status = 'dispatched',
       dispatched_at = pg_catalog.now(),
       deliveries = deliveries + 1,
       last_error = NULL
 WHERE id = ANY($1)
   AND status = 'processing'
   AND claimed_by = $2
   AND processing_started_at = $3
