-- Dispatched more than $1 milliseconds ago and never acknowledged with
-- outbox_ack(): up to $2 of them are sent again under the same task id, or,
-- once re-sent $3 (outbox.max_redeliveries) times already, failed with a
-- last_error that says so. An event whose key went on without it
-- (outbox_skip(), or passed on as sent while acknowledgements were off) is
-- failed too, saying so: the events of its key sent since must not be
-- overtaken by it (outbox_retry() sends it again behind them). Returns, per
-- event, whether it was failed, and its key when it is its key's head
-- (src/keys.rs).
-- Served by events_dispatched_idx.
WITH unacked AS (
    SELECT id, deliveries > $3 AS exhausted, ordering_key IS NOT NULL AND key_state IS NULL AS passed
      FROM outbox.log
     WHERE status = 'dispatched'
       AND dispatched_at < pg_catalog.now() - $1 * interval '1 millisecond'
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
UPDATE outbox.log AS e
   SET status = (CASE WHEN unacked.exhausted OR unacked.passed THEN 'failed' ELSE 'pending' END)::outbox.event_status,
       last_error = CASE WHEN unacked.passed
                         THEN 'not acknowledged, and not sent again: its key went on without it '
                              '(outbox_skip(), or passed on as sent while outbox.ack_timeout was 0)'
                         WHEN unacked.exhausted
                         THEN pg_catalog.format('not acknowledged after %s sends (outbox.max_redeliveries = %s)',
                                                e.deliveries, $3)
                         ELSE e.last_error END,
       available_at = pg_catalog.now(),
       processing_started_at = NULL,
       claimed_by = NULL
  FROM unacked
 WHERE e.id = unacked.id
RETURNING unacked.exhausted OR unacked.passed, CASE WHEN e.key_state = 'head' THEN e.id END, e.ordering_key,
          coalesce(e.subscription_id, 0)
