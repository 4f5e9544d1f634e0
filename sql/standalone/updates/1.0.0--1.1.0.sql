-- outbox_dispatch without the library, 1.0.0 → 1.1.0: what changed of the
-- library's functions as sql/standalone/host.sql defines them, after the
-- extension's own update (sql/upgrade/outbox_dispatch--1.0.0--1.1.0.sql).
SET LOCAL search_path = pg_catalog, pg_temp;

-- The extension's schema again, for the files that follow.
SET LOCAL search_path = @extschema@;
