-- Batches marked more than $1 milliseconds ago, while acknowledgements
-- were on (awaits_ack: one marked while they were off awaits none), whose
-- events may still be acknowledged (outbox_ack()): up to $2 of them are
-- settled, locked until this transaction ends; returns their ids, for
-- sweep_unacked.sql. Served by batches_unacked_idx; SKIP LOCKED: never
-- wait on a batch being marked or acknowledged.
UPDATE outbox.batches AS b
   SET settled_at = pg_catalog.now()
  FROM (SELECT id
          FROM outbox.batches
         WHERE settled_at IS NULL
           AND awaits_ack
           AND marked_at < pg_catalog.now() - $1 * interval '1 millisecond'
         ORDER BY marked_at
         LIMIT $2
           FOR UPDATE SKIP LOCKED) AS due
 WHERE b.id = due.id
RETURNING b.id
