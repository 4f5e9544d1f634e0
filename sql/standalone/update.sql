-- outbox_dispatch without the library: the end of an update's script
-- (`outbox-dispatch install` on a database at an earlier release). The files
-- before it replaced what changed since that release; the rest is the same.
SET LOCAL search_path = pg_catalog, pg_temp;
UPDATE outbox.installed SET version = '@version@', installed_at = now();

-- The caller's search_path again (sql/standalone/head.sql).
SELECT pg_catalog.set_config('search_path', pg_catalog.current_setting('outbox_dispatch.caller_search_path'), true);
