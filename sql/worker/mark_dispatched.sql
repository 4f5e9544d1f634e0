-- Batch $1, claimed by dispatcher $2, was pushed: its events are in the
-- broker, but those this transaction puts back in line or dead-letters
-- (which leave the batch). Recorded only while the claim is still $2's (a
-- sweeper gives a claim that took too long back, abandoned_at): returns
-- whether it was, and locks the batch's row until the transaction ends,
-- so no sweeper takes it meanwhile.
UPDATE outbox.batches
   SET marked_at = pg_catalog.now()
 WHERE id = $1
   AND dispatcher = $2
   AND marked_at IS NULL
   AND abandoned_at IS NULL
RETURNING id
