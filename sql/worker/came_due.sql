-- Events out of line whose time has come (delayed, or backing off after a
-- failed push): up to $1 of them go in line, as if this transaction had
-- enqueued them. Earliest first; served by events_due_idx, read from $2
-- (due_floor.sql, in seconds since the epoch), below which none waits.
-- SKIP LOCKED: a row another session holds is put in line by the next
-- round.
WITH due AS (
    SELECT id
      FROM outbox.log
     WHERE pending_xid IS NULL
       AND status = 'pending'
       AND key_state IS DISTINCT FROM 'waiting'
       AND available_at >= pg_catalog.to_timestamp($2)
       AND available_at <= pg_catalog.clock_timestamp()
     ORDER BY available_at, id
     LIMIT $1
       FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE outbox.log AS e
   SET pending_xid = pg_catalog.pg_current_xact_id()
  FROM due
 WHERE e.id = due.id
