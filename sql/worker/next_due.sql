-- Seconds until the next thing falls due (NULL when nothing waits), so that
-- the dispatcher sleeps no longer: the earliest event out of line (served by
-- events_due_idx, from $2: due_floor.sql), and per accumulated subscription the batch_wait of
-- its oldest member, or the moment a delayed member falls due (which may
-- make batch_max), or at once for an ended one (batch_members_waiting_idx);
-- not for the subscriptions in $1, whose last flush failed (the dispatcher
-- knows when it tries them again). In seconds since the epoch on both
-- sides: an event due at 'infinity' gives Infinity, not an error.
SELECT pg_catalog.date_part('epoch', LEAST(
    (SELECT pg_catalog.min(available_at)
       FROM outbox.log
      WHERE pending_xid IS NULL
        AND status = 'pending'
        AND key_state IS DISTINCT FROM 'waiting'
        AND available_at >= pg_catalog.to_timestamp($2)),
    (SELECT pg_catalog.min(due.at)
       FROM outbox.all_subscriptions AS s
      CROSS JOIN LATERAL (
            (SELECT CASE WHEN s.unsubscribed_at IS NOT NULL THEN m.available_at
                         ELSE m.available_at + s.batch_wait END
               FROM outbox.batch_members AS m
              WHERE m.subscription_id = s.id AND m.batch_id IS NULL
              ORDER BY m.available_at
              LIMIT 1)
            UNION ALL
            (SELECT m.available_at
               FROM outbox.batch_members AS m
              WHERE m.subscription_id = s.id AND m.batch_id IS NULL AND m.available_at > pg_catalog.now()
              ORDER BY m.available_at
              LIMIT 1)) AS due(at)
      WHERE s.batch_max IS NOT NULL
        AND s.id <> ALL ($1::bigint[]))
)) - pg_catalog.date_part('epoch', pg_catalog.now())
