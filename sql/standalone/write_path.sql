-- outbox_dispatch without the library: what every write calls (an
-- enqueue, an ORM's INSERT, a delivery the routing trigger inserts), in
-- place of the library's functions. Its own file, run by an install
-- before sql/standalone/host.sql and again by an update from 1.0.0
-- (sidecar/src/script.rs, UPDATES): each CREATE OR REPLACEs its function.
--
-- Each runs as another role, or with another's compiled copy: SECURITY
-- DEFINER as the outbox's owner, or PL/pgSQL that a definer calls (a
-- session compiles a PL/pgSQL function once, with the types of whoever
-- called it first, and a definer caller then reuses that copy; the types
-- of its DECLARE resolve through the caller's path, pg_temp first). Each
-- pins its search_path: measured, the four clauses cost an enqueue 4% of
-- its server time (docs/design/design.md, "Names a caller controls").
-- tests/test_roles.py checks them as installed, and plants a caller's
-- types, operators and functions.
SET LOCAL search_path = pg_catalog, pg_temp;

-- The setting called name: its row in outbox.settings, else the database's
-- ALTER DATABASE ... SET, else NULL. Never the session's own SET.
-- SECURITY DEFINER: a writer's outbox_enqueue() reads the payload limit.
CREATE OR REPLACE FUNCTION outbox.setting(name text) RETURNS text
LANGUAGE plpgsql STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    value pg_catalog.text;
BEGIN
    SELECT s.value INTO value FROM outbox.settings AS s WHERE s.name OPERATOR(pg_catalog.=) setting.name;
    IF value IS NULL THEN
        SELECT pg_catalog.substr(c, pg_catalog.length(setting.name) OPERATOR(pg_catalog.+) 2) INTO value
          FROM pg_catalog.pg_db_role_setting AS d CROSS JOIN LATERAL pg_catalog.unnest(d.setconfig) AS c
         WHERE d.setdatabase OPERATOR(pg_catalog.=) (SELECT o.oid FROM pg_catalog.pg_database AS o
                                                       WHERE o.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
           AND d.setrole OPERATOR(pg_catalog.=) 0
           AND pg_catalog.starts_with(c, setting.name OPERATOR(pg_catalog.||) '=')
         LIMIT 1;
    END IF;
    RETURN value;
END
$$;

-- The value of setting name given as value (NULL: its default), as the
-- library bounds it: bytes for a size, seconds for a time; an error that
-- names the setting and its limits when it is not. NULL for a setting the
-- SQL side does not read. One place for the bounds (src/config.rs), used
-- where a setting is written (outbox.check_setting()) and where it is read.
CREATE OR REPLACE FUNCTION outbox.setting_value(name text, value text) RETURNS bigint
LANGUAGE plpgsql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    unit pg_catalog.text;
    default_ bigint;
    least_ bigint;
    most bigint;
    amount numeric;
BEGIN
    -- name, unit, default, least, most: one line each (no CASE name WHEN,
    -- which finds = through the caller's search_path).
    IF name OPERATOR(pg_catalog.=) 'outbox.max_payload_bytes' THEN
        unit := 'bytes'; default_ := 1048576; least_ := 1; most := 2147483647;
    ELSIF name OPERATOR(pg_catalog.=) 'outbox.report_timeout' THEN
        unit := 'seconds'; default_ := 3600; least_ := 0; most := 2592000;
    ELSIF name OPERATOR(pg_catalog.=) 'outbox.retention' THEN
        unit := 'seconds'; default_ := 604800; least_ := 1; most := 315360000;
    ELSE
        RETURN NULL;
    END IF;
    IF value IS NULL THEN
        RETURN default_;
    END IF;
    -- No exception block here, which would start a subtransaction on every
    -- enqueue: a value PostgreSQL cannot parse raises its own error, and
    -- outbox.check_setting() names the setting in it as it is written.
    IF unit OPERATOR(pg_catalog.=) 'bytes' THEN
        amount := pg_catalog.pg_size_bytes(value);
    ELSE
        amount := pg_catalog.date_part('epoch', value::pg_catalog.interval);
    END IF;
    IF amount OPERATOR(pg_catalog.<) least_ OR amount OPERATOR(pg_catalog.>) most THEN
        RAISE EXCEPTION '% is "%": it must be from % to % % (a number is %)', name, value, least_, most, unit, unit
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN amount::pg_catalog.int8;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.outbox_max_payload_bytes() RETURNS integer
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
SELECT outbox.setting_value('outbox.max_payload_bytes', outbox.setting('outbox.max_payload_bytes'))::pg_catalog.int4
$$;

-- Statement trigger on outbox.log: a NOTIFY on outbox.notify_channel when
-- the session asks for it (outbox.notify = on), not for the sidecar's own
-- inserts (outbox.dispatching = on, which it sets). A delivery that
-- outbox_route() inserts fires it as the owner.
CREATE OR REPLACE FUNCTION @extschema@.outbox_events_inserted() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    channel pg_catalog.text;
BEGIN
    -- No IS DISTINCT FROM: it finds = through the search_path.
    IF coalesce(pg_catalog.current_setting('outbox.notify', true), '') OPERATOR(pg_catalog.<>) 'on'
       OR coalesce(pg_catalog.current_setting('outbox.dispatching', true), '') OPERATOR(pg_catalog.=) 'on' THEN
        RETURN NULL;
    END IF;
    channel := coalesce(pg_catalog.current_setting('outbox.notify_channel', true), 'outbox_new');
    IF pg_catalog.octet_length(channel) OPERATOR(pg_catalog.=) 0
       OR pg_catalog.octet_length(channel) OPERATOR(pg_catalog.>) 63 THEN
        RAISE EXCEPTION 'outbox.notify_channel is % bytes, it must be 1 to 63 bytes (or outbox.notify off)',
            pg_catalog.octet_length(channel)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_catalog.pg_notify(channel, '');
    RETURN NULL;
END
$$;

-- 0 (routed to none) while no subscription is active, else NULL (the
-- routing trigger decides): an index probe per insert, as no cache holds
-- the answer. PL/pgSQL for its kept plan.
CREATE OR REPLACE FUNCTION @extschema@.outbox_routed_to_default() RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF EXISTS (SELECT FROM outbox.all_subscriptions AS s WHERE s.unsubscribed_at IS NULL) THEN
        RETURN NULL;
    END IF;
    RETURN 0;
END
$$;

-- The extension's schema again, for the files that follow.
SET LOCAL search_path = @extschema@;
