-- outbox_dispatch 0.2.0 → 0.3.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

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
       retry_count, last_error, created_at, deliveries, args
  FROM outbox.events
 WHERE status = 'failed';

COMMENT ON VIEW outbox.dead_letters IS
    'Failed events with their last error: outbox.max_retries failed pushes, expired before delivery, never acknowledged after outbox.max_redeliveries re-sends, or failed in the Celery task.';

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
