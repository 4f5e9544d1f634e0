-- The batch that holds place ($1, $2) in line (outbox.held_by()), as
-- src/state.rs keeps it for the places that follow: its page of a window,
-- whether it was marked, whether it was abandoned. Every name qualified:
-- it runs under its caller's search_path.
SELECT h.id, h.from_xid::pg_catalog.text, h.from_id, h.to_xid::pg_catalog.text, h.to_id,
       h.prev::pg_catalog.text, h.target::pg_catalog.text, h.marked_at IS NOT NULL, h.abandoned_at IS NOT NULL
  FROM outbox.held_by($1, $2) AS h
