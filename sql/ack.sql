-- outbox_ack($1, $2): the consumer has processed the event, as the send
-- $2 carried it (the message's outbox_send header; NULL: the one send
-- there has been). Taken only while the event is in a batch that may
-- still be acknowledged, and of that batch's send: an acknowledgement
-- names what it acknowledges, as a report does. Without $2, only an
-- event sent once (no earlier send to mistake for this one). Not of an
-- event never sent (delayed, waiting for its key's turn), nor of one
-- back in line to be sent again (which send it saw cannot be told: it is
-- sent again, under the same task id), nor once failed or processed;
-- without $2, not until the dispatcher has recorded the push (a batch
-- claimed and not marked may not have been sent: an id alone proves no
-- receipt). The batch's row is held until the caller's transaction ends
-- (FOR KEY SHARE) so that the sweepers, which lock it FOR UPDATE SKIP
-- LOCKED before they settle or abandon it, either see this outcome or
-- have put the event back in line; it holds up no dispatcher's mark or
-- settling of the batch, plain updates of it (a consumer may keep its
-- transaction open). Returns, for an event that
-- could be acknowledged, whether it was, its key when it held it (it then
-- passes it on: src/keys.rs), and whether it was refused for want of $2.
-- Served by the primary keys and outcomes_batch_idx.
WITH e AS (
    SELECT l.id, l.generation, l.key_state, l.ordering_key, coalesce(l.subscription_id, 0) AS subscription,
           l.deliveries, outbox.batch_of(l.pending_xid, l.id) AS batch
      FROM outbox.log AS l
     WHERE l.id = $1
       AND l.status = 'pending'
       AND l.key_state IS DISTINCT FROM 'waiting'
), held AS (
    -- Not once the batch is settled or abandoned (its events went back in
    -- line, or were failed; rechecked once a sweeper's lock is let go).
    SELECT b.id,
           CASE WHEN $2::pg_catalog.uuid IS NULL THEN e.deliveries = 0 AND b.marked_at IS NOT NULL
                ELSE outbox.send_of(b.send, e.id) = $2::pg_catalog.uuid END AS named
      FROM outbox.batches AS b, e
     WHERE b.id = e.batch AND b.settled_at IS NULL AND b.abandoned_at IS NULL
       FOR KEY SHARE OF b
), recorded AS (
    INSERT INTO outbox.outcomes (batch, generation, events)
    SELECT e.batch, e.generation, ARRAY[e.id]
      FROM e
     WHERE e.batch IN (SELECT held.id FROM held WHERE held.named)
       AND NOT EXISTS (SELECT FROM outbox.outcomes AS o WHERE o.batch = e.batch AND e.id = ANY (o.events))
    RETURNING events[1] AS event
)
SELECT e.id IN (SELECT recorded.event FROM recorded), CASE WHEN e.key_state = 'head' THEN e.id END,
       e.ordering_key, e.subscription,
       $2::pg_catalog.uuid IS NULL AND EXISTS (SELECT FROM held WHERE NOT held.named)
  FROM e
