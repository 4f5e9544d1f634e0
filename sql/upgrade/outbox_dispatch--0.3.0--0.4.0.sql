-- outbox_dispatch 0.3.0 → 0.4.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- Each send of an event gets an id of its own (set by the claim), which the
-- message carries and a worker's report must name: a report proves which
-- send it answers. No rewrite: the column is NULL until the next claim.
ALTER TABLE outbox.events ADD COLUMN send_id uuid;

-- Accumulated subscriptions: members keep their event's queue (a batch goes
-- to its subscription's queue, or else its oldest member's: the dispatchers
-- no longer read outbox.default_queue, which a database owner may set) and
-- their size in the batch's JSON (batches are cut by what will be sent).
ALTER TABLE outbox.batch_members
    ADD COLUMN queue text,
    ADD COLUMN bytes integer;
UPDATE outbox.batch_members AS m
   SET queue = coalesce((SELECT e.queue FROM outbox.events AS e WHERE e.id = m.event_id), 'celery'),
       bytes = coalesce(octet_length(m.payload::text), 0) + coalesce(octet_length(m.args::text), 0)
               + octet_length(m.event_type) + 80;
ALTER TABLE outbox.batch_members
    ALTER COLUMN queue SET NOT NULL,
    ALTER COLUMN bytes SET NOT NULL;

-- Subscriptions record who subscribed (ending one takes a member of that
-- role, or of the extension's owner, to whom the earlier ones go), and why
-- the last batch could not be made.
ALTER TABLE outbox.all_subscriptions
    ADD COLUMN created_by name,
    ADD COLUMN last_error text,
    ADD COLUMN last_error_at timestamptz;
UPDATE outbox.all_subscriptions
   SET created_by = (SELECT pg_get_userbyid(x.extowner) FROM pg_extension AS x WHERE x.extname = 'outbox_dispatch');
ALTER TABLE outbox.all_subscriptions ALTER COLUMN created_by SET NOT NULL;

-- Earlier scripts ran with the extension's schema (public) first in the
-- search_path, where the database owner may create objects: an operator or
-- function planted there before CREATE EXTENSION or an update may have been
-- bound into a view, a default, an index predicate or a constraint. Bind
-- them all to pg_catalog again: views and defaults always (it costs nothing),
-- indexes, constraints and the generated column only where something is
-- bound outside pg_catalog and the extension (rebuilding one scans its table).
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
    'Events per status; lag is how long the oldest due pending event has waited. Dispatched and processed are counted up to 1000, then estimated from statistics (estimated = true).';

CREATE OR REPLACE VIEW outbox.workers AS
SELECT * FROM @extschema@.outbox_workers();

CREATE OR REPLACE VIEW outbox.metrics AS
SELECT * FROM @extschema@.outbox_metrics();

CREATE OR REPLACE VIEW outbox.dead_letters AS
SELECT id, event_type, queue, coalesce(task, event_type) AS task, payload, headers,
       retry_count, last_error, created_at, deliveries, args, event_id, subscription_id
  FROM outbox.events
 WHERE status = 'failed';

CREATE OR REPLACE VIEW outbox.subscriptions AS
SELECT s.id, s.event_type, s.task, s.queue, s.priority, s.batch_max, s.batch_wait,
       w.waiting, w.oldest_available_at, s.created_at, s.unsubscribed_at,
       s.created_by, s.last_error, s.last_error_at
  FROM outbox.all_subscriptions AS s
 CROSS JOIN LATERAL (
       SELECT pg_catalog.count(*) AS waiting, pg_catalog.min(m.available_at) AS oldest_available_at
         FROM outbox.batch_members AS m
        WHERE m.subscription_id = s.id AND m.batch_id IS NULL) AS w
 WHERE s.unsubscribed_at IS NULL OR w.waiting > 0
 ORDER BY s.id;

CREATE OR REPLACE VIEW outbox.deliveries AS
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

ALTER TABLE outbox.events
    ALTER COLUMN id SET DEFAULT @extschema@.outbox_uuid_v7(),
    ALTER COLUMN queue SET DEFAULT coalesce(current_setting('outbox.default_queue', true), 'celery'),
    ALTER COLUMN routed_to SET DEFAULT @extschema@.outbox_routed_to_default(),
    ALTER COLUMN created_at SET DEFAULT clock_timestamp(),
    ALTER COLUMN available_at SET DEFAULT clock_timestamp();
ALTER TABLE outbox.all_subscriptions
    ALTER COLUMN id SET DEFAULT nextval('outbox.subscription_id_seq'),
    ALTER COLUMN created_at SET DEFAULT now();

DO $$
DECLARE
    object record;
BEGIN
    FOR object IN
        WITH definition(relation, kind, name, create_it) AS (VALUES
            ('outbox.events', 'index', 'events_pending_idx',
             'CREATE INDEX events_pending_idx ON outbox.events (available_at) WHERE status = ''pending'''),
            ('outbox.events', 'index', 'events_processing_idx',
             'CREATE INDEX events_processing_idx ON outbox.events (processing_started_at, claimed_by) '
             'WHERE status = ''processing'''),
            ('outbox.events', 'index', 'events_dispatched_idx',
             'CREATE INDEX events_dispatched_idx ON outbox.events (dispatched_at) WHERE status = ''dispatched'''),
            ('outbox.events', 'index', 'events_failed_idx',
             'CREATE INDEX events_failed_idx ON outbox.events (created_at) WHERE status = ''failed'''),
            ('outbox.events', 'index', 'events_processed_idx',
             'CREATE INDEX events_processed_idx ON outbox.events (processed_at) WHERE status = ''processed'''),
            ('outbox.events', 'constraint', 'events_event_type_length',
             'CHECK (octet_length(event_type) BETWEEN 1 AND 255)'),
            ('outbox.events', 'constraint', 'events_args_array', 'CHECK (jsonb_typeof(args) = ''array'')'),
            ('outbox.events', 'constraint', 'events_queue_length', 'CHECK (octet_length(queue) BETWEEN 1 AND 255)'),
            ('outbox.events', 'constraint', 'events_task_length', 'CHECK (octet_length(task) BETWEEN 1 AND 255)'),
            ('outbox.events', 'constraint', 'events_headers_object', 'CHECK (jsonb_typeof(headers) = ''object'')'),
            ('outbox.events', 'constraint', 'events_priority_range', 'CHECK (priority BETWEEN 0 AND 9)'),
            ('outbox.events', 'constraint', 'events_args_with_kwargs',
             'CHECK (args IS NULL OR jsonb_typeof(payload) = ''object'')'),
            ('outbox.all_subscriptions', 'constraint', 'all_subscriptions_batch',
             'CHECK (batch_max IS NOT NULL OR batch_wait IS NULL)'),
            ('outbox.all_subscriptions', 'column', 'prefix',
             'text GENERATED ALWAYS AS (CASE WHEN right(event_type, 1) = ''*'' THEN left(event_type, -1) END) STORED')
        ), located AS (
            SELECT d.*,
                   CASE d.kind
                       WHEN 'index' THEN 'pg_class'::regclass
                       WHEN 'constraint' THEN 'pg_constraint'::regclass
                       ELSE 'pg_attrdef'::regclass
                   END AS classid,
                   CASE d.kind
                       WHEN 'index' THEN ('outbox.' || d.name)::regclass::oid
                       WHEN 'constraint' THEN (SELECT c.oid FROM pg_constraint AS c
                                                WHERE c.conrelid = d.relation::regclass AND c.conname = d.name)
                       ELSE (SELECT a.oid FROM pg_attrdef AS a
                              JOIN pg_attribute AS c ON c.attrelid = a.adrelid AND c.attnum = a.adnum
                             WHERE c.attrelid = d.relation::regclass AND c.attname = d.name)
                   END AS objid
              FROM definition AS d
        )
        SELECT l.relation, l.kind, l.name, l.create_it
          FROM located AS l
         WHERE EXISTS (
               SELECT FROM pg_depend AS dep
                WHERE dep.classid = l.classid AND dep.objid = l.objid
                  AND dep.refclassid IN ('pg_operator'::regclass, 'pg_proc'::regclass, 'pg_type'::regclass)
                  AND (pg_identify_object(dep.refclassid, dep.refobjid, 0)).schema IS DISTINCT FROM 'pg_catalog'
                  AND NOT EXISTS (SELECT FROM pg_depend AS member
                                    JOIN pg_extension AS x ON x.oid = member.refobjid
                                   WHERE member.classid = dep.refclassid AND member.objid = dep.refobjid
                                     AND member.refclassid = 'pg_extension'::regclass
                                     AND member.deptype = 'e'
                                     AND x.extname = 'outbox_dispatch'))
    LOOP
        RAISE NOTICE 'outbox_dispatch: % % of % was bound to an object outside pg_catalog; rebuilding it',
            object.kind, object.name, object.relation;
        CASE object.kind
            WHEN 'index' THEN
                EXECUTE format('DROP INDEX outbox.%I', object.name);
                EXECUTE object.create_it;
            WHEN 'constraint' THEN
                EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I, ADD CONSTRAINT %I %s',
                               object.relation, object.name, object.name, object.create_it);
            ELSE
                EXECUTE format('ALTER TABLE %s DROP COLUMN %I, ADD COLUMN %I %s',
                               object.relation, object.name, object.name, object.create_it);
        END CASE;
    END LOOP;
END
$$;

-- No type in outbox_enqueue's body resolves through the caller's search_path.
CREATE OR REPLACE FUNCTION @extschema@.outbox_enqueue(
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
    enqueued_at    CONSTANT pg_catalog.timestamptz := pg_catalog.clock_timestamp();
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

-- Members record their queue and size; subscriptions who made them.
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
                                   headers, priority, created_at, available_at, expires_at)
        SELECT NEW.id, m.id, NEW.event_type, NEW.payload, NEW.args, coalesce(m.queue, NEW.queue), m.task,
               coalesce(NEW.headers, '{}'::pg_catalog.jsonb) OPERATOR(pg_catalog.||)
                   pg_catalog.jsonb_build_object('outbox_event_id', NEW.id, 'outbox_subscription_id', m.id),
               coalesce(m.priority, NEW.priority), NEW.created_at, NEW.available_at, NEW.expires_at
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


-- outbox_subscribe() and outbox_unsubscribe() are written in Rust and run as
-- their caller (the role asking, which SECURITY DEFINER would hide); they
-- call these two as the extension's owner. Same signatures: the grants
-- made on them stay.
CREATE FUNCTION @extschema@.outbox_subscription_add(
    owner      name,
    event_type text,
    task       text,
    queue      text,
    priority   integer,
    batch_max  integer,
    batch_wait interval
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
     WHERE s.event_type = outbox_subscription_add.event_type
       AND s.task = outbox_subscription_add.task
       AND s.unsubscribed_at IS NULL;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox_subscribe: task "%" is subscribed to "%" already (subscription %)',
            task, event_type, existing
            USING ERRCODE = 'unique_violation',
                  HINT = 'outbox_unsubscribe() it first to change it.';
    END IF;

    INSERT INTO outbox.all_subscriptions AS s (event_type, task, queue, priority, batch_max, batch_wait, created_by)
    VALUES (event_type, task, queue, priority,
            CASE WHEN batch_wait IS NOT NULL THEN coalesce(batch_max, max_batch) ELSE batch_max END,
            batch_wait, owner)
    RETURNING s.id INTO new_id;
    RETURN new_id;
END
$$;

CREATE FUNCTION @extschema@.outbox_subscription_end(asking oid, id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    owner name;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION 'outbox_unsubscribe: id must not be null'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s.created_by INTO owner
      FROM outbox.all_subscriptions AS s
     WHERE s.id = outbox_subscription_end.id
       AND s.unsubscribed_at IS NULL
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT coalesce(pg_has_role(asking, to_regrole(quote_ident(owner)), 'USAGE'), false)
       AND NOT pg_has_role(asking, (SELECT x.extowner FROM pg_extension AS x
                                     WHERE x.extname = 'outbox_dispatch'), 'USAGE')
    THEN
        RAISE EXCEPTION 'outbox_unsubscribe: subscription % belongs to role "%"', id, owner
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Only a role with its privileges, or the extension owner''s, may end it.';
    END IF;
    UPDATE outbox.all_subscriptions AS s
       SET unsubscribed_at = now()
     WHERE s.id = outbox_subscription_end.id;
    PERFORM @extschema@.outbox_wake();
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@."outbox_subscribe"(
	"event_type" TEXT,
	"task" TEXT,
	"queue" TEXT DEFAULT NULL,
	"priority" INT DEFAULT NULL,
	"batch_max" INT DEFAULT NULL,
	"batch_wait" interval DEFAULT NULL
) RETURNS bigint
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_subscribe_wrapper';

CREATE OR REPLACE FUNCTION @extschema@."outbox_unsubscribe"(
	"id" bigint
) RETURNS bool
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_unsubscribe_wrapper';

REVOKE ALL ON FUNCTION
    @extschema@.outbox_subscription_add(name, text, text, text, integer, integer, interval),
    @extschema@.outbox_subscription_end(oid, bigint)
    FROM PUBLIC;

COMMENT ON FUNCTION @extschema@.outbox_subscription_add(name, text, text, text, integer, integer, interval) IS
    'outbox_subscribe() for role owner; the extension''s owner alone may call it.';
COMMENT ON FUNCTION @extschema@.outbox_subscription_end(oid, bigint) IS
    'outbox_unsubscribe() for role asking; the extension''s owner alone may call it.';
COMMENT ON VIEW outbox.subscriptions IS
    'Subscriptions; waiting counts the events an accumulated one holds for its next batch; last_error says why its last batch could not be made.';

-- Sent events not reported within outbox.report_timeout, and the function
-- that tells it (NULL while reports are off).
CREATE FUNCTION @extschema@."outbox_report_timeout"() RETURNS interval
STRICT STABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_report_timeout_wrapper';

CREATE VIEW outbox.unreported AS
SELECT e.id, e.event_type, e.queue, coalesce(e.task, e.event_type) AS task, e.dispatched_at,
       pg_catalog.now() - e.dispatched_at AS waiting, e.deliveries AS sends, e.event_id, e.subscription_id
  FROM outbox.events AS e
 WHERE e.status = 'dispatched'
   AND e.dispatched_at < pg_catalog.now() - @extschema@.outbox_report_timeout();

COMMENT ON VIEW outbox.unreported IS
    'Dispatched events no worker reported within outbox.report_timeout (while reports are on): lost after the push, or never run.';

GRANT SELECT ON outbox.unreported TO pg_monitor;

-- A role with nothing but pg_monitor reads every metric, the ones that look
-- at outbox.events directly (the purge's lag) included: no payload reaches it.
ALTER FUNCTION @extschema@.outbox_metrics() SECURITY DEFINER;
ALTER FUNCTION @extschema@.outbox_metrics_prometheus() SECURITY DEFINER;

-- A retried event's send_id is cleared: a replayed report of its failed send
-- finishes nothing.
CREATE OR REPLACE FUNCTION @extschema@.outbox_retry(id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- send_id cleared: a report of the failed send, replayed, finishes
    -- nothing (the next claim gives it a new one).
    UPDATE outbox.events AS e
       SET status = 'pending',
           retry_count = 0,
           available_at = pg_catalog.clock_timestamp(),
           processing_started_at = NULL,
           claimed_by = NULL,
           send_id = NULL
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
       AND (older_than IS NULL OR e.created_at <= pg_catalog.now() - older_than);
    GET DIAGNOSTICS retried = ROW_COUNT;
    IF retried > 0 THEN
        PERFORM @extschema@.outbox_wake();
    END IF;
    RETURN retried;
END
$$;
