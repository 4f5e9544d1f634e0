-- The row of outbox.claim_turn, deleted by hand, put back before the claim
-- locks it (lock_cursor.sql): a claim that locked nothing would claim
-- beside the others. Another claim putting it back at the same time is
-- waited for (its insert holds the key until it commits).
INSERT INTO outbox.claim_turn DEFAULT VALUES
ON CONFLICT DO NOTHING
