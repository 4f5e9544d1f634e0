-- The claim's lock (claim.sql runs next, in the same transaction, with a
-- snapshot of its own taken once this is granted): one claim at a time.
-- Waits for the claim before to commit, as long as it runs.
SELECT FROM outbox.cursor FOR UPDATE
