-- Give claimed events back without spending a retry: the broker failed, not
-- the events. $1: the events of claim ($2, $3). With $1 and $3 NULL, every
-- event dispatcher $2 holds (run when a dispatcher starts: what it held
-- before it died is nobody's now). Served by events_processing_idx.
UPDATE outbox.log
   SET status = 'pending',
       processing_started_at = NULL,
       claimed_by = NULL
 WHERE status = 'processing'
   AND claimed_by = $2
   AND ($1::uuid[] IS NULL OR id = ANY($1))
   AND ($3::timestamptz IS NULL OR processing_started_at = $3)
