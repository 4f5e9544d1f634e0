-- Seconds until the earliest delayed event falls due (NULL when none is
-- waiting), so that the dispatcher sleeps no longer. Served by
-- events_pending_idx.
SELECT extract(epoch FROM min(available_at) - now())::float8
  FROM outbox.events
 WHERE status = 'pending'
   AND available_at > now()
