-- outbox_dispatch 0.2.0 → 0.3.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- A database that is not UTF8 is refused at CREATE EXTENSION from 0.3.0 on;
-- an installation that exists already in one keeps working as before.

-- pg_dump keeps the events: the table belongs to the extension, whose member
-- tables are otherwise dumped empty.
SELECT pg_catalog.pg_extension_config_dump('outbox.events', '');

-- No function resolves a name through a search_path the database owner may
-- have set: outbox_enqueue qualifies every name and operator; the others pin
-- their search_path. The dispatchers no longer re-check payload sizes.
-- Events may expire (Celery's expires) and carry positional and keyword
-- arguments together.
ALTER TABLE outbox.events
    ADD COLUMN args jsonb CONSTRAINT events_args_array CHECK (jsonb_typeof(args) = 'array'),
    ADD COLUMN expires_at timestamptz,
    ADD CONSTRAINT events_args_with_kwargs CHECK (args IS NULL OR jsonb_typeof(payload) = 'object');

-- Subscriptions (sql/subscriptions.sql): an event without a task goes to
-- every matching subscription. Rows of before the update matched none
-- (routed_to = 0: a restored dump does not route them again).
ALTER TABLE outbox.events
    ADD COLUMN event_id uuid,
    ADD COLUMN subscription_id bigint,
    ADD COLUMN routed_to integer DEFAULT 0;  -- for these rows; its default is set below

-- outbox_enqueue gains expires and args: a new signature is a new function,
-- so the roles granted EXECUTE on the old one are granted it on the new one.
CREATE TEMPORARY TABLE outbox_enqueue_grantees ON COMMIT DROP AS
SELECT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
            ELSE a.grantee::pg_catalog.regrole::pg_catalog.text END AS grantee
  FROM pg_catalog.pg_proc AS p,
       pg_catalog.aclexplode(p.proacl) AS a
 WHERE p.oid OPERATOR(pg_catalog.=) '@extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer)'::pg_catalog.regprocedure
   AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
   AND a.grantee OPERATOR(pg_catalog.<>) p.proowner;

DROP FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer);

CREATE FUNCTION @extschema@.outbox_enqueue(
    event_type text,
    payload    jsonb,
    queue      text     DEFAULT NULL,
    task       text     DEFAULT NULL,
    headers    jsonb    DEFAULT NULL,
    delay      interval DEFAULT NULL,
    priority   integer  DEFAULT 0,
    expires    interval DEFAULT NULL,
    args       jsonb    DEFAULT NULL
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
    enqueued_at    CONSTANT timestamptz := pg_catalog.clock_timestamp();
BEGIN
    -- One test for the common case; the ones inside say what is wrong.
    IF event_type IS NULL OR payload IS NULL OR priority IS NULL
       OR event_bytes OPERATOR(pg_catalog.<) 1 OR event_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR queue_bytes OPERATOR(pg_catalog.<) 1 OR queue_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR task_bytes OPERATOR(pg_catalog.<) 1 OR task_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR payload_bytes OPERATOR(pg_catalog.>) max_payload
       OR pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object'
       OR delay OPERATOR(pg_catalog.<) interval '0'
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
        IF delay OPERATOR(pg_catalog.<) interval '0' THEN
            RAISE EXCEPTION 'outbox_enqueue: delay must not be negative (got %)', delay
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
                               available_at, expires_at)
    VALUES (new_id, event_type, payload, args, resolved_queue, task, headers, priority,
            enqueued_at OPERATOR(pg_catalog.+) coalesce(delay, interval '0'),
            enqueued_at OPERATOR(pg_catalog.+) expires);
    RETURN new_id;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb) IS
    'Enqueue an event in the current transaction; it is delivered as a Celery task after COMMIT.';

REVOKE ALL ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb) FROM PUBLIC;

DO $$
DECLARE
    grantee pg_catalog.text;
BEGIN
    FOR grantee IN SELECT g.grantee FROM pg_temp.outbox_enqueue_grantees AS g LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb) TO %s', grantee);
    END LOOP;
END
$$;

DROP TABLE pg_temp.outbox_enqueue_grantees;

ALTER FUNCTION @extschema@.outbox_retry(uuid) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION @extschema@.outbox_retry_failed(interval) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION @extschema@.outbox_metrics() SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION @extschema@.outbox_metrics_prometheus() SET search_path = pg_catalog, pg_temp;

-- Sends are counted, so that waiting for acknowledgements is bounded
-- (outbox.max_redeliveries). Events dispatched before the update count from
-- zero: they get one send more than the bound.
ALTER TABLE outbox.events ADD COLUMN deliveries integer NOT NULL DEFAULT 0;

CREATE OR REPLACE VIEW outbox.dead_letters AS
SELECT id, event_type, queue, coalesce(task, event_type) AS task, payload, headers,
       retry_count, last_error, created_at, deliveries, args, event_id, subscription_id
  FROM outbox.events
 WHERE status = 'failed';

COMMENT ON VIEW outbox.dead_letters IS
    'Failed events with their last error: outbox.max_retries failed pushes, expired before delivery, never acknowledged after outbox.max_redeliveries re-sends, or failed in the Celery task. A delivery to a subscription has event_id and subscription_id; a batch, subscription_id alone.';

-- outbox.workers shows how the broker persists what it is sent.
DROP VIEW outbox.workers;
DROP FUNCTION @extschema@.outbox_workers();
CREATE FUNCTION @extschema@."outbox_workers"() RETURNS TABLE (
	"worker" INT,
	"pid" INT,
	"state" TEXT,
	"connected" bool,
	"started_at" timestamp with time zone,
	"last_heartbeat" timestamp with time zone,
	"last_error" TEXT,
	"events_dispatched" bigint,
	"broker_persistence" TEXT
)
STRICT VOLATILE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_workers_wrapper';

CREATE VIEW outbox.workers AS
SELECT * FROM @extschema@.outbox_workers();

COMMENT ON VIEW outbox.workers IS 'One row per dispatcher background worker.';

REVOKE ALL ON FUNCTION @extschema@.outbox_workers() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.outbox_workers() TO pg_monitor;
GRANT SELECT ON outbox.workers TO pg_monitor;

-- One row per status, zero counts included, at a cost that does not grow
-- with history: pending, processing and failed are counted exactly, each
-- through its partial index (they stay small in a healthy outbox, and they
-- are what matters); dispatched and processed, which grow with
-- outbox.retention, are estimated from their partial indexes' statistics
-- (as of the last vacuum or analyze of outbox.events), and say so.
CREATE OR REPLACE VIEW outbox.status AS
WITH exact AS (
    SELECT 'pending'::outbox.event_status AS status, pg_catalog.count(*) AS count,
           pg_catalog.min(e.created_at) AS oldest_created_at,
           coalesce(pg_catalog.now() - pg_catalog.min(e.available_at)
                        FILTER (WHERE e.available_at <= pg_catalog.now()),
                    interval '0') AS lag
      FROM outbox.events AS e WHERE e.status = 'pending'
    UNION ALL
    SELECT 'processing', pg_catalog.count(*), pg_catalog.min(e.created_at), NULL
      FROM outbox.events AS e WHERE e.status = 'processing'
    UNION ALL
    SELECT 'failed', pg_catalog.count(*), pg_catalog.min(e.created_at), NULL
      FROM outbox.events AS e WHERE e.status = 'failed'
), estimated AS (
    SELECT s.status, GREATEST(c.reltuples, 0)::bigint AS count
      FROM (VALUES ('dispatched'::outbox.event_status, 'outbox.events_dispatched_idx'),
                   ('processed', 'outbox.events_processed_idx')) AS s(status, index_name)
      JOIN pg_catalog.pg_class AS c ON c.oid = pg_catalog.to_regclass(s.index_name)
)
SELECT status, count, oldest_created_at, pg_catalog.now() - oldest_created_at AS age, lag,
       false AS estimated
  FROM exact
UNION ALL
SELECT status, count, NULL, NULL, NULL, true
  FROM estimated
 ORDER BY status;

COMMENT ON VIEW outbox.status IS
    'Events per status; lag is how long the oldest due pending event has waited. Rows with estimated = true (dispatched, processed) are estimates from statistics.';

-- Subscriptions (sql/subscriptions.sql), after the columns added above.
--
-- The deliveries of one event.
CREATE INDEX events_event_id_idx ON outbox.events (event_id) WHERE event_id IS NOT NULL;

-- Subscriptions: which tasks an event without a task goes to. Rows are
-- never deleted (outbox_unsubscribe() stamps unsubscribed_at): deliveries
-- and waiting batch members keep naming them.
CREATE SEQUENCE outbox.subscription_id_seq;

CREATE TABLE outbox.all_subscriptions (
    id              bigint PRIMARY KEY DEFAULT nextval('outbox.subscription_id_seq'),
    event_type      text NOT NULL,  -- exact, or a prefix when it ends in '*'
    prefix          text GENERATED ALWAYS AS
                        (CASE WHEN right(event_type, 1) = '*' THEN left(event_type, -1) END) STORED,
    task            text NOT NULL,
    queue           text,      -- NULL: the event's queue
    priority        smallint,  -- NULL: the event's priority
    batch_max       integer,   -- set: accumulated; events per batch at most
    batch_wait      interval,  -- how long the oldest waiting event may wait (NULL: until batch_max)
    created_at      timestamptz NOT NULL DEFAULT now(),
    unsubscribed_at timestamptz,
    CONSTRAINT all_subscriptions_batch CHECK (batch_max IS NOT NULL OR batch_wait IS NULL)
);

ALTER SEQUENCE outbox.subscription_id_seq OWNED BY outbox.all_subscriptions.id;

COMMENT ON TABLE outbox.all_subscriptions IS
    'Every subscription, unsubscribed ones included; manage with outbox_subscribe() and outbox_unsubscribe(), read outbox.subscriptions.';

-- One active subscription per event type and task.
CREATE UNIQUE INDEX all_subscriptions_active_idx ON outbox.all_subscriptions (event_type, task)
    WHERE unsubscribed_at IS NULL;

-- Events waiting for an accumulated subscription, then (batch_id set) the
-- batch delivery that carried them, until that delivery is purged.
CREATE TABLE outbox.batch_members (
    event_id        uuid NOT NULL,
    subscription_id bigint NOT NULL,
    event_type      text NOT NULL,
    payload         jsonb,  -- NULL once in a batch, which carries it
    args            jsonb,
    available_at    timestamptz NOT NULL,
    batch_id        uuid,   -- outbox.events.id of the batch delivery; NULL: waiting
    PRIMARY KEY (event_id, subscription_id)
)
WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02
);

COMMENT ON TABLE outbox.batch_members IS
    'Events of accumulated subscriptions: waiting (batch_id NULL), or delivered in the batch batch_id.';

-- The flush: a subscription's waiting members, oldest due first.
CREATE INDEX batch_members_waiting_idx ON outbox.batch_members (subscription_id, available_at)
    WHERE batch_id IS NULL;
-- The purge of a batch's members with the batch.
CREATE INDEX batch_members_batch_idx ON outbox.batch_members (batch_id) WHERE batch_id IS NOT NULL;

SELECT pg_catalog.pg_extension_config_dump('outbox.all_subscriptions', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.subscription_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.batch_members', '');

-- The functions written in Rust that subscriptions use (src/subscriptions.rs).
CREATE FUNCTION @extschema@."outbox_routed_to_default"() RETURNS INT
STRICT VOLATILE SECURITY DEFINER PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_routed_to_default_wrapper';

CREATE FUNCTION @extschema@."outbox_subscriptions_changed"()
	RETURNS TRIGGER
	LANGUAGE c
	AS 'MODULE_PATHNAME', 'outbox_subscriptions_changed_wrapper';

-- outbox_dispatch: subscriptions, one event to every subscribed task.
--
-- An event inserted without a task (by outbox_enqueue() or an ORM's INSERT)
-- is routed when it is inserted, to the subscriptions its INSERT sees:
-- changes to subscriptions committed later never rewrite it. Each matching
-- subscription gets its own delivery, a row of outbox.events with its own
-- id (the Celery task id), status, retries and dead letter; an accumulated
-- one (batch_max, batch_wait) gets the event as a batch member instead, and
-- the dispatchers deliver its members together, as one task. The event's
-- own row stays as its record, processed at once, routed_to saying how many
-- subscriptions it went to. An event that matches none is dispatched as it
-- always was (routed_to = 0), to the task named like its event type.

-- The BEFORE INSERT row trigger. SECURITY DEFINER: writers need INSERT on
-- outbox.events, not on the subscription tables. It runs as the owner with
-- the writer's search_path, so every name is qualified, operators included
-- (a SET search_path clause would cost most of an enqueue, measured).
-- The first look only asks whether anything matches: an event that matches
-- nothing then skips starting the statement with two modifying CTEs; one
-- that matches pays the look again, on a table of a few rows.
CREATE FUNCTION @extschema@.outbox_route() RETURNS trigger
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
                                   headers, priority, created_at, available_at, expires_at)
        SELECT NEW.id, m.id, NEW.event_type, NEW.payload, NEW.args, coalesce(m.queue, NEW.queue), m.task,
               coalesce(NEW.headers, '{}'::pg_catalog.jsonb) OPERATOR(pg_catalog.||)
                   pg_catalog.jsonb_build_object('outbox_event_id', NEW.id, 'outbox_subscription_id', m.id),
               coalesce(m.priority, NEW.priority), NEW.created_at, NEW.available_at, NEW.expires_at
          FROM matched AS m
         WHERE m.batch_max IS NULL
    ), accumulated AS (
        INSERT INTO outbox.batch_members (event_id, subscription_id, event_type, payload, args, available_at)
        SELECT NEW.id, m.id, NEW.event_type, NEW.payload, NEW.args, NEW.available_at
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

-- Only rows that may need routing call it: events without a task not yet
-- routed (deliveries and batches have a task; a restored dump's routed
-- events have routed_to).
CREATE TRIGGER events_route
    BEFORE INSERT ON outbox.events
    FOR EACH ROW WHEN (NEW.task IS NULL AND NEW.routed_to IS NULL)
    EXECUTE FUNCTION @extschema@.outbox_route();

-- No event is routed while no subscription is active: routed_to then
-- defaults to 0 and the trigger above is not called, so that an event
-- without a task costs what it did before subscriptions existed. The
-- default function caches the answer per backend (src/subscriptions.rs);
-- every change to the subscriptions drops the caches at its commit.
ALTER TABLE outbox.events ALTER COLUMN routed_to SET DEFAULT @extschema@.outbox_routed_to_default();

CREATE TRIGGER all_subscriptions_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.all_subscriptions
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.outbox_subscriptions_changed();

-- Subscribe task to event_type (exact, or every type it prefixes when it
-- ends in '*'; '*' alone is every event). queue and priority override the
-- event's. With batch_max or batch_wait the subscription accumulates: its
-- events are delivered together, as one task whose one argument is their
-- list, once batch_max of them wait (1000 when only batch_wait is given) or
-- the oldest has waited batch_wait, whichever comes first. Returns the id.
CREATE FUNCTION @extschema@.outbox_subscribe(
    event_type text,
    task       text,
    queue      text     DEFAULT NULL,
    priority   integer  DEFAULT NULL,
    batch_max  integer  DEFAULT NULL,
    batch_wait interval DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    max_name_bytes CONSTANT integer := 255;
    max_batch      CONSTANT integer := 1000;
    existing       bigint;
    new_id         bigint;
BEGIN
    IF event_type IS NULL OR octet_length(event_type) NOT BETWEEN 1 AND max_name_bytes THEN
        RAISE EXCEPTION 'outbox_subscribe: event_type is % bytes, it must be 1 to % bytes',
            coalesce(octet_length(event_type), 0), max_name_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF strpos(left(event_type, -1), '*') > 0 THEN
        RAISE EXCEPTION 'outbox_subscribe: event_type "%" has a * before its end; only a trailing * (a prefix) is a pattern',
            event_type
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF task IS NULL OR octet_length(task) NOT BETWEEN 1 AND max_name_bytes THEN
        RAISE EXCEPTION 'outbox_subscribe: task is % bytes, it must be 1 to % bytes',
            coalesce(octet_length(task), 0), max_name_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(queue) NOT BETWEEN 1 AND max_name_bytes THEN
        RAISE EXCEPTION 'outbox_subscribe: queue is % bytes, it must be 1 to % bytes (or NULL: the event''s)',
            octet_length(queue), max_name_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF priority NOT BETWEEN 0 AND 9 THEN
        RAISE EXCEPTION 'outbox_subscribe: priority is %, it must be 0 (highest) to 9 (or NULL: the event''s)',
            priority
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF batch_max NOT BETWEEN 1 AND max_batch THEN
        RAISE EXCEPTION 'outbox_subscribe: batch_max is %, it must be 1 to %', batch_max, max_batch
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF batch_wait <= interval '0' THEN
        RAISE EXCEPTION 'outbox_subscribe: batch_wait must be positive (got %)', batch_wait
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    SELECT s.id INTO existing
      FROM outbox.all_subscriptions AS s
     WHERE s.event_type = outbox_subscribe.event_type
       AND s.task = outbox_subscribe.task
       AND s.unsubscribed_at IS NULL;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox_subscribe: task "%" is subscribed to "%" already (subscription %)',
            task, event_type, existing
            USING ERRCODE = 'unique_violation',
                  HINT = 'outbox_unsubscribe() it first to change it.';
    END IF;

    INSERT INTO outbox.all_subscriptions AS s (event_type, task, queue, priority, batch_max, batch_wait)
    VALUES (event_type, task, queue, priority,
            CASE WHEN batch_wait IS NOT NULL THEN coalesce(batch_max, max_batch) ELSE batch_max END,
            batch_wait)
    RETURNING s.id INTO new_id;
    RETURN new_id;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_subscribe(text, text, text, integer, integer, interval) IS
    'Deliver events of event_type (or of a prefix ending in *) enqueued without a task to task; returns the subscription id.';

-- Ends subscription id for events inserted after this commits. Returns
-- whether it was active. Deliveries made already stay; its waiting batch
-- members are delivered at once, in batches of its batch_max.
CREATE FUNCTION @extschema@.outbox_unsubscribe(id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION 'outbox_unsubscribe: id must not be null'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE outbox.all_subscriptions AS s
       SET unsubscribed_at = now()
     WHERE s.id = outbox_unsubscribe.id
       AND s.unsubscribed_at IS NULL;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM @extschema@.outbox_wake();
    RETURN true;
END
$$;

-- Active subscriptions, and unsubscribed ones whose members still wait.
CREATE VIEW outbox.subscriptions AS
SELECT s.id, s.event_type, s.task, s.queue, s.priority, s.batch_max, s.batch_wait,
       w.waiting, w.oldest_available_at, s.created_at, s.unsubscribed_at
  FROM outbox.all_subscriptions AS s
 CROSS JOIN LATERAL (
       SELECT pg_catalog.count(*) AS waiting, pg_catalog.min(m.available_at) AS oldest_available_at
         FROM outbox.batch_members AS m
        WHERE m.subscription_id = s.id AND m.batch_id IS NULL) AS w
 WHERE s.unsubscribed_at IS NULL OR w.waiting > 0
 ORDER BY s.id;

COMMENT ON VIEW outbox.subscriptions IS
    'Subscriptions; waiting counts the events an accumulated one holds for its next batch.';

-- Every delivery of every routed event: filter on event_id for one event's.
-- status is the delivery's, or its batch's, or 'waiting' for a batch.
CREATE VIEW outbox.deliveries AS
SELECT e.event_id, e.subscription_id, e.task, e.id AS delivery_id, false AS batched,
       e.status::text AS status, e.retry_count, e.deliveries AS sends, e.last_error,
       e.dispatched_at, e.processed_at
  FROM outbox.events AS e
 WHERE e.event_id IS NOT NULL
UNION ALL
SELECT m.event_id, m.subscription_id, s.task, m.batch_id, true,
       coalesce(b.status::text, 'waiting'), b.retry_count, b.deliveries, b.last_error,
       b.dispatched_at, b.processed_at
  FROM outbox.batch_members AS m
  JOIN outbox.all_subscriptions AS s ON s.id = m.subscription_id
  LEFT JOIN outbox.events AS b ON b.id = m.batch_id;

COMMENT ON VIEW outbox.deliveries IS
    'Per routed event and subscription: the delivery (or batch) that carries it, and its status.';

-- outbox_routed_to_default() stays public: it is the default of every insert.
REVOKE ALL ON FUNCTION
    @extschema@.outbox_route(),
    @extschema@.outbox_subscriptions_changed(),
    @extschema@.outbox_subscribe(text, text, text, integer, integer, interval),
    @extschema@.outbox_unsubscribe(bigint)
    FROM PUBLIC;

GRANT SELECT ON outbox.subscriptions, outbox.deliveries TO pg_monitor;
