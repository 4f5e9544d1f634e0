-- Accumulated subscriptions whose batch is due: batch_max members waiting
-- (due ones: delay applies), or more member bytes than one batch may carry
-- ($1), or the oldest waited batch_wait, or the subscription ended (what
-- waits goes at once). Only subscription $3 when it is given; never the
-- ones in $2 (their last flush failed: the dispatcher backs off). Each
-- such subscription gets one batch: an event row with its task, whose one
-- positional argument is the list of its oldest members (id, event_type,
-- payload, and args when they have them), cut at batch_max members and at
-- $1 bytes of their JSON, the size that will be sent (the first member
-- always goes: outbox_enqueue() held it to outbox.max_payload_bytes). The
-- batch goes to the subscription's queue, or else to its oldest member's.
-- The members point to the batch, in the same transaction: a crash keeps
-- both or neither. FOR NO KEY UPDATE SKIP LOCKED: one dispatcher flushes a
-- subscription at a time. Returns the subscription of each member batched.
-- Served by batch_members_waiting_idx.
WITH due AS (
    SELECT s.id, s.event_type, s.task, s.queue, s.priority, s.batch_max
      FROM outbox.all_subscriptions AS s
     CROSS JOIN LATERAL (
           SELECT pg_catalog.count(*) AS members, pg_catalog.sum(w.bytes) AS bytes,
                  pg_catalog.min(w.available_at) AS oldest
             FROM (SELECT m.available_at, m.bytes
                     FROM outbox.batch_members AS m
                    WHERE m.subscription_id = s.id
                      AND m.batch_id IS NULL
                      AND m.available_at <= pg_catalog.now()
                    ORDER BY m.available_at
                    LIMIT s.batch_max) AS w) AS waiting
     WHERE s.batch_max IS NOT NULL
       AND ($3::bigint IS NULL OR s.id = $3::bigint)
       AND s.id <> ALL ($2::bigint[])
       AND waiting.members > 0
       AND (waiting.members >= s.batch_max
            OR waiting.bytes >= $1
            OR waiting.oldest <= pg_catalog.now() - s.batch_wait
            OR s.unsubscribed_at IS NOT NULL)
       FOR NO KEY UPDATE OF s SKIP LOCKED
), taken AS (
    SELECT m.subscription_id, m.event_id, m.event_type, m.payload, m.args, m.queue, m.available_at
      FROM due
     CROSS JOIN LATERAL (
           SELECT m.*, pg_catalog.sum(m.bytes) OVER (ORDER BY m.available_at, m.event_id) AS running_bytes,
                  pg_catalog.row_number() OVER (ORDER BY m.available_at, m.event_id) AS position
             FROM (SELECT m.*
                     FROM outbox.batch_members AS m
                    WHERE m.subscription_id = due.id
                      AND m.batch_id IS NULL
                      AND m.available_at <= pg_catalog.now()
                    ORDER BY m.available_at, m.event_id
                    LIMIT due.batch_max
                      FOR UPDATE) AS m) AS m
     WHERE m.position = 1 OR m.running_bytes <= $1
), batch AS (
    INSERT INTO outbox.log (event_type, payload, args, queue, task, headers, priority, available_at,
                               subscription_id)
    SELECT due.event_type, '{}', pg_catalog.jsonb_build_array(pg_catalog.jsonb_agg(
               pg_catalog.jsonb_build_object('id', t.event_id, 'event_type', t.event_type, 'payload', t.payload)
               || CASE WHEN t.args IS NULL THEN '{}' ELSE pg_catalog.jsonb_build_object('args', t.args) END
               ORDER BY t.available_at, t.event_id)),
           coalesce(due.queue, (pg_catalog.array_agg(t.queue ORDER BY t.available_at, t.event_id))[1]),
           due.task, pg_catalog.jsonb_build_object('outbox_subscription_id', due.id),
           coalesce(due.priority, 0), pg_catalog.now(), due.id
      FROM due
      JOIN taken AS t ON t.subscription_id = due.id
     GROUP BY due.id, due.event_type, due.queue, due.task, due.priority
    RETURNING id, subscription_id
)
UPDATE outbox.batch_members AS m
   SET batch_id = batch.id,
       payload = NULL,
       args = NULL
  FROM taken
  JOIN batch ON batch.subscription_id = taken.subscription_id
 WHERE m.event_id = taken.event_id
   AND m.subscription_id = taken.subscription_id
RETURNING m.subscription_id
