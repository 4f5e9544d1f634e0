-- Events $1 failed for a reason of their own ($3). Each goes back to pending
-- after its backoff ($4 milliseconds), or to failed (the dead letter) when it
-- has no retries left; $2 says which. Only where claim ($5, $6) still holds
-- them. Returns the heads of keys among the dead-lettered ones
-- (src/keys.rs), which hold their key unless outbox.key_on_failure says
-- to go on. (Multi-argument unnest is syntax and cannot be qualified; the
-- pinned search_path resolves it in pg_catalog.)
WITH marked AS (
    UPDATE outbox.log AS e
       SET status = f.status::outbox.event_status,
           retry_count = e.retry_count + 1,
           last_error = f.error,
           available_at = pg_catalog.now() + f.delay_ms * interval '1 millisecond',
           processing_started_at = NULL,
           claimed_by = NULL
      FROM unnest($1::uuid[], $2::text[], $3::text[], $4::float8[]) AS f(id, status, error, delay_ms)
     WHERE e.id = f.id
       AND e.status = 'processing'
       AND e.claimed_by = $5
       AND e.processing_started_at = $6
    RETURNING e.id, e.status, e.key_state, e.ordering_key, coalesce(e.subscription_id, 0) AS subscription
)
SELECT id, ordering_key, subscription FROM marked WHERE key_state = 'head' AND status = 'failed'
