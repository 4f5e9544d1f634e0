-- Locks keys $1 (of subscriptions $2; 0: an event's own key), each once and
-- in the order of their locks, so that two sessions passing keys never
-- wait for each other in a cycle. With $3, waits for each (a session's
-- outbox_ack() or outbox_skip() waits for a producer of the key to commit);
-- without, takes only those free (a dispatcher is never held up by a
-- producer's open transaction). Returns the keys locked. The lock is the
-- one outbox_take_turn() (sql/keys.sql) takes and holds to its commit.
-- (pg_advisory_xact_lock() returns void, whose text is '': true once
-- granted.)
WITH keys AS MATERIALIZED (
    SELECT DISTINCT k.key, k.subscription, pg_catalog.hashtextextended(k.key, k.subscription) AS lock
      FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), pg_catalog.unnest($2::pg_catalog.int8[]))
           AS k(key, subscription)
     ORDER BY 3
)
SELECT keys.key, keys.subscription
  FROM keys
 WHERE CASE WHEN $3 THEN pg_catalog.pg_advisory_xact_lock(keys.lock)::pg_catalog.text OPERATOR(pg_catalog.=) ''
            ELSE pg_catalog.pg_try_advisory_xact_lock(keys.lock) END
