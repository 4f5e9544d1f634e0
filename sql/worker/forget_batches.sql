-- Up to $1 batches whose events are all gone (sql/rotation.sql).
SELECT outbox.forget_batches($1)
