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
   -- The batches' outcomes read once, into a hash (NOT IN of a subquery
   -- that names no outer column: a hashed SubPlan, whatever the planner
   -- thinks of the join; no NULL in it). A lookup per member would read
   -- every outcome row of its batch for each.
   AND NOT EXISTS (SELECT
                     FROM outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
                    WHERE (b.id, m.id) NOT IN (SELECT o.batch, r.id
                                                 FROM outbox.outcomes AS o
                                                CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
                                                WHERE o.batch = ANY ($1::bigint[]) AND r.id IS NOT NULL))
