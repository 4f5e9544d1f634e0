-- The next batch of subscription $1 could not be made, for a reason that
-- would not pass ($2, the error): its members (the ones flush_batches.sql
-- would have taken, batch_max of them, cut at $3 bytes) are dead-lettered,
-- each as a failed batch of one with that error, so that outbox_retry() on
-- one sends it alone and the others do not wait behind it. The reason is
-- also kept on the subscription (outbox.subscriptions.last_error). Returns
-- the ids of the failed batches. Served by batch_members_waiting_idx.
WITH subscription AS (
    UPDATE outbox.all_subscriptions AS s
       SET last_error = $2,
           last_error_at = pg_catalog.now()
     WHERE s.id = $1
    RETURNING s.id, s.event_type, s.task, s.queue, s.priority, s.batch_max
), taken AS (
    SELECT m.*, pg_catalog.gen_random_uuid() AS failed_id
      FROM subscription AS s
     CROSS JOIN LATERAL (
           SELECT m.*, pg_catalog.sum(m.bytes) OVER (ORDER BY m.available_at, m.event_id) AS running_bytes,
                  pg_catalog.row_number() OVER (ORDER BY m.available_at, m.event_id) AS position
             FROM (SELECT m.*
                     FROM outbox.batch_members AS m
                    WHERE m.subscription_id = s.id
                      AND m.batch_id IS NULL
                      AND m.available_at <= pg_catalog.now()
                    ORDER BY m.available_at, m.event_id
                    LIMIT s.batch_max
                      FOR UPDATE) AS m) AS m
     WHERE m.position = 1 OR m.running_bytes <= $3
), failed AS (
    INSERT INTO outbox.log (id, event_type, payload, args, queue, task, headers, priority, available_at,
                               subscription_id, status, last_error)
    SELECT t.failed_id, s.event_type, '{}',
           pg_catalog.jsonb_build_array(pg_catalog.jsonb_build_array(
               pg_catalog.jsonb_build_object('id', t.event_id, 'event_type', t.event_type, 'payload', t.payload)
               || CASE WHEN t.args IS NULL THEN '{}' ELSE pg_catalog.jsonb_build_object('args', t.args) END)),
           coalesce(s.queue, t.queue), s.task, pg_catalog.jsonb_build_object('outbox_subscription_id', s.id),
           coalesce(s.priority, 0), pg_catalog.now(), s.id, 'failed', $2
      FROM subscription AS s
      JOIN taken AS t ON t.subscription_id = s.id
    RETURNING id
)
UPDATE outbox.batch_members AS m
   SET batch_id = t.failed_id,
       payload = NULL,
       args = NULL
  FROM taken AS t
 WHERE m.event_id = t.event_id
   AND m.subscription_id = t.subscription_id
RETURNING t.failed_id
