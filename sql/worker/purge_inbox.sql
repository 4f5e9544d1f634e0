-- Delete up to $2 inbox rows claimed more than $1 milliseconds ago
-- (outbox.inbox_retention), oldest first; returns how many. Served by
-- inbox_claimed_at_idx. (Dead index entries of earlier batches are walked
-- again until a vacuum: the purge deletes at most a round per
-- outbox.lifecycle_interval.)
WITH expired AS (
    SELECT id, consumer
      FROM outbox.inbox
     WHERE claimed_at < pg_catalog.now() - $1 * interval '1 millisecond'
     ORDER BY claimed_at
     LIMIT $2
)
DELETE FROM outbox.inbox AS i
 USING expired
 WHERE i.id = expired.id
   AND i.consumer = expired.consumer
