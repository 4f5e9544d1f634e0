-- outbox_dispatch without the library: the start of an update's script,
-- after sql/standalone/head.sql. What it updates must be the release it
-- updates from (outbox-dispatch install checks that too; a migration that
-- runs `outbox-dispatch sql --update-from` relies on this).
SET LOCAL search_path = pg_catalog, pg_temp;
DO $$
DECLARE
    installed text := (SELECT i.version FROM outbox.installed AS i);
BEGIN
    IF installed IS DISTINCT FROM '@from@' THEN
        RAISE EXCEPTION 'outbox_dispatch % is installed in this database: this script updates @from@', installed
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
END
$$;
