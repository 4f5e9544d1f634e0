-- outbox_dispatch 0.10.0 → 1.0.0: the first release, the baseline of the
-- version history (CHANGELOG.md). Its schema is 0.10.0's: what 1.0.0 changes
-- is the library's (the broker settings' names), not SQL. The update chain
-- starts at 0.8.0; tests/fixtures/outbox_dispatch--0.8.0.sql is that
-- release's install script, which the tests update from. Frozen once
-- released: later changes go in a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit
