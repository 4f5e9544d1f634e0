-- One step of the rotation (sql/rotation.sql): generations of
-- outbox.retention $1 milliseconds, up to $2 events moved per step,
-- acknowledgements on ($3) or off. Returns what it did (NULL: nothing was
-- due) and how many events it moved or truncated.
SELECT r.step, r.events FROM outbox.rotate($1 * interval '1 millisecond', $2, $3) AS r
