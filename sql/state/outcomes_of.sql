-- The events of batch $1 that have an outcome (reported processed, or
-- acknowledged): src/state.rs keeps them with the batch. Served by
-- outcomes_batch_idx.
SELECT r.id
  FROM outbox.outcomes AS o
 CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
 WHERE o.batch OPERATOR(pg_catalog.=) $1
