-- The gauges of outbox.metrics read from the database, one row per sample:
-- (name, status, value), status the one label there is (NULL for none). $1: outbox.retention in seconds. Each costs the
-- same however many events there are: the per-key gauges read
-- events_key_state_idx, the status its own view (counted up to a bound,
-- then estimated), the unreported events up to 10,001.
-- Run by outbox_metrics() in the library (src/views.rs), which adds the
-- counters and the dispatchers' gauges, and without it (sql/standalone/).
WITH keys AS (
    SELECT (SELECT pg_catalog.count(*) FROM outbox.log WHERE key_state = 'waiting')::float8 AS waiting,
           (SELECT pg_catalog.count(*) FROM (SELECT DISTINCT ordering_key, coalesce(subscription_id, 0)
                                               FROM outbox.log WHERE key_state = 'waiting') AS k)::float8
               AS keys_waiting,
           (SELECT pg_catalog.count(*) FROM outbox.log WHERE key_state = 'head' AND status = 'failed')::float8
               AS dead_lettered,
           GREATEST(coalesce((SELECT pg_catalog.date_part('epoch', pg_catalog.now() - pg_catalog.min(available_at))
                                FROM outbox.log WHERE key_state = 'head' AND available_at <= pg_catalog.now()), 0),
                    0) AS oldest_head
), status AS (
    SELECT s.status::pg_catalog.text AS status, s.count::float8 AS count, s.estimated,
           pg_catalog.date_part('epoch', s.lag) AS lag
      FROM outbox.status AS s
)
SELECT 'outbox_purge_lag_seconds', NULL::pg_catalog.text,
       GREATEST(coalesce(pg_catalog.date_part('epoch', pg_catalog.now() - pg_catalog.min(g.ended_at)
                                              - $1::pg_catalog.int4 * interval '1 second'), 0), 0)
  FROM outbox.generations AS g
UNION ALL
SELECT 'outbox_oldest_transaction_seconds', NULL,
       GREATEST(coalesce(pg_catalog.date_part('epoch', pg_catalog.now() - LEAST(
           (SELECT pg_catalog.min(a.xact_start) FROM pg_catalog.pg_stat_activity AS a
             WHERE a.datname = pg_catalog.current_database()
               AND a.backend_type = 'client backend'
               AND a.pid <> pg_catalog.pg_backend_pid()
               AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)),
           (SELECT pg_catalog.min(p.prepared) FROM pg_catalog.pg_prepared_xacts AS p
             WHERE p.database = pg_catalog.current_database()))), 0), 0)
UNION ALL
SELECT 'outbox_events_dead_tuples', NULL,
       coalesce(pg_catalog.sum(pg_catalog.pg_stat_get_dead_tuples(p.relid)), 0)::float8
  FROM pg_catalog.pg_partition_tree('outbox.log'::pg_catalog.regclass) AS p
 WHERE p.isleaf
UNION ALL
(SELECT 'outbox_events', s.status, s.count FROM status AS s)
UNION ALL
(SELECT 'outbox_events_estimated', s.status, s.estimated::integer::float8
   FROM status AS s)
UNION ALL
SELECT 'outbox_lag_seconds', NULL, coalesce((SELECT pg_catalog.max(s.lag) FROM status AS s), 0)
UNION ALL
SELECT 'outbox_events_waiting', NULL, k.waiting FROM keys AS k
UNION ALL
SELECT 'outbox_keys_waiting', NULL, k.keys_waiting FROM keys AS k
UNION ALL
SELECT 'outbox_keys_dead_lettered', NULL, k.dead_lettered FROM keys AS k
UNION ALL
SELECT 'outbox_key_head_seconds', NULL, k.oldest_head FROM keys AS k
UNION ALL
SELECT 'outbox_events_unreported', NULL,
       (SELECT pg_catalog.count(*) FROM (SELECT FROM outbox.unreported LIMIT 10001) AS u)::float8
