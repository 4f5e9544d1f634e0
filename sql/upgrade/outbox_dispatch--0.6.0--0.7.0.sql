-- outbox_dispatch 0.6.0 → 0.7.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- Per-key order (README, "Per-key order"; sql/keys.sql). The columns are
-- NULL for every event from before: none has a key. The CHECKs read the
-- table once; nothing is rewritten.
ALTER TABLE outbox.events
    ADD COLUMN ordering_key text
        CONSTRAINT events_ordering_key_length CHECK (octet_length(ordering_key) BETWEEN 1 AND 255),
    ADD COLUMN key_seq bigint,
    ADD COLUMN key_state text
        CONSTRAINT events_key_state
            CHECK (key_state IS NULL OR (key_state IN ('head', 'waiting') AND ordering_key IS NOT NULL));

-- The claim's indexes leave out events waiting for their key's turn:
-- rebuilt (each reads the pending events once, under the update's lock).
DROP INDEX outbox.events_pending_xid_idx;
DROP INDEX outbox.events_pending_idx;
CREATE INDEX events_pending_xid_idx ON outbox.events (pending_xid, id)
    WHERE status = 'pending' AND key_state IS DISTINCT FROM 'waiting';
CREATE INDEX events_pending_idx ON outbox.events (available_at, id)
    WHERE status = 'pending' AND key_state IS DISTINCT FROM 'waiting';

-- A key's turn come puts its new head in line.
DROP TRIGGER events_pending_again ON outbox.events;
CREATE TRIGGER events_pending_again
    BEFORE INSERT OR UPDATE OF status, available_at, pending_xid, key_state ON outbox.events
    FOR EACH ROW WHEN (NEW.status = 'pending' AND NEW.pending_xid <> pg_catalog.pg_current_xact_id())
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER events_pending_again;

CREATE INDEX events_key_idx ON outbox.events (ordering_key, (coalesce(subscription_id, 0)), key_seq)
    WHERE key_seq IS NOT NULL;
CREATE INDEX events_key_state_idx ON outbox.events (key_state, ordering_key, (coalesce(subscription_id, 0)), key_seq)
    WHERE key_state IS NOT NULL;
CREATE SEQUENCE outbox.key_seq;
SELECT pg_catalog.pg_extension_config_dump('outbox.key_seq', '');

CREATE FUNCTION @extschema@."outbox_key_taken"(
    "ordering_key" TEXT,
    "subscription" bigint
) RETURNS bool
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_key_taken_wrapper';

CREATE FUNCTION @extschema@."outbox_skip"(
    "id" uuid
) RETURNS bool
STRICT VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path TO pg_catalog, pg_temp
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_skip_wrapper';

CREATE FUNCTION @extschema@.outbox_take_turn() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(
        pg_catalog.hashtextextended(NEW.ordering_key, coalesce(NEW.subscription_id, 0)));
    NEW.key_seq := pg_catalog.nextval('outbox.key_seq'::pg_catalog.regclass);
    NEW.key_state := CASE WHEN @extschema@.outbox_key_taken(NEW.ordering_key, coalesce(NEW.subscription_id, 0))
                          THEN 'waiting' ELSE 'head' END;
    RETURN NEW;
END
$$;

CREATE TRIGGER events_take_turn
    BEFORE INSERT OR UPDATE OF ordering_key, key_seq, key_state ON outbox.events
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending'
                       AND (NEW.key_seq IS NULL OR NEW.key_state IS NULL))
    EXECUTE FUNCTION @extschema@.outbox_take_turn();

-- Deliveries keep the event's key, per subscription.
CREATE OR REPLACE FUNCTION @extschema@.outbox_route() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    routed integer;
BEGIN
    PERFORM FROM outbox.all_subscriptions AS s
      WHERE s.unsubscribed_at IS NULL
        AND (s.event_type OPERATOR(pg_catalog.=) NEW.event_type
             OR pg_catalog.starts_with(NEW.event_type, s.prefix));
    IF NOT FOUND THEN
        NEW.routed_to := 0;
        RETURN NEW;
    END IF;

    WITH matched AS (
        SELECT s.id, s.task, s.queue, s.priority, s.batch_max
          FROM outbox.all_subscriptions AS s
         WHERE s.unsubscribed_at IS NULL
           AND (s.event_type OPERATOR(pg_catalog.=) NEW.event_type
                OR pg_catalog.starts_with(NEW.event_type, s.prefix))
    ), delivered AS (
        INSERT INTO outbox.events (event_id, subscription_id, event_type, payload, args, queue, task,
                                   headers, priority, created_at, available_at, expires_at, ordering_key)
        SELECT NEW.id, m.id, NEW.event_type, NEW.payload, NEW.args, coalesce(m.queue, NEW.queue), m.task,
               coalesce(NEW.headers, '{}'::pg_catalog.jsonb) OPERATOR(pg_catalog.||)
                   pg_catalog.jsonb_build_object('outbox_event_id', NEW.id, 'outbox_subscription_id', m.id),
               coalesce(m.priority, NEW.priority), NEW.created_at, NEW.available_at, NEW.expires_at,
               NEW.ordering_key
          FROM matched AS m
         WHERE m.batch_max IS NULL
    ), accumulated AS (
        -- bytes: the member's JSON in its batch (id, event_type, payload,
        -- args and their punctuation), which the flush cuts batches by.
        INSERT INTO outbox.batch_members (event_id, subscription_id, event_type, payload, args, queue, bytes,
                                          available_at)
        SELECT NEW.id, m.id, NEW.event_type, NEW.payload, NEW.args, NEW.queue,
               pg_catalog.octet_length(NEW.payload::pg_catalog.text)
                   OPERATOR(pg_catalog.+) coalesce(pg_catalog.octet_length(NEW.args::pg_catalog.text), 0)
                   OPERATOR(pg_catalog.+) pg_catalog.octet_length(NEW.event_type) OPERATOR(pg_catalog.+) 80,
               NEW.available_at
          FROM matched AS m
         WHERE m.batch_max IS NOT NULL
    )
    SELECT pg_catalog.count(*) INTO routed FROM matched;

    NEW.status := 'processed';
    NEW.processed_at := pg_catalog.clock_timestamp();
    NEW.routed_to := routed;
    RETURN NEW;
END
$$;

-- outbox_enqueue gains ordering_key: a new signature is a new function, so
-- the roles granted EXECUTE on the old one are granted it on the new one.
CREATE TEMPORARY TABLE outbox_enqueue_grantees ON COMMIT DROP AS
SELECT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
            ELSE a.grantee::pg_catalog.regrole::pg_catalog.text END AS grantee
  FROM pg_catalog.pg_proc AS p,
       pg_catalog.aclexplode(p.proacl) AS a
 WHERE p.oid OPERATOR(pg_catalog.=) '@extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb)'::pg_catalog.regprocedure
   AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
   AND a.grantee OPERATOR(pg_catalog.<>) p.proowner;

DROP FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb);

CREATE FUNCTION @extschema@.outbox_enqueue(
    event_type text,
    payload    jsonb,
    queue      text     DEFAULT NULL,
    task       text     DEFAULT NULL,
    headers    jsonb    DEFAULT NULL,
    delay      interval DEFAULT NULL,
    priority   integer  DEFAULT 0,
    expires    interval DEFAULT NULL,
    args       jsonb    DEFAULT NULL,
    ordering_key text   DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    max_name_bytes CONSTANT integer := 255;
    max_payload    CONSTANT integer := @extschema@.outbox_max_payload_bytes();
    resolved_queue CONSTANT pg_catalog.text := coalesce(queue,
                                      pg_catalog.current_setting('outbox.default_queue', true), 'celery');
    -- Made here rather than returned by the INSERT: RETURNING would need
    -- SELECT on outbox.events, which writers are not granted.
    new_id         CONSTANT pg_catalog.uuid := @extschema@.outbox_uuid_v7();
    payload_bytes  CONSTANT integer := pg_catalog.pg_column_size(payload)
                                       OPERATOR(pg_catalog.+) coalesce(pg_catalog.pg_column_size(args), 0);
    event_bytes    CONSTANT integer := pg_catalog.octet_length(event_type);
    queue_bytes    CONSTANT integer := pg_catalog.octet_length(resolved_queue);
    task_bytes     CONSTANT integer := pg_catalog.octet_length(task);
    key_bytes      CONSTANT integer := pg_catalog.octet_length(ordering_key);
    enqueued_at    CONSTANT pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
    -- One test for the common case; the ones inside say what is wrong.
    IF event_type IS NULL OR payload IS NULL OR priority IS NULL
       OR event_bytes OPERATOR(pg_catalog.<) 1 OR event_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR queue_bytes OPERATOR(pg_catalog.<) 1 OR queue_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR task_bytes OPERATOR(pg_catalog.<) 1 OR task_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR key_bytes OPERATOR(pg_catalog.<) 1 OR key_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR payload_bytes OPERATOR(pg_catalog.>) max_payload
       OR pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object'
       OR delay OPERATOR(pg_catalog.<) interval '0' OR NOT pg_catalog.isfinite(delay)
       OR priority OPERATOR(pg_catalog.<) 0 OR priority OPERATOR(pg_catalog.>) 9
       OR expires OPERATOR(pg_catalog.<=) interval '0'
       OR pg_catalog.jsonb_typeof(args) OPERATOR(pg_catalog.<>) 'array'
       OR (args IS NOT NULL AND pg_catalog.jsonb_typeof(payload) OPERATOR(pg_catalog.<>) 'object')
    THEN
        IF event_type IS NULL OR event_bytes OPERATOR(pg_catalog.=) 0 THEN
            RAISE EXCEPTION 'outbox_enqueue: event_type must not be null or empty'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF event_bytes OPERATOR(pg_catalog.>) max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: event_type is % bytes, the limit is % bytes',
                event_bytes, max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF queue_bytes OPERATOR(pg_catalog.<) 1 OR queue_bytes OPERATOR(pg_catalog.>) max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: queue is % bytes, it must be 1 to % bytes',
                queue_bytes, max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF task_bytes OPERATOR(pg_catalog.<) 1 OR task_bytes OPERATOR(pg_catalog.>) max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: task is % bytes, it must be 1 to % bytes',
                task_bytes, max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF key_bytes OPERATOR(pg_catalog.<) 1 OR key_bytes OPERATOR(pg_catalog.>) max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: ordering_key is % bytes, it must be 1 to % bytes (or null: no key)',
                key_bytes, max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF payload IS NULL THEN
            RAISE EXCEPTION 'outbox_enqueue: payload must not be null (use ''{}'' for a task without arguments)'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF payload_bytes OPERATOR(pg_catalog.>) max_payload THEN
            RAISE EXCEPTION 'outbox_enqueue: payload is % bytes as jsonb, over outbox.max_payload_bytes (% bytes)',
                payload_bytes, max_payload
                USING ERRCODE = 'program_limit_exceeded',
                      HINT = 'args count towards it.';
        END IF;
        IF pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object' THEN
            RAISE EXCEPTION 'outbox_enqueue: headers must be a JSON object, not %',
                pg_catalog.jsonb_typeof(headers)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF delay OPERATOR(pg_catalog.<) interval '0' OR NOT pg_catalog.isfinite(delay) THEN
            RAISE EXCEPTION 'outbox_enqueue: delay must be finite and not negative (got %)', delay
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF expires OPERATOR(pg_catalog.<=) interval '0' THEN
            RAISE EXCEPTION 'outbox_enqueue: expires must be positive (got %)', expires
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF pg_catalog.jsonb_typeof(args) OPERATOR(pg_catalog.<>) 'array' THEN
            RAISE EXCEPTION 'outbox_enqueue: args must be a JSON array, not %', pg_catalog.jsonb_typeof(args)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF args IS NOT NULL AND pg_catalog.jsonb_typeof(payload) OPERATOR(pg_catalog.<>) 'object' THEN
            RAISE EXCEPTION 'outbox_enqueue: with args, payload must be a JSON object (the keyword arguments), not %',
                pg_catalog.jsonb_typeof(payload)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RAISE EXCEPTION 'outbox_enqueue: priority is %, it must be 0 (highest) to 9', priority
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    INSERT INTO outbox.events (id, event_type, payload, args, queue, task, headers, priority,
                               available_at, expires_at, ordering_key)
    VALUES (new_id, event_type, payload, args, resolved_queue, task, headers, priority,
            enqueued_at OPERATOR(pg_catalog.+) coalesce(delay, interval '0'),
            enqueued_at OPERATOR(pg_catalog.+) expires, ordering_key);
    RETURN new_id;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb, text) IS
    'Enqueue an event in the current transaction; it is delivered as a Celery task after COMMIT.';

REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb, text) FROM PUBLIC;

DO $$
DECLARE
    grantee pg_catalog.text;
BEGIN
    FOR grantee IN SELECT g.grantee FROM pg_temp.outbox_enqueue_grantees AS g LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb, text) TO %s', grantee);
    END LOOP;
END
$$;

DROP TABLE pg_temp.outbox_enqueue_grantees;

-- A failed event retried after its key went on takes a new turn.
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
    -- events_take_turn).
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

CREATE OR REPLACE FUNCTION @extschema@.outbox_retry_failed(older_than interval DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    retried bigint;
    again uuid;
BEGIN
    IF older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox_retry_failed: older_than must not be negative (got %)', older_than
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE outbox.events AS e
       SET status = 'pending',
           retry_count = 0,
           available_at = pg_catalog.clock_timestamp(),
           processing_started_at = NULL,
           claimed_by = NULL,
           send_id = NULL
     WHERE e.status = 'failed'
       AND (e.ordering_key IS NULL OR e.key_state IS NOT NULL)
       AND (older_than IS NULL OR e.created_at <= pg_catalog.now() - older_than);
    GET DIAGNOSTICS retried = ROW_COUNT;
    -- Those whose key went on without them take new turns one by one, in
    -- the order of their keys and, within a key, of their first turns: the
    -- keys' locks are taken in sorted order, and a key gets them back in
    -- the order they were enqueued.
    FOR again IN
        SELECT e.id
          FROM outbox.events AS e
         WHERE e.status = 'failed'
           AND e.ordering_key IS NOT NULL AND e.key_state IS NULL
           AND (older_than IS NULL OR e.created_at <= pg_catalog.now() - older_than)
         ORDER BY e.ordering_key, coalesce(e.subscription_id, 0), e.key_seq
    LOOP
        IF @extschema@.outbox_retry(again) THEN
            retried := retried + 1;
        END IF;
    END LOOP;
    IF retried > 0 THEN
        PERFORM @extschema@.outbox_wake();
    END IF;
    RETURN retried;
END
$$;

-- Pending leaves out events waiting for their key; dead letters say
-- whether they hold theirs. Replaced in place: views built on them and
-- their privileges stay.
CREATE OR REPLACE VIEW outbox.status AS
WITH exact AS (
    SELECT 'pending'::outbox.event_status AS status, pg_catalog.count(*) AS count,
           pg_catalog.min(e.created_at) AS oldest_created_at,
           coalesce(pg_catalog.now() - pg_catalog.min(e.available_at)
                        FILTER (WHERE e.available_at <= pg_catalog.now()),
                    interval '0') AS lag
      FROM outbox.events AS e WHERE e.status = 'pending' AND e.key_state IS DISTINCT FROM 'waiting'
    UNION ALL
    SELECT 'processing', pg_catalog.count(*), pg_catalog.min(e.created_at), NULL
      FROM outbox.events AS e WHERE e.status = 'processing'
    UNION ALL
    SELECT 'failed', pg_catalog.count(*), pg_catalog.min(e.created_at), NULL
      FROM outbox.events AS e WHERE e.status = 'failed'
), finished AS (
    SELECT 'dispatched'::outbox.event_status AS status, 'outbox.events_dispatched_idx' AS index_name,
           (SELECT pg_catalog.count(*)
              FROM (SELECT FROM outbox.events AS e WHERE e.status = 'dispatched' LIMIT 1001) AS f) AS counted
    UNION ALL
    SELECT 'processed', 'outbox.events_processed_idx',
           (SELECT pg_catalog.count(*)
              FROM (SELECT FROM outbox.events AS e WHERE e.status = 'processed' LIMIT 1001) AS f)
)
SELECT status, count, oldest_created_at, pg_catalog.now() - oldest_created_at AS age, lag,
       false AS estimated
  FROM exact
UNION ALL
SELECT f.status,
       CASE WHEN f.counted <= 1000 THEN f.counted ELSE GREATEST(c.reltuples::bigint, f.counted) END,
       NULL, NULL, NULL, f.counted > 1000
  FROM finished AS f
  JOIN pg_catalog.pg_class AS c ON c.oid = pg_catalog.to_regclass(f.index_name)
 ORDER BY status;

COMMENT ON VIEW outbox.status IS
    'Events per status; lag is how long the oldest due pending event has waited. Pending leaves out events waiting for their key (outbox.blocked_keys). Dispatched and processed are counted up to 1000, then estimated from statistics (estimated = true).';

CREATE OR REPLACE VIEW outbox.dead_letters AS
SELECT id, event_type, queue, coalesce(task, event_type) AS task, payload, headers,
       retry_count, last_error, created_at, deliveries, args, event_id, subscription_id,
       ordering_key, key_state IS NOT DISTINCT FROM 'head' AS holds_key
  FROM outbox.events
 WHERE status = 'failed';

COMMENT ON VIEW outbox.dead_letters IS
    'Failed events with their last error: outbox.max_retries failed pushes, expired before delivery, never acknowledged after outbox.max_redeliveries re-sends, or failed in the Celery task. A delivery to a subscription has event_id and subscription_id; a batch, subscription_id alone. holds_key: it blocks its ordering_key until outbox_retry() or outbox_skip().';

CREATE VIEW outbox.blocked_keys AS
SELECT h.ordering_key, h.subscription_id, h.id AS head, h.status,
       CASE h.status
           WHEN 'processing' THEN h.processing_started_at
           WHEN 'dispatched' THEN h.dispatched_at
           WHEN 'failed' THEN coalesce(h.processed_at, h.available_at)
           ELSE h.available_at
       END AS since,
       h.last_error,
       (SELECT pg_catalog.count(*)
          FROM outbox.events AS w
         WHERE w.key_state = 'waiting'
           AND w.ordering_key = h.ordering_key
           AND coalesce(w.subscription_id, 0) = coalesce(h.subscription_id, 0)) AS waiting
  FROM outbox.events AS h
 WHERE h.key_state = 'head'
   AND NOT (h.status = 'pending' AND h.available_at <= pg_catalog.now())
UNION ALL
SELECT w.ordering_key, w.subscription_id, NULL, NULL, pg_catalog.min(w.available_at), NULL, pg_catalog.count(*)
  FROM outbox.events AS w
 WHERE w.key_state = 'waiting'
   AND NOT EXISTS (SELECT FROM outbox.events AS h
                    WHERE h.key_state = 'head'
                      AND h.ordering_key = w.ordering_key
                      AND coalesce(h.subscription_id, 0) = coalesce(w.subscription_id, 0))
 GROUP BY w.ordering_key, w.subscription_id;

COMMENT ON VIEW outbox.blocked_keys IS
    'Keys whose head (the one event of the key that may be sent) is in flight, not yet due, or dead-lettered, with the events waiting behind it; then keys with events waiting and no head (head NULL). A failed head holds its key until outbox_retry() or outbox_skip() (outbox.key_on_failure = block).';

REVOKE ALL ON FUNCTION
    @extschema@.outbox_skip(uuid),
    @extschema@.outbox_take_turn(),
    @extschema@.outbox_key_taken(text, bigint)
    FROM PUBLIC;
