-- outbox_dispatch without the library: what the library's functions do,
-- in SQL and PL/pgSQL, under the same names, for a server where
-- shared_preload_libraries is closed (a managed service). Runs after
-- sql/schema.sql, sql/standalone/setting_place.sql,
-- sql/standalone/uuid_v7.sql and sql/standalone/write_path.sql (the
-- settings' readers and the insert triggers) in the script `outbox-dispatch sql` prints
-- and `outbox-dispatch install` runs (sidecar/src/script.rs), as the
-- owner, who needs no superuser. The statements the library runs from
-- sql/ are included here as text (a dollar-quoted literal, put in by
-- sidecar/src/script.rs), run with EXECUTE: one copy of each, for both.
--
-- What the library does and this cannot (docs/guides/managed.md):
-- - the shared-memory counters (acked{source="sql"}, inbox duplicates,
--   the SQL side's key turns); the dispatcher's own counters are served
--   by the sidecar;
-- - outbox_inbox_claim()'s check that it runs in a transaction block;
-- - a keyed insert at REPEATABLE READ or SERIALIZABLE (refused, below);
-- - subscribing as a role other than the outbox's owner.

SET LOCAL search_path = pg_catalog, pg_temp;

-- The settings the SQL side reads. Without the library every outbox.*
-- name is a placeholder any session may SET, so the ones that limit a
-- writer are read from here, which only the owner may change, and then
-- from ALTER DATABASE ... SET (the catalog, not the session).
CREATE TABLE outbox.settings (
    name  text PRIMARY KEY CHECK (name ~ '^outbox\.[a-z_]+$'),
    value text NOT NULL
);

COMMENT ON TABLE outbox.settings IS
    'outbox.* settings of this database without the library (the owner''s to change): these, then ALTER DATABASE ... SET, then the defaults.';

-- What is written here is a setting that belongs here, and what the SQL
-- side reads of it is checked as it is written.
CREATE FUNCTION outbox.check_setting() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    place constant text := outbox.setting_place(NEW.name);
BEGIN
    IF place IS NULL THEN
        RAISE EXCEPTION '% is not a setting of outbox_dispatch', NEW.name
            USING ERRCODE = 'undefined_object';
    ELSIF place = 'sidecar' THEN
        RAISE EXCEPTION '% belongs to the sidecar''s own configuration (a secret, or a path on its host), not to the database',
            NEW.name USING ERRCODE = 'invalid_parameter_value';
    ELSIF place = 'library' THEN
        RAISE EXCEPTION '% is the library''s (its launcher''s): without it, run as many outbox-dispatch as you need',
            NEW.name USING ERRCODE = 'invalid_parameter_value';
    ELSIF place = 'session' THEN
        RAISE EXCEPTION '% is each session''s own: SET it, or ALTER ROLE ... SET it', NEW.name
            USING ERRCODE = 'invalid_parameter_value';
    ELSIF place = 'internal' THEN
        RAISE EXCEPTION '% is the rotation''s own, not a setting to set', NEW.name
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN
        PERFORM outbox.setting_value(NEW.name, NEW.value);
    EXCEPTION WHEN invalid_parameter_value OR numeric_value_out_of_range OR invalid_datetime_format
                   OR datetime_field_overflow OR interval_field_overflow THEN
        IF starts_with(SQLERRM, NEW.name) THEN
            RAISE;  -- out of bounds: the message names it already
        END IF;
        RAISE EXCEPTION '% is "%": %', NEW.name, NEW.value, SQLERRM USING ERRCODE = 'invalid_parameter_value';
    END;
    RETURN NEW;
END
$$;
CREATE TRIGGER settings_checked
    BEFORE INSERT OR UPDATE ON outbox.settings
    FOR EACH ROW EXECUTE FUNCTION outbox.check_setting();

-- outbox.report_timeout while reports are on (outbox.report_key not
-- empty); NULL while they are off or it is 0.
CREATE FUNCTION @extschema@.outbox_report_timeout() RETURNS interval
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT CASE WHEN coalesce(outbox.setting('outbox.report_key'), 'outbox_dispatch.reports') <> ''
            THEN nullif(outbox.setting_value('outbox.report_timeout', outbox.setting('outbox.report_timeout'))
                        * interval '1 second', interval '0')
       END
$$;
-- The sidecars LISTEN on this channel; the NOTIFY is sent at commit.
CREATE FUNCTION @extschema@.outbox_wake() RETURNS void
LANGUAGE sql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT pg_notify('outbox_dispatch_wake', '') $$;

-- Nothing to drop: without the library nothing caches the subscriptions.
CREATE FUNCTION @extschema@.outbox_subscriptions_changed() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$ BEGIN RETURN NULL; END $$;

-- Subscriptions are the outbox owner's to make and end here: the library
-- records the role calling and acts as the owner, which SQL cannot do in
-- one call.
CREATE FUNCTION outbox.require_owner(function_ text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user, outbox.owner(), 'USAGE') THEN
        RAISE EXCEPTION '%: without the library only the outbox''s owner (role %) manages subscriptions',
            function_, outbox.owner()::regrole
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END
$$;

CREATE FUNCTION @extschema@.outbox_subscribe(
    event_type text,
    task       text,
    queue      text DEFAULT NULL,
    priority   integer DEFAULT NULL,
    batch_max  integer DEFAULT NULL,
    batch_wait interval DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.require_owner('outbox_subscribe');
    RETURN @extschema@.outbox_subscription_add(current_user, event_type, task, queue, priority,
                                               batch_max, batch_wait);
END
$$;

CREATE FUNCTION @extschema@.outbox_unsubscribe(id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox.require_owner('outbox_unsubscribe');
    RETURN @extschema@.outbox_subscription_end(
        (SELECT r.oid FROM pg_roles AS r WHERE r.rolname = current_user), id);
END
$$;

-- Is the key taken, does the turn fit (sql/keys/taken.sql, fits.sql)?
-- The library reads them with the latest snapshot whatever the caller's
-- isolation; a statement of PL/pgSQL does so at READ COMMITTED only, so a
-- keyed insert under another isolation is refused.
CREATE FUNCTION outbox.require_read_committed() RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'outbox: an event with an ordering_key is enqueued at READ COMMITTED without the library (transaction_isolation is %)',
            current_setting('transaction_isolation')
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'Enqueue it in a READ COMMITTED transaction, or load the library (shared_preload_libraries).';
    END IF;
END
$$;

CREATE FUNCTION @extschema@.outbox_key_taken(ordering_key text, subscription bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    taken boolean;
BEGIN
    PERFORM outbox.require_read_committed();
    EXECUTE @include keys/taken.sql@ INTO taken USING ordering_key, subscription;
    RETURN coalesce(taken, false);
END
$$;

CREATE FUNCTION @extschema@.outbox_turn_fits(ordering_key text, subscription bigint, key_seq bigint,
                                             key_state text) RETURNS boolean
LANGUAGE plpgsql VOLATILE STRICT PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    fits boolean;
BEGIN
    PERFORM outbox.require_read_committed();
    EXECUTE @include keys/fits.sql@ INTO fits USING ordering_key, subscription, key_seq, key_state;
    RETURN coalesce(fits, false);
END
$$;

-- The key event id holds, when it is its key's head, its lock taken
-- (waiting for a producer of the key to commit): src/keys.rs lock_key_of.
CREATE FUNCTION outbox.lock_key_of(id uuid, OUT ordering_key text, OUT subscription bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    EXECUTE @include keys/key_of.sql@ INTO ordering_key, subscription USING id;
    IF ordering_key IS NOT NULL THEN
        EXECUTE @include keys/lock.sql@ USING ARRAY[ordering_key], ARRAY[subscription], true;
    END IF;
END
$$;

-- Passes on the key of head, its lock taken: src/keys.rs pass_now. Wakes
-- the sidecars at commit for a new head. Returns whether it let its key go.
CREATE FUNCTION outbox.pass_key(head uuid, ordering_key text, subscription bigint,
                                failed boolean, dispatched boolean) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    passed bigint;
    promoted bigint;
BEGIN
    EXECUTE @include keys/lock.sql@ USING ARRAY[ordering_key], ARRAY[subscription], true;
    EXECUTE @include keys/pass.sql@ INTO passed, promoted
        USING ARRAY[head], ARRAY[]::text[], ARRAY[]::bigint[], failed, dispatched;
    IF promoted > 0 THEN
        PERFORM @extschema@.outbox_wake();
    END IF;
    RETURN passed > 0;
END
$$;

-- outbox_ack(id) and outbox_ack(id, send): records the outcome of the
-- event as the send `send` carried it (NULL: the one send there has been;
-- sql/ack.sql), and passes its key on: src/api.rs acknowledge.
CREATE FUNCTION outbox.acknowledge(id uuid, send uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    acked boolean;
    head uuid;
    key_ text;
    subscription bigint;
    unnamed boolean;
BEGIN
    PERFORM outbox.lock_key_of(id);
    EXECUTE @include ack_lock.sql@ USING id;
    EXECUTE @include ack.sql@ INTO acked, head, key_, subscription, unnamed USING id, send;
    IF unnamed THEN
        RAISE WARNING 'outbox_ack: event % is not acknowledged without its send: it was sent more than once, or its push is not recorded yet; name the send (outbox_ack(id, send), send from the message''s outbox_send header)', id;
    END IF;
    IF NOT coalesce(acked, false) THEN
        RETURN false;
    END IF;
    IF head IS NOT NULL THEN
        PERFORM outbox.pass_key(head, key_, subscription, false, false);
    END IF;
    RETURN true;
END
$$;

CREATE FUNCTION @extschema@.outbox_ack(id uuid) RETURNS boolean
LANGUAGE sql VOLATILE STRICT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox.acknowledge(id, NULL) $$;

CREATE FUNCTION @extschema@.outbox_ack(id uuid, send uuid) RETURNS boolean
LANGUAGE sql VOLATILE STRICT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox.acknowledge(id, send) $$;

CREATE FUNCTION @extschema@.outbox_skip(id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE STRICT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    held record;
BEGIN
    SELECT * INTO held FROM outbox.lock_key_of(id);
    IF held.ordering_key IS NULL THEN
        RETURN false;
    END IF;
    RETURN outbox.pass_key(id, held.ordering_key, held.subscription, true, true);
END
$$;

CREATE FUNCTION @extschema@.outbox_inbox_claim(id uuid, consumer text DEFAULT '') RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    claimed boolean;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION 'outbox_inbox_claim: id must not be null' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF consumer IS NULL THEN
        RAISE EXCEPTION 'outbox_inbox_claim: consumer must not be null (use '''' for a single consumer)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(consumer) > 255 THEN
        RAISE EXCEPTION 'outbox_inbox_claim: consumer is % bytes, the limit is 255 bytes', octet_length(consumer)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    EXECUTE @include inbox/claim.sql@ INTO claimed USING id, consumer;
    RETURN coalesce(claimed, false);
END
$$;

-- The sidecars' dispatchers, as each last wrote its row (at its state
-- changes and heartbeats, never in a claim's transaction). UNLOGGED: after
-- a crash the sidecars write them again.
CREATE UNLOGGED TABLE outbox.sidecar_workers (
    worker             integer PRIMARY KEY,
    pid                integer,
    host               text,
    state              text NOT NULL,
    connected          boolean NOT NULL DEFAULT false,
    started_at         timestamptz,
    last_heartbeat     timestamptz,
    last_error         text,
    events_dispatched  bigint NOT NULL DEFAULT 0,
    broker_persistence text
);

COMMENT ON TABLE outbox.sidecar_workers IS
    'One row per dispatcher of the sidecars (outbox-dispatch run), written by them: what outbox.workers shows without the library.';

CREATE FUNCTION @extschema@.outbox_dispatchers() RETURNS TABLE (
    worker integer, pid integer, state text, connected boolean, started_at timestamptz,
    last_heartbeat timestamptz, last_error text, events_dispatched bigint, broker_persistence text,
    database text)
LANGUAGE sql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT w.worker, w.pid, w.state, w.connected, w.started_at, w.last_heartbeat, w.last_error,
       w.events_dispatched, w.broker_persistence, current_database()::text
  FROM outbox.sidecar_workers AS w
 ORDER BY w.worker
$$;

CREATE FUNCTION @extschema@.outbox_workers() RETURNS TABLE (
    worker integer, pid integer, state text, connected boolean, started_at timestamptz,
    last_heartbeat timestamptz, last_error text, events_dispatched bigint, broker_persistence text)
LANGUAGE sql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT d.worker, d.pid, d.state, d.connected, d.started_at, d.last_heartbeat, d.last_error,
       d.events_dispatched, d.broker_persistence
  FROM @extschema@.outbox_dispatchers() AS d
$$;

-- The gauges read from the database (sql/metrics/gauges.sql); the
-- counters and the dispatchers' gauges are on the sidecar's /metrics.
CREATE FUNCTION @extschema@.outbox_metrics() RETURNS TABLE (name text, labels jsonb, value double precision)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    retention integer := outbox.setting_value('outbox.retention', outbox.setting('outbox.retention'));
BEGIN
    RETURN QUERY EXECUTE
        'SELECT g.name, CASE WHEN g.status IS NULL THEN ''{}''::jsonb ELSE jsonb_build_object(''status'', g.status) END,
                g.value
           FROM (' || @include metrics/gauges.sql@ || E'\n) AS g(name, status, value)'
        USING retention;
END
$$;

-- The same as Prometheus text exposition, each family typed a gauge.
CREATE FUNCTION @extschema@.outbox_metrics_prometheus() RETURNS text
LANGUAGE sql VOLATILE SECURITY DEFINER PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT coalesce(string_agg(f.text, ''), '')
  FROM (SELECT m.name, '# TYPE ' || m.name || E' gauge\n'
                       || string_agg(m.name
                                     || CASE WHEN m.labels = '{}' THEN ''
                                             ELSE '{status="' || (m.labels ->> 'status') || '"}' END
                                     || ' ' || m.value::text || E'\n', '' ORDER BY m.labels ->> 'status') AS text
          FROM @extschema@.outbox_metrics() WITH ORDINALITY AS m(name, labels, value, ord)
         GROUP BY m.name
         ORDER BY min(m.ord)) AS f
$$;

-- The extension's schema again, for the files that follow.
SET LOCAL search_path = @extschema@;
