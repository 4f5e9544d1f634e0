-- Seconds until the earliest delayed event falls due (NULL when none is
-- waiting), so that the dispatcher sleeps no longer. Served by
-- events_pending_idx.
SELECT pg_catalog.date_part('epoch', pg_catalog.min(available_at) - pg_catalog.now())
  FROM outbox.events
 WHERE status = 'pending'
   AND available_at > pg_catalog.now()
