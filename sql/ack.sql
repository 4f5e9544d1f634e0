-- outbox_ack($1): the consumer has processed the event. Taken while the
-- event is in a batch (an outcome row: the event is not written), or in
-- line or out of it waiting to be sent again (it is recorded processed
-- there, and not sent), but not while it waits for its key's turn (it was
-- never sent), nor once failed or processed. The batch's row is held for
-- the moment (FOR SHARE) so that the unacknowledged sweeper, which settles
-- it first, either sees this outcome or has put the event back in line.
-- Returns the event, and its key when it held it (it then passes it on:
-- src/keys.rs). Served by the primary keys and outcomes_batch_idx.
WITH e AS (
    SELECT l.id, l.generation, l.key_state, l.ordering_key, coalesce(l.subscription_id, 0) AS subscription,
           outbox.batch_of(l.pending_xid, l.id) AS batch
      FROM outbox.log AS l
     WHERE l.id = $1
       AND l.status = 'pending'
       AND l.key_state IS DISTINCT FROM 'waiting'
), held AS (
    -- Not once the batch is settled or abandoned (its events went back in
    -- line, or were failed; rechecked once a sweeper's lock is let go).
    SELECT b.id
      FROM outbox.batches AS b, e
     WHERE b.id = e.batch AND b.settled_at IS NULL AND b.abandoned_at IS NULL
       FOR SHARE OF b
), recorded AS (
    INSERT INTO outbox.outcomes (batch, generation, events)
    SELECT e.batch, e.generation, ARRAY[e.id]
      FROM e
     WHERE e.batch IN (SELECT held.id FROM held)
       AND NOT EXISTS (SELECT FROM outbox.outcomes AS o WHERE o.batch = e.batch AND e.id = ANY (o.events))
    RETURNING events[1] AS event
), stored AS (
    UPDATE outbox.log AS l
       SET status = 'processed'
      FROM e
     WHERE e.batch IS NULL
       AND l.id = e.id
       AND l.generation = e.generation
    RETURNING l.id
)
SELECT CASE WHEN e.key_state = 'head' THEN e.id END, e.ordering_key, e.subscription
  FROM e
 WHERE e.id IN (SELECT recorded.event FROM recorded UNION ALL SELECT stored.id FROM stored)
