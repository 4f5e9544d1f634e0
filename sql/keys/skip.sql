-- outbox_skip($1): a dead-lettered event that holds its key (a head,
-- failed, outbox.key_on_failure = block) stays a dead letter, and its key
-- goes on to the next event (pass.sql, once this returns its key).
-- Served by the primary key.
SELECT e.ordering_key, coalesce(e.subscription_id, 0)
  FROM outbox.events AS e
 WHERE e.id OPERATOR(pg_catalog.=) $1
   AND e.status OPERATOR(pg_catalog.=) 'failed'
   AND e.key_state OPERATOR(pg_catalog.=) 'head'
   FOR NO KEY UPDATE
