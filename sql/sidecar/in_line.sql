-- Whether a claim would find events now that no claim has read: the
-- sidecar's poll asks this before it claims, and claims only when it is
-- true (or when something else falls due). Read only: no lock, no
-- transaction id, no WAL, where a claim that finds nothing writes its
-- position. The same ranges as sql/worker/claim.sql, each probed for one
-- row: a window under way (a page that was full), the transactions the
-- cursor's `prev` saw in progress that have ended since, and those from
-- `prev`'s xmax on that are visible now.
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
