-- Does the turn an inserted row brings ($3, as $4: 'head' or 'waiting') fit
-- key $1 (of subscription $2; 0: an event's own key)? It does when no row of
-- the key has that key_seq, every row after it waits, and, for a head,
-- every row before it is finished: a key's rows in key_seq order are the
-- finished ones, its head, then the waiting ones (docs/guides/per-key-order.md).
-- Run as of now, whatever the caller's isolation (src/keys.rs), under the
-- key's lock. Served by events_key_idx.
SELECT NOT EXISTS (
    SELECT
      FROM outbox.log AS e
     WHERE e.ordering_key OPERATOR(pg_catalog.=) $1
       AND coalesce(e.subscription_id, 0) OPERATOR(pg_catalog.=) $2
       AND e.key_seq IS NOT NULL
       AND (e.key_seq OPERATOR(pg_catalog.=) $3
            OR (e.key_seq OPERATOR(pg_catalog.>) $3
                AND (e.key_state IS NULL OR e.key_state OPERATOR(pg_catalog.<>) 'waiting'))
            OR (e.key_seq OPERATOR(pg_catalog.<) $3
                AND $4 OPERATOR(pg_catalog.=) 'head'
                AND e.key_state IS NOT NULL)))
