-- Generation $1's rows a restore wrote with the triggers off are in line
-- (reline_restored.sql): its partition's triggers fire always again.
SELECT FROM outbox.fire_always($1::pg_catalog.int2)
