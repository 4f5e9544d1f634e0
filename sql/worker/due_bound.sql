-- The time below which no event out of line until due can appear any more
-- in events_due_idx (the floor of the scans of came_due.sql, next_due.sql
-- and in_line.sql is raised to it by due_floor.sql, a later statement).
-- Under a pinned xmin the entries of every event that came due since stay
-- in the index, dead but not removable; a scan from the index's start
-- would read them all, at every claim.
--
-- An event goes out of line only due after the moment it is written, and
-- its transaction holds from then until it ends a shared advisory lock
-- (1869968482, a number it drew) that says so (outbox_pending_again(),
-- sql/schema.sql, which every write that makes an event pending goes
-- through; the rotation's move keeps the due time it had, above the
-- floor). So the only
-- ones still to come below a time T are those of transactions that hold
-- it now (since their start, at worst): the bound is the earlier of now
-- and the start of each; none when one's start is not known (a prepared
-- transaction's, or a session's this role may not see: pg_read_all_stats
-- shows them). A transaction that ended before this statement read
-- pg_locks is seen by the next statement's snapshot. A session idle in
-- its transaction after an enqueue holds nothing here unless it delayed
-- an event. Any role may take such a lock: one that holds one only brings
-- the floor down to its start (-infinity while idle), as a long
-- transaction that delays an event does. Functions and relations are
-- qualified; operators resolve in
-- pg_catalog through the search_path every dispatcher pins.
SELECT pg_catalog.date_part('epoch', LEAST(pg_catalog.clock_timestamp(), pg_catalog.min(
           CASE WHEN l.virtualtransaction LIKE '-1/%' THEN '-infinity'
                ELSE coalesce(a.xact_start, '-infinity') END)))
  FROM pg_catalog.pg_locks AS l
  LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'advisory'
   AND l.classid = 1869968482
   AND l.objsubid = 2
   AND l.granted
   AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                      WHERE d.datname = pg_catalog.current_database())
   AND l.pid IS DISTINCT FROM pg_catalog.pg_backend_pid()
