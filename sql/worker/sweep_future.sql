-- Pending events whose transaction id lies in this cluster's future: rows
-- a data-only restore brought from a busier cluster with its triggers
-- disabled (pg_restore --disable-triggers), so that events_pending_again
-- did not put them in line. No claim reaches them until this cluster's
-- transaction ids catch up: up to $1 of them are put in line now, as if
-- this transaction had made them pending. Served by events_pending_xid_idx,
-- read from its top.
WITH future AS (
    SELECT id
      FROM outbox.log
     WHERE status = 'pending'
       AND key_state IS DISTINCT FROM 'waiting'
       AND pending_xid >= pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())
     ORDER BY pending_xid DESC
     LIMIT $1
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox.log AS e
   SET pending_xid = pg_catalog.pg_current_xact_id()
  FROM future
 WHERE e.id = future.id
