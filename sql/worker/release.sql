-- Events $1 of a batch this transaction holds, read at positions $2, were
-- not delivered for the broker's reasons: back in line at once, as if this
-- transaction had enqueued them, no retry spent; but for one with an
-- outcome (delivered before, and acknowledged since).
UPDATE outbox.log AS e
   SET pending_xid = pg_catalog.pg_current_xact_id()
  FROM unnest($1::uuid[], $2::xid8[]) AS r(id, pending_xid)
 WHERE e.id = r.id
   AND e.pending_xid = r.pending_xid
   AND e.status = 'pending'
   AND NOT EXISTS (SELECT FROM outbox.outcomes AS o WHERE o.batch = outbox.batch_of(e.pending_xid, e.id, true) AND e.id = ANY (o.events))
