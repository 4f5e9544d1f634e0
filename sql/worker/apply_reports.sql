-- Outcomes reported by Celery workers (outbox_dispatch.celery): event $1[i],
-- sent as send $2[i], ended $3[i] ('processed' or 'failed'), with error
-- $4[i]. Taken only for the send the event is at (send_id, new at every
-- claim): a report proves which send it answers, so one for an event never
-- sent (its send_id is NULL), a late one of an earlier send, or a guess
-- changes nothing. Taken while the event waits for one: dispatched, and
-- also processing (a report may overtake the dispatcher's own record of
-- the push) or pending (a push the dispatcher counted as failed that
-- reached a worker all the same). Returns the outcome of each event that
-- took one, and its key when it is its key's head (src/keys.rs: finished
-- now, unless it failed and outbox.key_on_failure blocks); the rest were
-- stale. Served by the primary key.
UPDATE outbox.log AS e
   SET status = r.outcome::outbox.event_status,
       processed_at = pg_catalog.now(),
       last_error = r.error,
       deliveries = GREATEST(e.deliveries, 1),  -- a worker ran it: it was sent
       processing_started_at = NULL,
       claimed_by = NULL
  FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[]) AS r(id, send, outcome, error)
 WHERE e.id = r.id
   AND e.send_id = r.send
   AND e.status IN ('pending', 'processing', 'dispatched')
RETURNING r.outcome, CASE WHEN e.key_state = 'head' THEN e.id END, e.ordering_key,
          coalesce(e.subscription_id, 0)
