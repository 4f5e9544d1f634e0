-- Passes keys on, in a transaction that holds their locks (lock.sql), in a
-- statement that began after it took them, so that it sees every event a
-- producer of the key committed. Heads $1 that are finished (processed;
-- failed too with $4, dispatched too with $5: a head retried since it
-- finished is not) let their key go, and the event right behind each,
-- when it waits, becomes the key's head.
-- Keys $2 (of subscriptions $3) were found with events waiting and no head
-- (sweep_keys.sql): their first waiting event becomes the head, unless a
-- head took the key meanwhile. A new head is pending as it was, due from
-- now if it was due before, and in line as if this transaction had
-- enqueued it. Returns how many heads
-- let their key go, and how many events became heads.
-- Served by events_key_idx and events_key_state_idx.
WITH passed AS (
    UPDATE outbox.log AS e
       SET key_state = NULL
     WHERE e.id OPERATOR(pg_catalog.=) ANY ($1::uuid[])
       AND e.key_state OPERATOR(pg_catalog.=) 'head'
       AND (outbox.event_status(e.status, e.pending_xid, e.id, e.key_state) OPERATOR(pg_catalog.=) 'processed'
            OR (e.status OPERATOR(pg_catalog.=) 'failed' AND $4)
            OR (outbox.event_status(e.status, e.pending_xid, e.id, e.key_state) OPERATOR(pg_catalog.=) 'dispatched'
                AND $5))
    RETURNING e.ordering_key, coalesce(e.subscription_id, 0) AS subscription, e.key_seq
), next AS (
    SELECT n.id
      FROM passed AS p
     CROSS JOIN LATERAL (
           SELECT w.id
             FROM outbox.log AS w
            WHERE w.ordering_key OPERATOR(pg_catalog.=) p.ordering_key
              AND coalesce(w.subscription_id, 0) OPERATOR(pg_catalog.=) p.subscription
              AND w.key_seq OPERATOR(pg_catalog.>) p.key_seq
            ORDER BY w.key_seq
            LIMIT 1) AS n
    UNION ALL
    SELECT n.id
      FROM ROWS FROM (pg_catalog.unnest($2::pg_catalog.text[]), pg_catalog.unnest($3::pg_catalog.int8[]))
           AS k(key, subscription)
     CROSS JOIN LATERAL (
           SELECT w.id
             FROM outbox.log AS w
            WHERE w.key_state OPERATOR(pg_catalog.=) 'waiting'
              AND w.ordering_key OPERATOR(pg_catalog.=) k.key
              AND coalesce(w.subscription_id, 0) OPERATOR(pg_catalog.=) k.subscription
            ORDER BY w.key_seq
            LIMIT 1) AS n
     WHERE NOT EXISTS (SELECT FROM outbox.log AS h
                        WHERE h.key_state OPERATOR(pg_catalog.=) 'head'
                          AND h.ordering_key OPERATOR(pg_catalog.=) k.key
                          AND coalesce(h.subscription_id, 0) OPERATOR(pg_catalog.=) k.subscription)
), promoted AS (
    UPDATE outbox.log AS e
       SET key_state = 'head',
           available_at = GREATEST(e.available_at, pg_catalog.now()),
           -- In line as if this transaction had enqueued it, or, a
           -- delayed event, out of line until due: events_pending_again
           -- says which (sql/schema.sql), as for any event made pending.
           pending_xid = pg_catalog.pg_current_xact_id()
      FROM next
     WHERE e.id OPERATOR(pg_catalog.=) next.id
       AND e.key_state OPERATOR(pg_catalog.=) 'waiting'
       AND e.status OPERATOR(pg_catalog.=) 'pending'
    RETURNING e.id
)
SELECT (SELECT pg_catalog.count(*) FROM passed), (SELECT pg_catalog.count(*) FROM promoted)
