-- outbox_dispatch without the library: the start of the script
-- `outbox-dispatch install` runs. The files after pin search_path for the
-- transaction (SET LOCAL), as CREATE EXTENSION does; a migration may go on
-- in the same transaction, so the caller's is kept here and put back at
-- the end (sql/standalone/tail.sql).
SELECT pg_catalog.set_config('outbox_dispatch.caller_search_path', pg_catalog.current_setting('search_path'), true);
