-- outbox_dispatch without the library: the end of the script
-- `outbox-dispatch install` runs (after sql/api.sql).

SET LOCAL search_path = pg_catalog, pg_temp;

-- The rotation sets outbox.moving for its own transaction, and the insert
-- triggers then leave the rows as they are. The library makes it a setting
-- only a superuser may set; here it is a placeholder any session may, so
-- a row written with it on by a role without the owner's privileges is
-- refused: a writer must not choose its own place in line.
CREATE FUNCTION outbox.refuse_moving() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user, outbox.owner(), 'USAGE') THEN
        RAISE EXCEPTION 'outbox.moving is the rotation''s own: role % may not write events with it on', current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER events_moving_refused
    BEFORE INSERT OR UPDATE ON outbox.log
    FOR EACH ROW WHEN (pg_catalog.current_setting('outbox.moving', true) = 'on')
    EXECUTE FUNCTION outbox.refuse_moving();
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_moving_refused;

-- Which release is installed: a second install of the same one does
-- nothing, of another refuses.
CREATE TABLE outbox.installed (
    version      text NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now(),
    only_row     boolean PRIMARY KEY DEFAULT true CHECK (only_row)
);
INSERT INTO outbox.installed (version) VALUES ('@version@');

COMMENT ON TABLE outbox.installed IS
    'The release of outbox_dispatch installed without the library (outbox-dispatch install).';

REVOKE ALL ON FUNCTION outbox.check_setting(), outbox.refuse_moving(), outbox.lock_key_of(uuid),
    outbox.pass_key(uuid, text, bigint, boolean, boolean), outbox.acknowledge(uuid, uuid) FROM PUBLIC;
GRANT SELECT ON outbox.settings, outbox.installed, outbox.sidecar_workers TO pg_monitor;

-- The caller's search_path again (sql/standalone/head.sql).
SELECT pg_catalog.set_config('search_path', pg_catalog.current_setting('outbox_dispatch.caller_search_path'), true);
