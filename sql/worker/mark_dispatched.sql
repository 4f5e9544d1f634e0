-- Events $1 are in Redis; recorded only where claim ($2, $3) still holds
-- them (a sweeper may have given a slow claim to someone else). Returns
-- the heads of keys among them (src/keys.rs), which are finished now if
-- nothing is to report or acknowledge them.
WITH marked AS (
    UPDATE outbox.log
       SET status = 'dispatched',
           dispatched_at = pg_catalog.now(),
           deliveries = deliveries + 1,
           last_error = NULL
     WHERE id = ANY($1)
       AND status = 'processing'
       AND claimed_by = $2
       AND processing_started_at = $3
    RETURNING id, key_state, ordering_key, coalesce(subscription_id, 0) AS subscription
)
SELECT id, ordering_key, subscription FROM marked WHERE key_state = 'head'
