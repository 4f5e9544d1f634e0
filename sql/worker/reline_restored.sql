-- Pending events in generation $1's pages $2 to $2 + $3 - 1 in line at a
-- place the claims have passed: rows a data-only restore (or a copy)
-- wrote with the log's triggers off (outbox.triggers_off()) kept the
-- transaction id they came with, which may lie inside windows the claims
-- had read. Such a row was written after the claims that passed its
-- place: the batch that read that place sent what was there then (its
-- xmin is not in the batch's target snapshot), or no batch holds it and
-- the window it lies in has been read whole (the cursor's `prev` sees its
-- transaction ended). (A row written in line names its own transaction,
-- pending_xid = xmin, unless written in a subtransaction: the cheap test
-- first.) A head that let its key go was sent, and one with an outcome is
-- done: left alone. The others are put in line, as if this transaction
-- had made them pending; a batch's member written since its claim without
-- a new place (moved by the rotation, edited by hand) is among them, and
-- is sent again under its id. Returns the rows put in line. One partition
-- (its generation), a range of its pages in order.
WITH now8 AS (
    SELECT pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())::pg_catalog.text::pg_catalog.int8 AS xid
)
UPDATE outbox.log AS e
   SET pending_xid = pg_catalog.pg_current_xact_id()
  FROM now8, outbox.cursor AS c
 WHERE e.generation = $1
   AND e.ctid >= pg_catalog.format('(%s,0)', $2)::pg_catalog.tid
   AND e.ctid < pg_catalog.format('(%s,0)', $2::pg_catalog.int8 + $3)::pg_catalog.tid
   AND e.status = 'pending'
   AND e.key_state IS DISTINCT FROM 'waiting'
   AND NOT (e.ordering_key IS NOT NULL AND e.key_state IS NULL)
   AND e.xmin::pg_catalog.text::pg_catalog.int8 <> e.pending_xid::pg_catalog.text::pg_catalog.int8 % 4294967296
   AND (SELECT CASE WHEN b.id IS NULL
                    THEN pg_catalog.pg_visible_in_snapshot(e.pending_xid, c.prev)
                    ELSE NOT pg_catalog.pg_visible_in_snapshot(
                             -- xmin with its epoch: the newest transaction
                             -- id's, or the one before for an xmin above it.
                             (CASE WHEN w.xid > now8.xid THEN w.xid - 4294967296 ELSE w.xid END)
                                 ::pg_catalog.text::pg_catalog.xid8, b.target)
                         AND NOT EXISTS (SELECT FROM outbox.outcomes AS o
                                          WHERE o.batch = b.id AND e.id = ANY (o.events))
               END
          FROM (SELECT now8.xid - now8.xid % 4294967296 + e.xmin::pg_catalog.text::pg_catalog.int8 AS xid) AS w
          LEFT JOIN outbox.batches AS b ON b.id = outbox.batch_of(e.pending_xid, e.id, true))
RETURNING e.id
