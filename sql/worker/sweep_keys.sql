-- Keys no statement passed on (src/keys.rs): up to $3 heads finished and
-- still holding their key (processed; failed too with $1,
-- outbox.key_on_failure = continue; dispatched too with $2, nothing to
-- report or acknowledge them) and up to $3 keys with events waiting and no
-- head. Left so by an outbox_ack() or outbox_skip() run at repeatable read
-- (its snapshot may miss an event that came to wait since), a hand-made
-- UPDATE or DELETE, a change of those settings, or a dispatcher that died
-- before it passed a key a producer held. Returns the head's id (NULL for
-- a key without one), the key and its subscription (0: none). Served by
-- events_key_state_idx.
(SELECT h.id, h.ordering_key, coalesce(h.subscription_id, 0)
   FROM outbox.log AS h
  WHERE h.key_state = 'head'
    AND (outbox.event_status(h.status, h.pending_xid, h.id, h.key_state) = 'processed'
         OR (h.status = 'failed' AND $1)
         OR (outbox.event_status(h.status, h.pending_xid, h.id, h.key_state) = 'dispatched' AND $2))
  LIMIT $3)
UNION ALL
(SELECT NULL, w.ordering_key, w.subscription
   FROM (SELECT DISTINCT e.ordering_key, coalesce(e.subscription_id, 0) AS subscription
           FROM outbox.log AS e
          WHERE e.key_state = 'waiting') AS w
  WHERE NOT EXISTS (SELECT FROM outbox.log AS h
                     WHERE h.key_state = 'head'
                       AND h.ordering_key = w.ordering_key
                       AND coalesce(h.subscription_id, 0) = w.subscription)
  LIMIT $3)
