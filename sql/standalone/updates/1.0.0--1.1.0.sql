-- outbox_dispatch without the library, 1.0.0 → 1.1.0: what changed of the
-- library's functions as sql/standalone/host.sql defines them, after the
-- extension's own update (sql/upgrade/outbox_dispatch--1.0.0--1.1.0.sql).
SET LOCAL search_path = pg_catalog, pg_temp;

-- Pinned, as every PL/pgSQL function a definer calls (the subscriptions'
-- definer functions fire it).
ALTER FUNCTION @extschema@.outbox_subscriptions_changed() SET search_path = pg_catalog, pg_temp;
-- What awaits an acknowledgement now keeps awaiting it
-- (sql/upgrade/outbox_dispatch--1.0.0--1.1.0.sql), by the database's
-- outbox.ack_timeout.
UPDATE outbox.batches AS b
   SET awaits_ack = true
 WHERE b.settled_at IS NULL AND b.marked_at IS NOT NULL
   AND coalesce(outbox.setting('outbox.ack_timeout'), '0')::pg_catalog.interval > interval '0';

-- An acknowledgement names the send it acknowledges, or is of an event
-- sent once (sql/ack.sql): outbox_ack(id, send), and outbox_ack(id) on it.
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

CREATE OR REPLACE FUNCTION @extschema@.outbox_ack(id uuid) RETURNS boolean
LANGUAGE sql VOLATILE STRICT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox.acknowledge(id, NULL) $$;

CREATE FUNCTION @extschema@.outbox_ack(id uuid, send uuid) RETURNS boolean
LANGUAGE sql VOLATILE STRICT SECURITY DEFINER PARALLEL UNSAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT outbox.acknowledge(id, send) $$;

REVOKE ALL ON FUNCTION outbox.acknowledge(uuid, uuid), @extschema@.outbox_ack(uuid, uuid) FROM PUBLIC;

-- The key's statements read outbox.log (sql/keys/), not the view
-- outbox.events, whose rows are derived a set at a time.
CREATE OR REPLACE FUNCTION @extschema@.outbox_key_taken(ordering_key text, subscription bigint) RETURNS boolean
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

CREATE OR REPLACE FUNCTION @extschema@.outbox_turn_fits(ordering_key text, subscription bigint, key_seq bigint,
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

CREATE OR REPLACE FUNCTION outbox.lock_key_of(id uuid, OUT ordering_key text, OUT subscription bigint)
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

-- A key's new head delayed goes out of line through events_pending_again
-- (sql/keys/pass.sql), which tells the dispatchers' due floor.
-- Passes on the key of head, its lock taken: src/keys.rs pass_now. Wakes
-- the sidecars at commit for a new head. Returns whether it let its key go.
CREATE OR REPLACE FUNCTION outbox.pass_key(head uuid, ordering_key text, subscription bigint,
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

-- The extension's schema again, for the files that follow.
SET LOCAL search_path = @extschema@;
