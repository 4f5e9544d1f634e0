-- Outcomes reported by Celery workers (outbox_dispatch.celery): event $1[i]
-- ended $2[i] ('processed' or 'failed'), with error $3[i]. Taken by events
-- still waiting for one: dispatched, and also pending or processing, since a
-- report may overtake the dispatcher's own record of the push. Returns the
-- outcome of each event that took one; the rest were stale (the event is
-- gone, or already final). Served by the primary key.
UPDATE outbox.events AS e
   SET status = r.outcome::outbox.event_status,
       processed_at = pg_catalog.now(),
       last_error = r.error,
       deliveries = GREATEST(e.deliveries, 1),  -- a worker ran it: it was sent
       processing_started_at = NULL,
       claimed_by = NULL
  FROM unnest($1::uuid[], $2::text[], $3::text[]) AS r(id, outcome, error)
 WHERE e.id = r.id
   AND e.status IN ('pending', 'processing', 'dispatched')
RETURNING r.outcome
