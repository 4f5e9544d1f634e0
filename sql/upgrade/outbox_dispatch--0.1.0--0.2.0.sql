-- outbox_dispatch 0.1.0 → 0.2.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- outbox_enqueue makes the id itself instead of INSERT ... RETURNING, so
-- that writers need no SELECT on outbox.events; it reads its payload limit
-- through outbox_max_payload_bytes(), new in 0.2.0, and checks everything
-- with one test in the common case.
CREATE FUNCTION @extschema@."outbox_max_payload_bytes"() RETURNS INT
STRICT STABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'outbox_max_payload_bytes_wrapper';

CREATE OR REPLACE FUNCTION @extschema@.outbox_enqueue(
    event_type text,
    payload    jsonb,
    queue      text     DEFAULT NULL,
    task       text     DEFAULT NULL,
    headers    jsonb    DEFAULT NULL,
    delay      interval DEFAULT NULL,
    priority   integer  DEFAULT 0
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    max_name_bytes CONSTANT integer := 255;
    max_payload    CONSTANT integer := @extschema@.outbox_max_payload_bytes();
    resolved_queue CONSTANT text := coalesce(queue,
                                      pg_catalog.current_setting('outbox.default_queue', true), 'celery');
    -- Made here rather than returned by the INSERT: RETURNING would need
    -- SELECT on outbox.events, which writers are not granted.
    new_id         CONSTANT uuid := @extschema@.outbox_uuid_v7();
BEGIN
    -- One test for the common case; the ones inside say what is wrong.
    IF event_type IS NULL OR payload IS NULL OR priority IS NULL
       OR pg_catalog.octet_length(event_type) NOT BETWEEN 1 AND max_name_bytes
       OR pg_catalog.octet_length(resolved_queue) NOT BETWEEN 1 AND max_name_bytes
       OR pg_catalog.octet_length(task) NOT BETWEEN 1 AND max_name_bytes
       OR pg_catalog.pg_column_size(payload) > max_payload
       OR pg_catalog.jsonb_typeof(headers) <> 'object'
       OR delay < interval '0'
       OR priority NOT BETWEEN 0 AND 9
    THEN
        IF event_type IS NULL OR event_type = '' THEN
            RAISE EXCEPTION 'outbox_enqueue: event_type must not be null or empty'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF pg_catalog.octet_length(event_type) > max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: event_type is % bytes, the limit is % bytes',
                pg_catalog.octet_length(event_type), max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF resolved_queue = '' OR pg_catalog.octet_length(resolved_queue) > max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: queue is % bytes, it must be 1 to % bytes',
                pg_catalog.octet_length(resolved_queue), max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF task = '' OR pg_catalog.octet_length(task) > max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: task is % bytes, it must be 1 to % bytes',
                pg_catalog.octet_length(task), max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF payload IS NULL THEN
            RAISE EXCEPTION 'outbox_enqueue: payload must not be null (use ''{}'' for a task without arguments)'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF pg_catalog.pg_column_size(payload) > max_payload THEN
            RAISE EXCEPTION 'outbox_enqueue: payload is % bytes, over outbox.max_payload_bytes (% bytes)',
                pg_catalog.pg_column_size(payload), max_payload
                USING ERRCODE = 'program_limit_exceeded';
        END IF;
        IF pg_catalog.jsonb_typeof(headers) <> 'object' THEN
            RAISE EXCEPTION 'outbox_enqueue: headers must be a JSON object, not %',
                pg_catalog.jsonb_typeof(headers)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF delay < interval '0' THEN
            RAISE EXCEPTION 'outbox_enqueue: delay must not be negative (got %)', delay
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RAISE EXCEPTION 'outbox_enqueue: priority is %, it must be 0 (highest) to 9', priority
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    INSERT INTO outbox.events (id, event_type, payload, queue, task, headers, priority, available_at)
    VALUES (new_id, event_type, payload, resolved_queue, task, headers, priority,
            pg_catalog.clock_timestamp() + coalesce(delay, interval '0'));
    RETURN new_id;
END
$$;

-- The wake trigger fires before the statement: cheaper than an AFTER
-- trigger's queued event.
DROP TRIGGER events_wake_dispatchers ON outbox.events;
CREATE TRIGGER events_wake_dispatchers
    BEFORE INSERT ON outbox.events
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.outbox_events_inserted();

-- Consumers acknowledge without UPDATE on the table.
ALTER FUNCTION @extschema@.outbox_ack(uuid) SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

-- Privileges. PostgreSQL lets PUBLIC execute every new function; here
-- nobody but the owner may do anything until granted (README, "Privileges").
-- outbox_uuid_v7() stays public: it is the id default of every insert path.
REVOKE ALL ON FUNCTION
    @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer),
    @extschema@.outbox_ack(uuid),
    @extschema@.outbox_retry(uuid),
    @extschema@.outbox_retry_failed(interval),
    @extschema@.outbox_wake(),
    @extschema@.outbox_workers(),
    @extschema@.outbox_metrics(),
    @extschema@.outbox_metrics_prometheus(),
    @extschema@.outbox_events_inserted()
    FROM PUBLIC;

-- Monitoring: members of pg_monitor read the views that carry no payloads.
GRANT USAGE ON SCHEMA outbox TO pg_monitor;
GRANT SELECT ON outbox.status, outbox.workers, outbox.metrics TO pg_monitor;
GRANT EXECUTE ON FUNCTION
    @extschema@.outbox_workers(),
    @extschema@.outbox_metrics(),
    @extschema@.outbox_metrics_prometheus()
    TO pg_monitor;
