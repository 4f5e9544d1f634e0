-- outbox_ack($1): the consumer has processed the event. Accepted while the
-- event is pending (a re-send is queued), processing (the consumer was
-- faster than the dispatcher's mark) or dispatched. Served by the primary key.
UPDATE outbox.events
   SET status = 'processed',
       processed_at = now()
 WHERE id = $1
   AND status IN ('pending', 'processing', 'dispatched')
