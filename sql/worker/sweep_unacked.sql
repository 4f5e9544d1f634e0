-- The events of batches $1, which this transaction settled
-- (settle_unacked.sql), without an outcome: each is sent again under the
-- same task id (back in line, counted as sent), or, once sent $2
-- (outbox.max_redeliveries) times already, failed with a last_error that
-- says so. An event whose key went on without it (outbox_skip(), or
-- passed on as sent while acknowledgements were off) is failed too,
-- saying so: the events of its key sent since must not be overtaken by it
-- (outbox_retry() sends it again behind them). A statement of its own,
-- after the batches are locked: its snapshot sees every acknowledgement
-- that took its batch's row before (ack.sql), and the later ones wait for
-- this transaction, then find the batch settled. Returns, per event,
-- whether it was failed, and its key when it is its key's head
-- (src/keys.rs). Served by the primary keys and events_pending_xid_idx.
WITH unacked AS (
    SELECT m.id, m.pending_xid
      FROM outbox.batches AS b
     CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
     WHERE b.id = ANY ($1)
       -- The batches' outcomes read once, into a hash (settle_reported.sql).
       AND (b.id, m.id) NOT IN (SELECT o.batch, r.id
                                  FROM outbox.outcomes AS o CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
                                 WHERE o.batch = ANY ($1) AND r.id IS NOT NULL)
)
UPDATE outbox.log AS e
   SET status = (CASE WHEN e.deliveries + 1 > $2 OR (e.ordering_key IS NOT NULL AND e.key_state IS NULL)
                      THEN 'failed' ELSE 'pending' END)::outbox.event_status,
       last_error = CASE WHEN e.ordering_key IS NOT NULL AND e.key_state IS NULL
                         THEN 'not acknowledged, and not sent again: its key went on without it '
                              '(outbox_skip(), or passed on as sent while outbox.ack_timeout was 0)'
                         WHEN e.deliveries + 1 > $2
                         THEN pg_catalog.format('not acknowledged after %s sends (outbox.max_redeliveries = %s)',
                                                e.deliveries + 1, $2)
                         ELSE e.last_error END,
       deliveries = e.deliveries + 1,
       -- Out of its batch: in line again, or (failed) nowhere.
       pending_xid = CASE WHEN e.deliveries + 1 > $2 OR (e.ordering_key IS NOT NULL AND e.key_state IS NULL)
                          THEN NULL ELSE pg_catalog.pg_current_xact_id() END
  FROM unacked
 WHERE e.id = unacked.id
   AND e.pending_xid = unacked.pending_xid
RETURNING e.status = 'failed', CASE WHEN e.key_state = 'head' THEN e.id END, e.ordering_key,
          coalesce(e.subscription_id, 0)
