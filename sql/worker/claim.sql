-- Claim up to $1 due events for dispatcher $2, oldest due first. SKIP LOCKED
-- lets any number of dispatchers claim side by side without waiting or
-- claiming twice. Served by events_pending_idx.
WITH due AS (
    SELECT id
      FROM outbox.events
     WHERE status = 'pending'
       AND available_at <= now()
     ORDER BY available_at
     LIMIT $1
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox.events AS e
   SET status = 'processing',
       processing_started_at = now(),
       claimed_by = $2
  FROM due
 WHERE e.id = due.id
RETURNING e.id,
          e.event_type,
          e.payload::text,
          e.queue,
          coalesce(e.task, e.event_type),
          e.headers::text,
          e.priority,
          e.retry_count,
          e.created_at::text,
          extract(epoch FROM e.created_at)::float8
