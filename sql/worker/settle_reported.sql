-- Batches $1, marked, whose every event has an outcome (reported
-- processed or acknowledged) or left them (failed, or back in line):
-- nothing more is awaited of them, and they leave batches_unsettled_idx
-- (outbox.unreported, the unacknowledged sweeper). Run after the reports
-- that touched them, in the same transaction.
UPDATE outbox.batches AS b
   SET settled_at = pg_catalog.now()
 WHERE b.id = ANY ($1::bigint[])
   AND b.settled_at IS NULL
   AND b.marked_at IS NOT NULL
   -- (Each set read once and compared by hashing: a lookup per member
   -- would read every outcome row of the batch for each.)
   AND NOT EXISTS (SELECT m.id
                     FROM outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
                   EXCEPT
                   SELECT r.id
                     FROM outbox.outcomes AS o CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
                    WHERE o.batch = b.id)
