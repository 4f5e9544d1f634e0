-- Whether a drain would find work in outbox.log now: a dispatcher not due
-- to claim (woken, or polled, but not at its own poll's time) asks this
-- first, and claims only when it is true. Read only: no lock, no
-- transaction id, no WAL, where a claim that finds nothing writes its
-- position. The ranges of
-- sql/worker/claim.sql, each probed for one row (a window under way: a
-- page that was full; the transactions the cursor's `prev` saw in progress
-- that have ended since; those from `prev`'s xmax on that are visible
-- now); events out of line whose time has come (came_due.sql, served by
-- events_due_idx from $1: due_floor.sql); accumulated subscriptions whose batch is due by count,
-- wait or end (flush_batches.sql; by size, it goes at its wait). The
-- dispatcher's own poll claims whatever this misses.
WITH c AS MATERIALIZED (
    SELECT p.prev, p.target, pg_catalog.pg_current_snapshot() AS now,
           coalesce(p.after_xid, '0'::xid8) AS read_xid,
           coalesce(p.after_id, '00000000-0000-0000-0000-000000000000'::uuid) AS read_id
      FROM outbox.cursor AS p
)
SELECT EXISTS (SELECT FROM c WHERE c.target IS NOT NULL)
    OR EXISTS (SELECT
                 FROM c
                CROSS JOIN LATERAL pg_catalog.pg_snapshot_xip(c.prev) AS b(xid)
                CROSS JOIN LATERAL (SELECT
                                      FROM outbox.log AS e
                                     WHERE e.status = 'pending'
                                       AND e.key_state IS DISTINCT FROM 'waiting'
                                       AND e.pending_xid = b.xid
                                       AND (e.pending_xid, e.id) > (c.read_xid, c.read_id)
                                     LIMIT 1) AS e
               WHERE pg_catalog.pg_visible_in_snapshot(b.xid, c.now))
    OR EXISTS (SELECT
                 FROM c
                CROSS JOIN LATERAL (SELECT e.pending_xid
                                      FROM outbox.log AS e
                                     WHERE e.status = 'pending'
                                       AND e.key_state IS DISTINCT FROM 'waiting'
                                       AND e.pending_xid >= pg_catalog.pg_snapshot_xmax(c.prev)
                                       AND e.pending_xid < pg_catalog.pg_snapshot_xmax(c.now)
                                       AND pg_catalog.pg_visible_in_snapshot(e.pending_xid, c.now)
                                     LIMIT 1) AS e)
    OR EXISTS (SELECT
                 FROM outbox.log AS e
                WHERE e.pending_xid IS NULL
                  AND e.status = 'pending'
                  AND e.key_state IS DISTINCT FROM 'waiting'
                  AND e.available_at >= pg_catalog.to_timestamp($1)
                  AND e.available_at <= pg_catalog.clock_timestamp())
    OR EXISTS (SELECT
                 FROM outbox.all_subscriptions AS s
                CROSS JOIN LATERAL (
                      SELECT pg_catalog.count(*) AS members, pg_catalog.min(w.available_at) AS oldest
                        FROM (SELECT m.available_at
                                FROM outbox.batch_members AS m
                               WHERE m.subscription_id = s.id
                                 AND m.batch_id IS NULL
                                 AND m.available_at <= pg_catalog.now()
                               ORDER BY m.available_at
                               LIMIT s.batch_max) AS w) AS waiting
                WHERE s.batch_max IS NOT NULL
                  AND waiting.members > 0
                  AND (waiting.members >= s.batch_max
                       OR waiting.oldest <= pg_catalog.now() - s.batch_wait
                       OR s.unsubscribed_at IS NOT NULL))
