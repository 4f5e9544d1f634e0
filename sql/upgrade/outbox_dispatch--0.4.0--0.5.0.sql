-- outbox_dispatch 0.4.0 → 0.5.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- The claim keeps its place in (pending_xid, id) order, so that it never
-- walks again the dead entries its earlier claims left (core/src/frontier.rs).
-- No rewrite: rows from before read pending_xid 1, before every position;
-- a dispatcher's first claim after the update sweeps them all.
ALTER TABLE outbox.events ADD COLUMN pending_xid xid8 NOT NULL DEFAULT '1';
ALTER TABLE outbox.events ALTER COLUMN pending_xid SET DEFAULT pg_catalog.pg_current_xact_id();

DROP INDEX outbox.events_pending_idx;
CREATE INDEX events_pending_xid_idx ON outbox.events (pending_xid, id) WHERE status = 'pending';
CREATE INDEX events_pending_idx ON outbox.events (available_at, id) WHERE status = 'pending';

CREATE FUNCTION @extschema@.outbox_pending_again() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    NEW.pending_xid := pg_catalog.pg_current_xact_id();
    RETURN NEW;
END
$$;
CREATE TRIGGER events_pending_again
    BEFORE INSERT OR UPDATE OF status, available_at, pending_xid ON outbox.events
    FOR EACH ROW WHEN (NEW.status = 'pending' AND NEW.pending_xid <> pg_catalog.pg_current_xact_id())
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- Also where triggers are off for replication (a logical replication
-- subscriber applying the rows of another server's history).
ALTER TABLE outbox.events ENABLE ALWAYS TRIGGER events_pending_again;
REVOKE ALL ON FUNCTION @extschema@.outbox_pending_again() FROM PUBLIC;

-- outbox_enqueue refuses an infinite delay (PostgreSQL 17 has infinite
-- intervals): such an event would never fall due. Unchanged otherwise.
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
                               available_at, expires_at)
    VALUES (new_id, event_type, payload, args, resolved_queue, task, headers, priority,
            enqueued_at OPERATOR(pg_catalog.+) coalesce(delay, interval '0'),
            enqueued_at OPERATOR(pg_catalog.+) expires);
    RETURN new_id;
END
$$;
