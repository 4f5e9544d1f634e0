-- outbox_inbox_claim($1, $2): message $1 is claimed for consumer $2 by the
-- calling transaction, unless it was claimed before. A claim another
-- transaction holds and has not committed makes this wait for it (the
-- primary key's uniqueness check): claimed if it commits, this one's if it
-- rolls back. Returns a row when this claimed it. Served by the primary key.
INSERT INTO outbox.inbox (id, consumer)
VALUES ($1, $2)
ON CONFLICT DO NOTHING
RETURNING true
