-- When each generation began (outbox.generations), in milliseconds since
-- the epoch: an id (UUIDv7) made before its event's generation began may
-- copy an older event's (core/src/store/ids.rs). NULL: not begun.
SELECT g.generation, pg_catalog.date_part('epoch', g.started_at) * 1000
  FROM outbox.generations AS g
