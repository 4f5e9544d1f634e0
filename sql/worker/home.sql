-- Whether this database ($1, its OID) is the one CREATE EXTENSION recorded,
-- or a copy of it (CREATE DATABASE ... TEMPLATE) holding another database's
-- events. A copy with nothing to send or to confirm (no event pending,
-- processing or dispatched, no batch member waiting) is adopted here and
-- now. Returns the OID recorded before, whether it was adopted, and the
-- extension's schema, quoted (for the message naming outbox_adopt()). Each
-- NOT EXISTS reads one entry of a small index, the first what the window
-- being read has read.
WITH adopted AS (
    UPDATE outbox.installed_in
       SET database = $1
     WHERE database <> $1
       -- Nothing in line that the claims have not read (see status in
       -- sql/api.sql), nothing out of line, nothing waiting for its key.
       AND NOT EXISTS (SELECT
                         FROM outbox.log AS e
                        WHERE e.status = 'pending'
                          AND e.key_state IS DISTINCT FROM 'waiting'
                          AND e.pending_xid = ANY (ARRAY(SELECT pg_catalog.pg_snapshot_xip(c.prev)
                                                           FROM outbox.cursor AS c))
                          AND NOT coalesce((SELECT pg_catalog.pg_visible_in_snapshot(e.pending_xid, c.target)
                                                   AND (e.pending_xid, e.id)
                                                       <= (coalesce(c.after_xid, '0'::xid8),
                                                           coalesce(c.after_id,
                                                                    '00000000-0000-0000-0000-000000000000'::uuid))
                                              FROM outbox.cursor AS c), false))
       AND NOT EXISTS (SELECT
                         FROM outbox.log AS e
                        WHERE e.status = 'pending'
                          AND e.key_state IS DISTINCT FROM 'waiting'
                          AND e.pending_xid >= (SELECT pg_catalog.pg_snapshot_xmax(c.prev) FROM outbox.cursor AS c)
                          AND NOT coalesce((SELECT pg_catalog.pg_visible_in_snapshot(e.pending_xid, c.target)
                                                   AND (e.pending_xid, e.id)
                                                       <= (coalesce(c.after_xid, '0'::xid8),
                                                           coalesce(c.after_id,
                                                                    '00000000-0000-0000-0000-000000000000'::uuid))
                                              FROM outbox.cursor AS c), false))
       AND NOT EXISTS (SELECT FROM outbox.log
                        WHERE pending_xid IS NULL AND status = 'pending' AND key_state IS DISTINCT FROM 'waiting')
       AND NOT EXISTS (SELECT FROM outbox.log WHERE key_state = 'waiting')
       -- No batch in flight, none awaiting acknowledgements or reports
       -- ($2: either is on).
       AND NOT EXISTS (SELECT FROM outbox.batches WHERE marked_at IS NULL AND abandoned_at IS NULL)
       AND NOT ($2 AND EXISTS (SELECT FROM outbox.batches WHERE settled_at IS NULL AND marked_at IS NOT NULL))
       AND NOT EXISTS (SELECT FROM outbox.batch_members WHERE batch_id IS NULL)
    RETURNING database
)
SELECT database, EXISTS (SELECT FROM adopted) AS adopted,
       (SELECT quote_ident(n.nspname)
          FROM pg_extension AS x JOIN pg_namespace AS n ON n.oid = x.extnamespace
         WHERE x.extname = 'outbox_dispatch') AS schema
  FROM outbox.installed_in
