-- The time below which no event out of line until due can appear any more
-- in events_due_idx (the floor of the scans of came_due.sql, next_due.sql
-- and in_line.sql is raised to it by due_floor.sql, a later statement).
-- Under a pinned xmin the entries of every event that came due since stay
-- in the index, dead but not removable; a scan from the index's start
-- would read them all, at every claim.
--
-- An event goes out of line only due after the moment it is written,
-- which its transaction's clock says once it holds the RowExclusiveLock a
-- write takes on outbox.log until it ends (the triggers of sql/schema.sql,
-- keys/pass.sql, mark_failed.sql all compare with clock_timestamp()). So
-- the only ones still to come below a time T are those of transactions
-- that hold that lock now (since their start, at worst): the bound is the
-- earlier of now and the start of each; none when one's start is not
-- known (a prepared transaction's, or a session's this role may not see:
-- pg_read_all_stats shows them). A transaction that ended before this
-- statement read pg_locks is seen by the next statement's snapshot.
-- Functions and relations are qualified; operators resolve in pg_catalog
-- through the search_path every dispatcher pins.
SELECT pg_catalog.date_part('epoch', LEAST(pg_catalog.clock_timestamp(), pg_catalog.min(
           CASE WHEN l.virtualtransaction LIKE '-1/%' THEN '-infinity'
                ELSE coalesce(a.xact_start, '-infinity') END)))
  FROM pg_catalog.pg_locks AS l
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'relation'
   AND l.granted
   AND l.mode = 'RowExclusiveLock'
   AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                      WHERE d.datname = pg_catalog.current_database())
   AND l.relation IN (SELECT t.relid FROM pg_catalog.pg_partition_tree('outbox.log') AS t)
   AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid()
