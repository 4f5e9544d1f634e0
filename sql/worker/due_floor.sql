-- Where the scans of events out of line until due (came_due.sql,
-- next_due.sql, in_line.sql) start in events_due_idx: the earliest such
-- event from $1, the floor so far, below $2, the bound due_bound.sql read
-- in an earlier statement; or the bound, when none waits below it. In
-- seconds since the epoch.
SELECT pg_catalog.date_part('epoch', coalesce(
           (SELECT e.available_at
              FROM outbox.log AS e
             WHERE e.pending_xid IS NULL
               AND e.status = 'pending'
               AND e.key_state IS DISTINCT FROM 'waiting'
               AND e.available_at >= pg_catalog.to_timestamp($1)
               AND e.available_at < pg_catalog.to_timestamp($2)
             ORDER BY e.available_at
             LIMIT 1),
           pg_catalog.to_timestamp($2)))
