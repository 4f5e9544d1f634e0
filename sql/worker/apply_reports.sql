-- Outcomes reported by Celery workers (outbox_dispatch.celery): event $1[i],
-- sent as send $2[i], ended $3[i] ('processed' or 'failed'), with error
-- $4[i]. Taken only for the send the event is at: the batch that holds it
-- must be the one with that send (new at every claim; per event,
-- outbox.send_of()). A report proves
-- which send it answers, so one for an event never sent, a late one of an
-- earlier send, or a guess changes nothing. Taken while the batch is
-- marked or not (a report may overtake the dispatcher's own record of the
-- push). Processed: in an outcome row (the event is not written); failed:
-- the event is dead-lettered. Returns the outcome of each event that took
-- one, its key when it is its key's head (src/keys.rs: finished now,
-- unless it failed and outbox.key_on_failure blocks), and its batch
-- (settle_reported.sql); the rest were stale.
-- Served by the primary keys, batches_to_idx and outcomes_batch_idx.
WITH hit AS (
    SELECT r.id, e.generation, r.outcome, r.error, b.id AS batch, e.key_state, e.ordering_key,
           coalesce(e.subscription_id, 0) AS subscription
      FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[]) AS r(id, send, outcome, error)
      JOIN outbox.log AS e ON e.id = r.id AND e.status = 'pending'
      -- Dispatcher -1: the batches of the events 0.9.0 had sent, made by
      -- the update to 0.10.0; their messages carry the sends 0.9.0 drew per
      -- event, which it did not keep: a report of one processed names the
      -- event alone (a failure, which dead-letters, is not taken so).
      JOIN outbox.batches AS b ON b.id = outbox.batch_of(e.pending_xid, e.id)
                              AND (outbox.send_of(b.send, e.id) = r.send
                                   OR (b.dispatcher = -1 AND r.outcome = 'processed'))
     -- Held for the moment, as outbox_ack() holds it (FOR KEY SHARE): a
     -- sweeper that settles or abandons the batch (and puts its events
     -- back in line) either sees this outcome or has done so, and then
     -- this finds it settled or abandoned.
     WHERE b.settled_at IS NULL
       AND b.abandoned_at IS NULL
       FOR KEY SHARE OF b
), recorded AS MATERIALIZED (
    -- What the hit batches have recorded, read once, into a hash below
    -- (settle_reported.sql; a lookup per report would read every outcome
    -- row of its batch).
    SELECT o.batch, r.id
      FROM outbox.outcomes AS o CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
     WHERE o.batch IN (SELECT hit.batch FROM hit) AND r.id IS NOT NULL
), processed AS (
    SELECT outbox.record_outcomes(pg_catalog.array_agg(n.batch), pg_catalog.array_agg(n.generation),
                                  pg_catalog.array_agg(n.id), NULL) AS id
      FROM (SELECT DISTINCT hit.batch, hit.generation, hit.id
              FROM hit
             WHERE hit.outcome = 'processed'
               AND (hit.batch, hit.id) NOT IN (SELECT r.batch, r.id FROM recorded AS r)) AS n
), failed AS (
    UPDATE outbox.log AS e
       SET status = 'failed',
           last_error = hit.error
      FROM hit
     WHERE hit.outcome = 'failed'
       AND e.id = hit.id
       AND e.generation = hit.generation
       AND (hit.batch, hit.id) NOT IN (SELECT r.batch, r.id FROM recorded AS r)
    RETURNING e.id
)
SELECT hit.outcome, CASE WHEN hit.key_state = 'head' THEN hit.id END, hit.ordering_key, hit.subscription,
       hit.batch
  FROM hit
 WHERE hit.id IN (SELECT processed.id FROM processed UNION ALL SELECT failed.id FROM failed)
