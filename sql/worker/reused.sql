-- Of the events a claim took, $1 (each in generation $2[i], written at
-- $3[i]), those whose id an event of another generation written no later
-- already has: a writer's copy of another event's id, which a consumer's
-- inbox (keyed by the task id) would take for that event's and drop the
-- event itself when it comes (core/src/store/ids.rs). The dispatcher
-- dead-letters them unsent. Served by each partition's primary key. (The
-- multi-argument unnest is syntax and cannot be qualified; the pinned
-- search_path resolves it in pg_catalog.)
SELECT c.id
  FROM unnest($1::uuid[], $2::int8[], $3::text[]) AS c(id, generation, created_at)
 WHERE EXISTS (SELECT
                 FROM outbox.log AS o
                WHERE o.id = c.id
                  AND o.generation <> c.generation
                  AND o.created_at <= c.created_at::timestamptz)
