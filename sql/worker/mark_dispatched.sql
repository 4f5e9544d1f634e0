-- Batch $1, claimed by dispatcher $2, was pushed: its events are in the
-- broker, but those this transaction puts back in line or dead-letters
-- (which leave the batch). With $3 (outbox.ack_timeout above 0), what it
-- sent awaits acknowledgements, whatever the setting becomes; without,
-- none (a raise of the setting applies to what is sent after it).
-- Recorded only while the claim is still $2's (a sweeper gives a claim
-- that took too long back, abandoned_at): returns whether it was, and
-- locks the batch's row until the transaction ends, so no sweeper takes it
-- meanwhile. Found by its primary key: the test is one that
-- batches_unmarked_idx cannot serve, whose entries a pinned xmin keeps for
-- every batch marked since.
UPDATE outbox.batches
   SET marked_at = pg_catalog.now(),
       awaits_ack = $3
 WHERE id = $1
   AND dispatcher = $2
   AND pg_catalog.num_nulls(marked_at, abandoned_at) = 2
RETURNING id
