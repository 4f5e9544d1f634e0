-- The accumulated subscriptions, when their batches are made one by one
-- (flush_batches.sql failed for all at once). A handful of rows, read whole.
SELECT id
  FROM outbox.all_subscriptions
 WHERE batch_max IS NOT NULL
 ORDER BY id
