-- Claim up to $1 due events for dispatcher $2, oldest due first. SKIP LOCKED
-- lets any number of dispatchers claim side by side without waiting or
-- claiming twice. The claim's time (processing_started_at, returned last)
-- and $2 are its token: only the holder of both may record an outcome.
-- Each claim is a new send, with a new send_id: the message carries it,
-- and a worker's report is taken only when it names it.
-- Served by events_pending_idx. Names are qualified: nothing here resolves
-- through a search_path (which the dispatcher also pins).
WITH due AS (
    SELECT id
      FROM outbox.events
     WHERE status = 'pending'
       AND available_at <= pg_catalog.now()
     ORDER BY available_at
     LIMIT $1
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox.events AS e
   SET status = 'processing',
       processing_started_at = pg_catalog.now(),
       claimed_by = $2,
       send_id = pg_catalog.gen_random_uuid()
  FROM due
 WHERE e.id = due.id
RETURNING e.id,
          e.event_type,
          e.payload::pg_catalog.text,
          e.queue,
          coalesce(e.task, e.event_type),
          e.headers::pg_catalog.text,
          e.priority,
          e.retry_count,
          e.created_at::pg_catalog.text,
          pg_catalog.date_part('epoch', e.created_at),
          e.args::pg_catalog.text,
          pg_catalog.to_char(pg_catalog.timezone('UTC', e.expires_at), 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'),
          pg_catalog.date_part('epoch', e.expires_at),
          e.processing_started_at,
          e.send_id
