-- outbox_dispatch 1.0.0 → 1.1.0 (CHANGELOG.md). Runs with search_path
-- pinned, as every script of the extension: each name below is
-- pg_catalog's or the extension's. `outbox-dispatch install` runs this
-- same file to update an outbox the sidecar installed at 1.0.0, without
-- the regions marked "extension only" (sidecar/src/script.rs), then
-- sql/standalone/updates/1.0.0--1.1.0.sql.
-- extension only: begin
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit
-- extension only: end
SET LOCAL search_path = pg_catalog, pg_temp;

-- The extension's schema again, for what follows (as after an install).
SET LOCAL search_path = @extschema@;
