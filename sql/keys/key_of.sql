-- The key event $1 holds, when it is its key's head: for outbox_ack() and
-- outbox_skip(), which take the key's lock (lock.sql) before they change
-- the event, so that they hold no lock of the event's row while they wait
-- for a producer of the key to commit. Served by the primary key.
SELECT e.ordering_key, coalesce(e.subscription_id, 0)
  FROM outbox.log AS e
 WHERE e.id OPERATOR(pg_catalog.=) $1
   AND e.key_state OPERATOR(pg_catalog.=) 'head'
