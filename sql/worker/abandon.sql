-- Claims nobody will mark: up to $3 batches not marked, claimed by
-- dispatcher $1 (a dispatcher that restarted: what it held before it died
-- is nobody's now) or, with $1 NULL, claimed longer than $2 milliseconds
-- ago (a dispatcher that died or hung). Their events go back in line, as
-- if this transaction had enqueued them, but for those with an outcome (a
-- worker reported, or a consumer acknowledged, what the push delivered):
-- sent again, such an event would go out after its key's next. No send is
-- counted: whether the push reached the broker is unknown, and a
-- dispatcher that crashes before pushing must not spend what
-- outbox.max_redeliveries allows. The batch is abandoned, and a late mark
-- finds it so. SKIP LOCKED: never wait on a claim being marked. Served by
-- batches_unmarked_idx. Returns the batches, whose events
-- reline_abandoned.sql puts back, in a statement of its own.
UPDATE outbox.batches AS b
   SET abandoned_at = pg_catalog.now()
  FROM (SELECT id
          FROM outbox.batches
         WHERE marked_at IS NULL
           AND abandoned_at IS NULL
           AND ($1::integer IS NULL OR dispatcher = $1)
           AND ($1::integer IS NOT NULL OR claimed_at < pg_catalog.now() - $2 * interval '1 millisecond')
         ORDER BY claimed_at
         LIMIT $3
           FOR UPDATE SKIP LOCKED) AS stuck
 WHERE b.id = stuck.id
RETURNING b.id
