-- outbox_dispatch 0.8.0 → 0.9.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- One head per key, whatever writes the row (README, "Per-key order").

-- A key with two heads or more (an insert that copied a head, before this
-- version) keeps the first in its order; the others that are still pending
-- wait behind it, and those already sent or failed let the key go.
WITH heads AS (
    SELECT id, status,
           row_number() OVER (PARTITION BY ordering_key, coalesce(subscription_id, 0) ORDER BY key_seq, id) AS n
      FROM outbox.events
     WHERE key_state = 'head'
)
UPDATE outbox.events AS e
   SET key_state = CASE WHEN heads.status = 'pending' THEN 'waiting' END
  FROM heads
 WHERE e.id = heads.id
   AND heads.n > 1;

CREATE UNIQUE INDEX events_key_head_idx ON outbox.events (ordering_key, (coalesce(subscription_id, 0)))
    WHERE key_state = 'head';

-- An insert that brings the turn of another row of its key takes a new one.
CREATE OR REPLACE FUNCTION @extschema@.outbox_take_turn() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    IF NEW.key_seq IS NOT NULL AND NEW.key_state IS NOT NULL
       AND NOT EXISTS (SELECT FROM outbox.events AS e
                        WHERE e.ordering_key OPERATOR(pg_catalog.=) NEW.ordering_key
                          AND coalesce(e.subscription_id, 0) OPERATOR(pg_catalog.=) coalesce(NEW.subscription_id, 0)
                          AND e.key_seq OPERATOR(pg_catalog.=) NEW.key_seq) THEN
        RETURN NEW;
    END IF;
    PERFORM pg_catalog.pg_advisory_xact_lock(
        pg_catalog.hashtextextended(NEW.ordering_key, coalesce(NEW.subscription_id, 0)));
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
    BEFORE UPDATE OF ordering_key, key_seq, key_state ON outbox.events
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending'
                       AND (NEW.key_seq IS NULL OR NEW.key_state IS NULL))
    EXECUTE FUNCTION @extschema@.outbox_take_turn();
