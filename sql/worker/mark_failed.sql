-- Events $1 of a batch this transaction holds (mark_dispatched.sql), read
-- at positions ($1, $2), failed for a reason of their own ($4), or refused
-- by part of the broker for a while ($6 false: no retry spent). Each goes
-- out of line until its backoff ($5 milliseconds) has passed, or to the
-- dead letter when it has no retries left; $3 says which. Only those still
-- in line where the claim read them. Returns the heads of keys among the
-- dead-lettered ones (src/keys.rs), which hold their key unless
-- outbox.key_on_failure says to go on. (Multi-argument unnest is syntax and
-- cannot be qualified; the pinned search_path resolves it in pg_catalog.)
WITH marked AS (
    UPDATE outbox.log AS e
       SET status = f.status::outbox.event_status,
           retry_count = e.retry_count + f.spent::pg_catalog.int4,
           last_error = f.error,
           available_at = pg_catalog.clock_timestamp() + f.delay_ms * interval '1 millisecond',
       -- Out of the batch, which did not send it: back in line when due,
       -- or never (a dead letter).
       pending_xid = NULL
      FROM unnest($1::uuid[], $2::xid8[], $3::text[], $4::text[], $5::float8[], $6::bool[])
           AS f(id, pending_xid, status, error, delay_ms, spent)
     WHERE e.id = f.id
       AND e.pending_xid = f.pending_xid
       AND e.status = 'pending'
       -- Delivered before, and acknowledged since: done.
       AND NOT EXISTS (SELECT FROM outbox.outcomes AS o WHERE o.batch = outbox.batch_of(e.pending_xid, e.id, true) AND e.id = ANY (o.events))
    RETURNING e.id, e.status, e.key_state, e.ordering_key, coalesce(e.subscription_id, 0) AS subscription
)
SELECT id, ordering_key, subscription FROM marked WHERE key_state = 'head' AND status = 'failed'
