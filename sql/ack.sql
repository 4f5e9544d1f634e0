-- outbox_ack($1): the consumer has processed the event. Accepted while the
-- event is pending (a re-send is queued), processing (the consumer was
-- faster than the dispatcher's mark) or dispatched, but not while it waits
-- for its key's turn (it was never sent). Returns the event, and
-- its key when it held it (it then passes it on: src/keys.rs). Served by
-- the primary key.
UPDATE outbox.log
   SET status = 'processed',
       processed_at = now()
 WHERE id = $1
   AND status IN ('pending', 'processing', 'dispatched')
   AND key_state IS DISTINCT FROM 'waiting'
RETURNING CASE WHEN key_state = 'head' THEN id END, ordering_key, coalesce(subscription_id, 0)
