-- outbox_dispatch 0.8.0 → 0.9.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- One head per key, and one row per turn, whatever writes the row (README,
-- "Per-key order"). Before this version an insert could copy a turn.

-- A key with two heads or more keeps one: the one in flight if any, else
-- the first in its order. Of the others, those still pending take a new
-- turn behind the key's events (key_seq cleared: the trigger
-- events_take_turn, as it was, gives them one), and those sent or failed
-- let the key go.
WITH heads AS (
    SELECT id, status,
           row_number() OVER (PARTITION BY ordering_key, coalesce(subscription_id, 0)
                              ORDER BY status = 'pending', key_seq, id) AS n
      FROM outbox.events
     WHERE key_state = 'head'
)
UPDATE outbox.events AS e
   SET key_seq = CASE WHEN heads.status = 'pending' THEN NULL ELSE e.key_seq END,
       key_state = NULL
  FROM heads
 WHERE e.id = heads.id
   AND heads.n > 1;

-- Rows of a key that share a turn keep one, the head if it is one of them:
-- the others still pending take a new turn, the others give theirs up.
WITH turns AS (
    SELECT id,
           row_number() OVER (PARTITION BY ordering_key, coalesce(subscription_id, 0), key_seq
                              ORDER BY key_state IS DISTINCT FROM 'head', status = 'pending', id) AS n
      FROM outbox.events
     WHERE key_seq IS NOT NULL
)
UPDATE outbox.events AS e
   SET key_seq = NULL,
       key_state = CASE WHEN e.status = 'pending' THEN e.key_state END
  FROM turns
 WHERE e.id = turns.id
   AND turns.n > 1;

DROP INDEX outbox.events_key_idx;
CREATE UNIQUE INDEX events_key_idx ON outbox.events (ordering_key, (coalesce(subscription_id, 0)), key_seq)
    WHERE key_seq IS NOT NULL;
CREATE UNIQUE INDEX events_key_head_idx ON outbox.events (ordering_key, (coalesce(subscription_id, 0)))
    WHERE key_state = 'head';

CREATE FUNCTION @extschema@."outbox_turn_fits"(
    "ordering_key" TEXT,
    "subscription" bigint,
    "key_seq" bigint,
    "key_state" TEXT
) RETURNS bool
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_turn_fits_wrapper';
REVOKE ALL ON FUNCTION @extschema@.outbox_turn_fits(text, bigint, bigint, text) FROM PUBLIC;

-- An insert that brings a turn keeps it only when it fits the key, under
-- the key's lock; a row made pending again without a turn takes one.
CREATE OR REPLACE FUNCTION @extschema@.outbox_take_turn() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(
        pg_catalog.hashtextextended(NEW.ordering_key, coalesce(NEW.subscription_id, 0)));
    IF NEW.key_seq IS NOT NULL AND NEW.key_state IS NOT NULL
       AND @extschema@.outbox_turn_fits(NEW.ordering_key, coalesce(NEW.subscription_id, 0),
                                        NEW.key_seq, NEW.key_state) THEN
        RETURN NEW;
    END IF;
    NEW.key_seq := pg_catalog.nextval('outbox.key_seq'::pg_catalog.regclass);
    NEW.key_state := CASE WHEN @extschema@.outbox_key_taken(NEW.ordering_key, coalesce(NEW.subscription_id, 0))
                          THEN 'waiting' ELSE 'head' END;
    RETURN NEW;
END
$$;

DROP TRIGGER events_take_turn ON outbox.events;
CREATE TRIGGER events_take_turn
    BEFORE INSERT ON outbox.events
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending')
    EXECUTE FUNCTION @extschema@.outbox_take_turn();
CREATE TRIGGER events_take_turn_again
    BEFORE UPDATE OF status, ordering_key, key_seq, key_state ON outbox.events
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending'
                       AND (NEW.key_seq IS NULL OR NEW.key_state IS NULL))
    EXECUTE FUNCTION @extschema@.outbox_take_turn();

-- Its comment names the trigger that gives a retried event its new turn.
CREATE OR REPLACE FUNCTION @extschema@.outbox_retry(id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- send_id cleared: a report of the failed send, replayed, finishes
    -- nothing (the next claim gives it a new one). An event with a key
    -- that still holds it is its head again; one whose key went on
    -- without it (outbox.key_on_failure = continue, outbox_skip()) takes
    -- a new turn, behind the key's events (key_seq cleared: the trigger
    -- events_take_turn_again).
    UPDATE outbox.events AS e
       SET status = 'pending',
           retry_count = 0,
           available_at = pg_catalog.clock_timestamp(),
           processing_started_at = NULL,
           claimed_by = NULL,
           send_id = NULL,
           key_seq = CASE WHEN e.key_state IS NULL THEN NULL ELSE e.key_seq END
     WHERE e.id = outbox_retry.id
       AND e.status = 'failed';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM @extschema@.outbox_wake();
    RETURN true;
END
$$;
