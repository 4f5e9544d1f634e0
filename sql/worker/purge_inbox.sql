-- Delete up to $2 inbox rows claimed more than $1 milliseconds ago
-- (outbox.inbox_retention), oldest first, but none whose event is still
-- here and not processed (failed, pending, sent: it may run again, and
-- would make its effects twice); returns how many. Served by
-- inbox_claimed_at_idx and the events' primary key. (Dead index entries
-- of earlier batches are walked again until a vacuum: the purge deletes at
-- most a round per outbox.lifecycle_interval.)
WITH expired AS (
    SELECT id, consumer
      FROM outbox.inbox
     WHERE claimed_at < pg_catalog.now() - $1 * interval '1 millisecond'
       AND NOT EXISTS (SELECT FROM outbox.log AS e
                        WHERE e.id = inbox.id
                          AND e.status <> 'processed')
     ORDER BY claimed_at
     LIMIT $2
)
DELETE FROM outbox.inbox AS i
 USING expired
 WHERE i.id = expired.id
   AND i.consumer = expired.consumer
