-- Events $1 are in Redis.
UPDATE outbox.events
   SET status = 'dispatched',
       dispatched_at = now(),
       last_error = NULL
 WHERE id = ANY($1)
   AND status = 'processing'
