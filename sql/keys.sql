-- outbox_dispatch: per-key order (docs/guides/per-key-order.md; src/keys.rs).
--
-- Events with the same ordering_key (per subscription, for deliveries) are
-- sent one at a time, in the order their transactions committed: the next
-- only once the one before is finished (processed, acknowledged, or sent
-- when nothing reports or acknowledges it). Only a key's head is claimed;
-- the events behind it wait, in no index the claim reads.

-- Every name below resolves in pg_catalog or is qualified: nothing binds an
-- object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- An event with a key takes its turn as it is inserted, by
-- outbox_enqueue() or an ORM's INSERT, or as outbox_retry() sends it again
-- after its key went on without it. It takes its key's lock, an advisory
-- lock held to its commit: producers of one key commit one after the other,
-- so key_seq, taken under the lock, is their commit order. It becomes the
-- head when no event of the key is unfinished, or waits behind them.
-- A row inserted with a turn of its own (key_seq and key_state set, as a
-- restore's rows are) keeps it when it fits the key (outbox_turn_fits():
-- in whatever order a restore's rows come); one that does not (a copy of
-- another row, into its key or another) takes a new one. A key never has
-- two heads, nor two rows of one key_seq (events_key_head_idx and
-- events_key_idx say so too).
-- (The lock is the one the dispatchers try, src/keys.rs and
-- sql/keys/lock.sql, before they pass a key on.) SECURITY DEFINER: writers
-- need no rights on the sequence, nor to read outbox.events; every name
-- is qualified, as in outbox_route().
CREATE FUNCTION @extschema@.outbox_take_turn() RETURNS trigger
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
    -- Out of line while it waits: its turn coming puts it in line.
    IF NEW.key_state OPERATOR(pg_catalog.=) 'waiting' THEN
        NEW.pending_xid := NULL;
    END IF;
    RETURN NEW;
END
$$;

-- A turn is the owner's to give: a row that a role without the owner's
-- privileges inserts (a writer, through outbox.events or outbox_enqueue())
-- with a key_seq or a key_state takes its turn afresh, as one without
-- them does, however large or well placed the one it brings: a writer
-- never puts its event before one committed earlier. The owner's own
-- inserts (a restore, the routing's deliveries) keep theirs when they fit
-- (outbox_turn_fits()). Named to fire before the other insert triggers;
-- the WHEN is evaluated without a function call.
CREATE FUNCTION outbox.writers_take_turns() RETURNS trigger
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user, outbox.owner(), 'USAGE') THEN
        NEW.key_seq := NULL;
        NEW.key_state := NULL;
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER events_from_writers
    BEFORE INSERT ON outbox.log
    FOR EACH ROW WHEN (NEW.key_seq IS NOT NULL OR NEW.key_state IS NOT NULL)
    EXECUTE FUNCTION outbox.writers_take_turns();
-- Also where triggers are off for replication.
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_from_writers;
REVOKE ALL ON FUNCTION outbox.writers_take_turns() FROM PUBLIC;

-- Named to fire after events_route: an event routed to subscriptions is
-- processed at once, and its deliveries take turns of their own. Every
-- pending event inserted with a key takes a turn, or keeps the one it
-- brings (above); one updated so that it is pending with a key and no turn
-- (key_seq unset, or key_state unset as it became pending: a retry of an
-- event whose key went on without it, a hand edit) takes one. Not a head
-- letting its key go (key_state unset, its status as it was).
CREATE TRIGGER events_take_turn
    BEFORE INSERT ON outbox.log
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending'
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_take_turn();
CREATE TRIGGER events_take_turn_again
    BEFORE UPDATE OF status, ordering_key, key_seq, key_state ON outbox.log
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending'
                       AND (NEW.key_seq IS NULL
                            OR (NEW.key_state IS NULL
                                AND (OLD.status <> 'pending' OR OLD.ordering_key IS DISTINCT FROM NEW.ordering_key))))
    EXECUTE FUNCTION @extschema@.outbox_take_turn();

-- Keys whose head is not about to be sent: in flight, waiting for its
-- backoff or its delay, or dead-lettered (since: when its batch claimed it
-- or was marked, else when it became due); then keys with events waiting
-- and no head (head NULL, since: when the first fell due), which the
-- dispatchers pass on within seconds. Served by events_key_state_idx.
CREATE VIEW outbox.blocked_keys AS
SELECT h.ordering_key, h.subscription_id, h.id AS head, h.status,
       CASE h.status
           WHEN 'processing' THEN (SELECT b.claimed_at FROM outbox.batches AS b WHERE b.id = h.batch)
           WHEN 'dispatched' THEN (SELECT b.marked_at FROM outbox.batches AS b WHERE b.id = h.batch)
           ELSE h.available_at
       END AS since,
       h.last_error,
       (SELECT pg_catalog.count(*)
          FROM outbox.log AS w
         WHERE w.key_state = 'waiting'
           AND w.ordering_key = h.ordering_key
           AND coalesce(w.subscription_id, 0) = coalesce(h.subscription_id, 0)) AS waiting
  FROM (SELECT e.id, e.ordering_key, e.subscription_id, e.available_at, e.last_error,
               outbox.event_status(e.status, e.pending_xid, e.id, e.key_state) AS status,
               outbox.batch_of(e.pending_xid, e.id) AS batch
          FROM outbox.log AS e
         WHERE e.key_state = 'head') AS h
 WHERE NOT (h.status = 'pending' AND h.available_at <= pg_catalog.now())
UNION ALL
SELECT w.ordering_key, w.subscription_id, NULL, NULL, pg_catalog.min(w.available_at), NULL, pg_catalog.count(*)
  FROM outbox.log AS w
 WHERE w.key_state = 'waiting'
   AND NOT EXISTS (SELECT FROM outbox.log AS h
                    WHERE h.key_state = 'head'
                      AND h.ordering_key = w.ordering_key
                      AND coalesce(h.subscription_id, 0) = coalesce(w.subscription_id, 0))
 GROUP BY w.ordering_key, w.subscription_id;

COMMENT ON VIEW outbox.blocked_keys IS
    'Keys whose head (the one event of the key that may be sent) is in flight, not yet due, or dead-lettered, with the events waiting behind it; then keys with events waiting and no head (head NULL). A failed head holds its key until outbox_retry() or outbox_skip() (outbox.key_on_failure = block).';

-- The extension's schema again, for the functions pgrx declares next.
SET LOCAL search_path = @extschema@;
