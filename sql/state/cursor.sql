-- Where the claims have read up to (outbox.cursor), as src/state.rs keeps
-- it for its statement: a place it has not read is pending, and asks
-- nothing of the batches. Every name qualified: it runs under its
-- caller's search_path.
SELECT c.prev::pg_catalog.text, c.target::pg_catalog.text, c.after_xid::pg_catalog.text, c.after_id
  FROM outbox.cursor AS c
