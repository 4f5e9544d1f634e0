-- outbox_ack($1), one at a time per event: waits for another
-- acknowledgement of the same event to end, so that ack.sql (a statement of
-- its own, whose snapshot is taken after) finds its outcome and takes none
-- (outbox.outcomes has no key to refuse a second). An advisory lock on the
-- hash of the id, seeded with -1: apart from the keys' locks, which are
-- seeded with their subscription (sql/keys/lock.sql). A session at
-- repeatable read keeps its older snapshot, and may record a second
-- outcome, which every reader counts once.
SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended($1::pg_catalog.text, -1))
