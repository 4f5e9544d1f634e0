-- The claim's lock (claim.sql runs next, in the same transaction, with a
-- snapshot of its own taken once this is granted): one claim at a time.
-- Waits for the claim before to commit, as long as it runs. A row lock
-- writes no new version of the row: nothing piles up under a pinned xmin.
-- No row locked: it was deleted by hand, and restore_turn.sql runs before
-- this again.
SELECT FROM outbox.claim_turn FOR UPDATE
