-- Whether this database ($1, its OID) is the one CREATE EXTENSION recorded,
-- or a copy of it (CREATE DATABASE ... TEMPLATE) holding another database's
-- events. A copy with nothing to send or to confirm (no event pending,
-- processing or dispatched, no batch member waiting) is adopted here and
-- now. Returns the OID recorded before, whether it was adopted, and the
-- extension's schema, quoted (for the message naming outbox_adopt()). Each
-- NOT EXISTS reads one entry of a partial index.
WITH adopted AS (
    UPDATE outbox.installed_in
       SET database = $1
     WHERE database <> $1
       AND NOT EXISTS (SELECT FROM outbox.log WHERE status = 'pending' AND key_state IS DISTINCT FROM 'waiting')
       AND NOT EXISTS (SELECT FROM outbox.log WHERE key_state = 'waiting')
       AND NOT EXISTS (SELECT FROM outbox.log WHERE status = 'processing')
       AND NOT EXISTS (SELECT FROM outbox.log WHERE status = 'dispatched')
       AND NOT EXISTS (SELECT FROM outbox.batch_members WHERE batch_id IS NULL)
    RETURNING database
)
SELECT database, EXISTS (SELECT FROM adopted) AS adopted,
       (SELECT quote_ident(n.nspname)
          FROM pg_extension AS x JOIN pg_namespace AS n ON n.oid = x.extnamespace
         WHERE x.extname = 'outbox_dispatch') AS schema
  FROM outbox.installed_in
