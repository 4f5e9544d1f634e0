-- The events of batches $1, which this transaction abandoned
-- (abandon.sql), back in line, but for those with an outcome. A statement
-- of its own, after the batches are locked: its snapshot sees every
-- acknowledgement that took its batch's row before (ack.sql), and the later
-- ones wait for this transaction, then find the batch abandoned. Served by
-- the primary keys and events_pending_xid_idx. Returns how many went back.
UPDATE outbox.log AS e
   SET pending_xid = pg_catalog.pg_current_xact_id()
  FROM outbox.batches AS b
 CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
 WHERE b.id = ANY ($1)
   AND e.id = m.id
   AND e.pending_xid = m.pending_xid
   -- The batches' outcomes read once, into a hash (settle_reported.sql).
   AND (b.id, e.id) NOT IN (SELECT o.batch, r.id
                              FROM outbox.outcomes AS o CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
                             WHERE o.batch = ANY ($1) AND r.id IS NOT NULL)
