-- Is key $1 (of subscription $2; 0: an event's own key) taken: does its
-- newest event (of those that took a turn) hold it or wait for it? Events of a key finish in key_seq
-- order, so the newest says it for all. Run as of now, whatever the
-- caller's isolation (src/keys.rs), under the key's lock. Served by
-- events_key_idx: the scan reads the newest entry first.
SELECT e.key_state IS NOT NULL
  FROM outbox.log AS e
 WHERE e.ordering_key OPERATOR(pg_catalog.=) $1
   AND coalesce(e.subscription_id, 0) OPERATOR(pg_catalog.=) $2
   AND e.key_seq IS NOT NULL
 ORDER BY e.key_seq DESC
 LIMIT 1
