-- Events $1 of a batch this transaction holds, about to leave it (failed,
-- or back in line: mark_failed.sql, release.sql), locked first, in one
-- order: a consumer's outbox_ack() that took one and passed its key on
-- (sql/ack.sql holds the batch FOR KEY SHARE alone, which the mark does
-- not wait for) has committed by the time the next statements take their
-- snapshots, and they see its outcome: an event acknowledged is never put
-- back in line behind its key's next.
SELECT
  FROM outbox.log AS e
 WHERE e.id = ANY ($1::uuid[])
 ORDER BY e.id
   FOR NO KEY UPDATE
