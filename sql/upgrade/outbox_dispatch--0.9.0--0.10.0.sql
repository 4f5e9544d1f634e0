-- outbox_dispatch 0.9.0 → 0.10.0: one write per event (README, "How it
-- works"). Frozen once released: later changes go in a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- The events' table is outbox.log; outbox.events becomes a view of it, which
-- applications use as before. Everything bound to the table (its indexes,
-- triggers, constraints, pg_dump's configuration) stays bound through the
-- rename. The views that read the columns which go are made again below.
ALTER TABLE outbox.events RENAME TO log;
DROP VIEW outbox.status, outbox.unreported, outbox.blocked_keys, outbox.deliveries;

-- The snapshot the claims start from, taken by the transaction that
-- creates (or updates) the extension: its own, but with that transaction
-- in progress. A transaction's own snapshot counts it as ended once a
-- later one has ended; whatever it goes on to enqueue (a migration that
-- creates the extension and enqueues in one transaction, a restore in
-- one) would be behind the first claim, never read.
CREATE FUNCTION outbox.starting_snapshot() RETURNS pg_catalog.pg_snapshot
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT CASE WHEN NOT pg_visible_in_snapshot(x.xid, s.s) THEN s.s
            ELSE (least(pg_snapshot_xmin(s.s), x.xid)::text || ':' || pg_snapshot_xmax(s.s)::text || ':'
                  || (SELECT string_agg(i.xid::text, ',' ORDER BY i.xid)
                        FROM (SELECT pg_snapshot_xip(s.s) AS xid UNION ALL SELECT x.xid) AS i))::pg_snapshot
       END
  FROM (SELECT pg_current_snapshot() AS s) AS s,
       (SELECT pg_current_xact_id() AS xid) AS x
$$;

-- Where the claims have read up to: every transaction `prev` sees has been
-- read; the window being read is what `target` sees and `prev` does not,
-- in (pending_xid, id) order, read up to (after_xid, after_id) (NULL: from
-- its start; no target: the next claim starts a window with its own
-- snapshot). A claim takes its turn (outbox.claim_turn; the pushes run
-- side by side), reads a page of the window and moves the position; one
-- that reads less than a page has finished the window, and makes `target`
-- the next `prev` (sql/worker/claim.sql).
--
-- Each move is a new row and the row it replaces is deleted, and the
-- position is the newest row (outbox.cursor): read from the right end of
-- the primary key, it costs the same however many old rows a pinned xmin
-- keeps, where one row updated by every claim would be a chain of versions
-- each read had to walk.
-- Not dumped: its transaction ids are this cluster's (a restore creates
-- the extension, which makes a new one).
CREATE TABLE outbox.positions (
    position  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    prev      pg_catalog.pg_snapshot NOT NULL,
    target    pg_catalog.pg_snapshot,
    after_xid xid8,
    after_id  uuid
);

COMMENT ON TABLE outbox.positions IS
    'Where the dispatchers have read outbox.log up to: the newest row (outbox.cursor); each claim adds one and deletes the one before.';

CREATE VIEW outbox.cursor AS
SELECT p.position, p.prev, p.target, p.after_xid, p.after_id
  FROM outbox.positions AS p
 ORDER BY p.position DESC
 LIMIT 1;

COMMENT ON VIEW outbox.cursor IS
    'Where the dispatchers have read outbox.log up to (the newest of outbox.positions).';

-- The claims' turn: a claim locks the one row (FOR UPDATE, which writes no
-- new version of it) and holds it until it commits; one claim at a time
-- per database, each with a snapshot taken once the one before committed.
-- A claim that finds the row gone puts it back (sql/worker/restore_turn.sql).
CREATE TABLE outbox.claim_turn (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row)
);
INSERT INTO outbox.claim_turn DEFAULT VALUES;

COMMENT ON TABLE outbox.claim_turn IS
    'One row the claims lock in turn (sql/worker/lock_cursor.sql).';

-- One row per claim: the page of a window it read, and what became of it.
-- Its events are those of the window between its two positions still in
-- line there (outbox_batch_members()). An event is written only when
-- something exceptional happens to it (a failed push, a dead letter, a
-- release, a re-send); otherwise its batch is its state (README, "How it
-- works"). Messages carry `send`, which a report must name.
CREATE TABLE outbox.batches (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    send         uuid NOT NULL,
    dispatcher   integer NOT NULL,
    claimed_at   timestamptz NOT NULL,
    prev         pg_catalog.pg_snapshot NOT NULL,
    target       pg_catalog.pg_snapshot NOT NULL,
    from_xid     xid8,  -- after this position (NULL: from the window's start)
    from_id      uuid,
    to_xid       xid8 NOT NULL,  -- up to this one, included
    to_id        uuid NOT NULL,
    events       integer NOT NULL,
    marked_at    timestamptz,  -- pushed: its events are in the broker
    abandoned_at timestamptz,  -- not marked within outbox.processing_timeout: its events went back in line
    settled_at   timestamptz   -- nothing is awaited of its events any more (acknowledgements off, or swept)
)
WITH (fillfactor = 50);

COMMENT ON TABLE outbox.batches IS
    'The claims of the dispatchers, one row each: which events they read, and whether they were pushed.';

-- The batch of an event: those whose last position is at or after it.
CREATE INDEX batches_to_idx ON outbox.batches (to_xid, to_id);
-- Claims not marked yet: the stuck sweeper, a restarted dispatcher.
CREATE INDEX batches_unmarked_idx ON outbox.batches (claimed_at, dispatcher)
    WHERE marked_at IS NULL AND abandoned_at IS NULL;
-- Batches whose events may still be acknowledged: the unacknowledged
-- sweeper; then retention.
CREATE INDEX batches_unsettled_idx ON outbox.batches (marked_at)
    WHERE settled_at IS NULL AND marked_at IS NOT NULL;
CREATE INDEX batches_settled_idx ON outbox.batches (settled_at) WHERE settled_at IS NOT NULL;
CREATE INDEX batches_abandoned_idx ON outbox.batches (abandoned_at) WHERE abandoned_at IS NOT NULL;

-- The generation rows are inserted in: which partition of outbox.log (and
-- of outbox.outcomes) takes them. The column's default reads it from this
-- sequence, which nothing advances (a setval moves it; a read writes
-- nothing, where nextval would write WAL). Readable by everyone, since
-- every insert reads it. The rotation moves it on (sql/rotation.sql).
CREATE SEQUENCE outbox.generation AS smallint MINVALUE 0 MAXVALUE 2;
SELECT pg_catalog.setval('outbox.generation', 0, true);
GRANT SELECT ON SEQUENCE outbox.generation TO PUBLIC;

-- Events a Celery worker reported processed, or a consumer acknowledged
-- (outbox_ack()), by batch: a round of reports appends, per batch and
-- generation it touched, rows of at most 100 of its events, and an
-- acknowledgement a row of one. An array costs 16 bytes of WAL an event
-- where a row each cost about 190 with its index entry (bench/wal.py), and
-- at 100 a row stays small enough to be stored inline. An event is looked
-- up through the batch that holds its position (outbox.batch_of(..., true)): one
-- with an outcome never leaves its batch. Failures are written to the
-- event itself. Each in the generation of its events: the outcomes of a
-- partition of the log are a partition of their own, which goes with it.
-- Only appended and truncated (no update or delete: no replica identity
-- needed where the table is published).
CREATE TABLE outbox.outcomes (
    batch      bigint NOT NULL,
    events     uuid[] NOT NULL,
    at         timestamptz NOT NULL DEFAULT pg_catalog.now(),
    generation smallint NOT NULL
               DEFAULT pg_catalog.pg_sequence_last_value('outbox.generation'::pg_catalog.regclass)::smallint
)
PARTITION BY LIST (generation);

DO $$
BEGIN
    FOR generation IN 0..2 LOOP
        EXECUTE pg_catalog.format('CREATE TABLE outbox.outcomes_%1$s PARTITION OF outbox.outcomes'
                                  ' FOR VALUES IN (%1$s)', generation);
    END LOOP;
END
$$;

CREATE INDEX outcomes_batch_idx ON outbox.outcomes (batch);

COMMENT ON TABLE outbox.outcomes IS
    'Events reported processed by a Celery worker or acknowledged with outbox_ack(), by batch.';

-- Records event $3[i] of batch $1[i], in generation $2[i], processed at
-- $4[i] (NULL: now), in rows of at most 100 events per batch, generation
-- and time (each keeps its own). Returns the events. The caller has made
-- sure none is recorded already.
CREATE FUNCTION outbox.record_outcomes(batch bigint[], generation smallint[], event uuid[], at timestamptz[])
RETURNS SETOF uuid
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
WITH recorded AS (
    INSERT INTO outbox.outcomes (batch, generation, events, at)
    SELECT r.batch, r.generation, array_agg(r.event), r.at
      FROM (SELECT u.batch, u.generation, u.event, coalesce(u.at, now()) AS at,
                   (row_number() OVER (PARTITION BY u.batch, u.generation, coalesce(u.at, now())) - 1) / 100 AS row_
              FROM unnest($1, $2, $3, $4) AS u(batch, generation, event, at)) AS r
     GROUP BY r.batch, r.generation, r.at, r.row_
    RETURNING events
)
SELECT unnest(recorded.events) FROM recorded
$$;

REVOKE ALL ON FUNCTION outbox.record_outcomes(bigint[], smallint[], uuid[], timestamptz[]) FROM PUBLIC;

-- The transaction id before `xid` (xid8 has no arithmetic): after the
-- last event of that transaction comes the first of `xid`.
CREATE FUNCTION outbox.xid_before(xid xid8) RETURNS xid8
LANGUAGE sql IMMUTABLE STRICT
RETURN ((xid::pg_catalog.text::pg_catalog.numeric OPERATOR(pg_catalog.-) 1)::pg_catalog.text)::xid8;

-- The events of a batch (its window, between its positions, still in
-- line there), in their order: the transactions the window's `prev` saw in
-- progress and its `target` ended, then those from `prev`'s xmax on; each
-- range of events_pending_xid_idx read from its start. SECURITY DEFINER:
-- the views that call it (outbox.status, outbox.unreported) are read by
-- roles that may not read outbox.log; it returns ids and transaction ids,
-- never what an event says, and only for a window and positions a batch
-- has (which only those who may read outbox.batches know). Not inlined, so the planner takes ROWS as its
-- size: a batch's (outbox.batch_size, 100 by default), not a thousand.
CREATE FUNCTION outbox.batch_members(
    prev pg_catalog.pg_snapshot, target pg_catalog.pg_snapshot,
    from_xid pg_catalog.xid8, from_id pg_catalog.uuid, to_xid pg_catalog.xid8, to_id pg_catalog.uuid
) RETURNS TABLE (id pg_catalog.uuid, pending_xid pg_catalog.xid8)
LANGUAGE sql STABLE SECURITY DEFINER ROWS 100
SET search_path = pg_catalog, pg_temp
AS $$
SELECT m.id, m.pending_xid
  FROM ((SELECT e.id, e.pending_xid
           FROM pg_catalog.pg_snapshot_xip(prev) AS b(xid)
          CROSS JOIN LATERAL (
                SELECT e.id, e.pending_xid
                  FROM outbox.log AS e
                 WHERE e.status OPERATOR(pg_catalog.=) 'pending'
                   AND e.key_state IS DISTINCT FROM 'waiting'
                   AND e.pending_xid OPERATOR(pg_catalog.=) b.xid
                   AND (e.pending_xid, e.id) OPERATOR(pg_catalog.>)
                       (coalesce(from_xid, '0'::pg_catalog.xid8),
                        coalesce(from_id, '00000000-0000-0000-0000-000000000000'::pg_catalog.uuid))
                   AND (e.pending_xid, e.id) OPERATOR(pg_catalog.<=) (to_xid, to_id)) AS e
          WHERE pg_catalog.pg_visible_in_snapshot(b.xid, target))
        UNION ALL
        (SELECT e.id, e.pending_xid
           FROM outbox.log AS e
          WHERE e.status OPERATOR(pg_catalog.=) 'pending'
            AND e.key_state IS DISTINCT FROM 'waiting'
            -- After the batch's first position and `prev`'s xmax, in one
            -- bound the index starts from.
            AND (e.pending_xid, e.id) OPERATOR(pg_catalog.>)
                (CASE WHEN from_xid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(prev) THEN from_xid
                      ELSE outbox.xid_before(pg_catalog.pg_snapshot_xmax(prev)) END,
                 CASE WHEN from_xid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(prev) THEN from_id
                      ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::pg_catalog.uuid END)
            AND (e.pending_xid, e.id) OPERATOR(pg_catalog.<=) (to_xid, to_id)
            AND pg_catalog.pg_visible_in_snapshot(e.pending_xid, target))) AS m
 -- A batch's, or nothing: run as its owner, it must not list the events of
 -- any window a caller makes up.
 WHERE EXISTS (SELECT FROM outbox.batches AS b
                WHERE b.to_xid = batch_members.to_xid
                  AND b.to_id = batch_members.to_id
                  AND b.prev::text = batch_members.prev::text
                  AND b.target::text = batch_members.target::text
                  AND b.from_xid IS NOT DISTINCT FROM batch_members.from_xid
                  AND b.from_id IS NOT DISTINCT FROM batch_members.from_id)
$$;

-- What the message of event `event` carries in a batch whose send is
-- `send` (its outbox_send header), and what a report of it must name: a
-- digest of the two, so that a worker that saw one message of a batch
-- learns nothing of its other events' (it could report them otherwise).
-- Immutable throughout, so that the claim inlines it (a call per event
-- through the SQL function manager cost a fifth of a drain).
CREATE FUNCTION outbox.send_of(send uuid, event uuid) RETURNS uuid
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
RETURN pg_catalog.encode(
    pg_catalog.substr(pg_catalog.sha256(
        pg_catalog.uuid_send(send) OPERATOR(pg_catalog.||) pg_catalog.uuid_send(event)), 1, 16),
    'hex')::pg_catalog.uuid;

-- The batch that read an event in line at ($1, $2): the page of the
-- window that holds its position. NULL: none yet (or out of line). An
-- abandoned batch (its events went back in line, but those with an
-- outcome) only with $3: what became of the event at that position.
CREATE FUNCTION outbox.batch_of(pending_xid xid8, id uuid, abandoned boolean DEFAULT false) RETURNS bigint
LANGUAGE sql STABLE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT b.id
  FROM outbox.batches AS b
 WHERE (b.to_xid, b.to_id) OPERATOR(pg_catalog.>=) ($1, $2)
   AND pg_catalog.pg_visible_in_snapshot($1, b.target)
   AND NOT pg_catalog.pg_visible_in_snapshot($1, b.prev)
   AND ((b.from_xid, b.from_id) OPERATOR(pg_catalog.<) ($1, $2)) IS NOT FALSE
   AND ($3 OR b.abandoned_at IS NULL)
 ORDER BY b.to_xid, b.to_id
 LIMIT 1
$$;

-- What an event is now, from what was written of it ($1, the row's status)
-- and its batch: a stored status other than pending is what it is, and an
-- event waiting for its key is pending; one reported processed or
-- acknowledged is processed; else, out of line or in no batch, pending;
-- in a batch not marked, processing; in one marked, dispatched.
CREATE FUNCTION outbox.event_status(status outbox.event_status, pending_xid xid8, id uuid, key_state text)
RETURNS outbox.event_status
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT CASE
         WHEN $1 OPERATOR(pg_catalog.<>) 'pending' OR $4 IS NOT DISTINCT FROM 'waiting' THEN $1
         ELSE coalesce((SELECT CASE WHEN EXISTS (SELECT FROM outbox.outcomes AS o
                                                 WHERE o.batch OPERATOR(pg_catalog.=) b.id
                                                   AND $3 OPERATOR(pg_catalog.=) ANY (o.events)) THEN 'processed'
                                    WHEN b.abandoned_at IS NOT NULL THEN 'pending'
                                    WHEN b.marked_at IS NULL THEN 'processing'
                                    ELSE 'dispatched' END::outbox.event_status
                          FROM outbox.batches AS b
                         WHERE b.id OPERATOR(pg_catalog.=) outbox.batch_of($2, $3, true)),
                       'pending')
       END
$$;

-- The rows, as the batches will tell them. No trigger fires on them: a
-- converted row keeps its key's turn, and says itself where it stands
-- (events_pending_again is made again below, ENABLE ALWAYS).
SET LOCAL session_replication_role = replica;
ALTER TABLE outbox.log DISABLE TRIGGER events_pending_again;
-- Out of line is a NULL pending_xid.
ALTER TABLE outbox.log ALTER COLUMN pending_xid DROP NOT NULL;

-- Claimed events go back (they may have been sent: their keys' next wait
-- for them all the same), and every event pending goes out of line: the
-- dispatchers put each back in line as it falls due (its key's turn
-- first), with a transaction id the claims read.
UPDATE outbox.log AS e
   SET status = 'pending',
       pending_xid = NULL
 WHERE e.status OPERATOR(pg_catalog.=) 'processing'
    OR e.status OPERATOR(pg_catalog.=) 'pending';

-- Events sent (dispatched or processed, not the records of routed events)
-- make marked batches of 10,000 (retention and the unacknowledged sweeper
-- take a few batches per statement): transaction id 2 (frozen: before
-- every window) marks them, and the batches' window is that id alone.
-- Their dispatcher is -1: their messages carry the sends 0.9.0 drew per
-- event, and a report for one names the event alone
-- (sql/worker/apply_reports.sql).
-- processed_at says which were processed (outcomes, below).
UPDATE outbox.log AS e
   SET status = 'pending',
       pending_xid = '2',
       deliveries = GREATEST(e.deliveries OPERATOR(pg_catalog.-) 1, 0),
       processed_at = CASE WHEN e.status OPERATOR(pg_catalog.=) 'processed'
                           THEN coalesce(e.processed_at, pg_catalog.now()) END
 WHERE e.status OPERATOR(pg_catalog.=) 'dispatched'
    OR (e.status OPERATOR(pg_catalog.=) 'processed' AND coalesce(e.routed_to, 0) OPERATOR(pg_catalog.=) 0);

INSERT INTO outbox.batches (send, dispatcher, claimed_at, prev, target, from_xid, from_id, to_xid, to_id, events,
                            marked_at)
SELECT pg_catalog.gen_random_uuid(), -1, g.at, '2:2:', '2:3:',
       CASE WHEN g.from_id IS NOT NULL THEN '2'::pg_catalog.xid8 END, g.from_id, '2', g.to_id, g.events, g.at
  FROM (SELECT pg_catalog.lag(l.id) OVER (ORDER BY l.n) AS from_id, l.id AS to_id, l.events, l.at
          FROM (SELECT r.n, r.id, pg_catalog.count(*) OVER w AS events,
                       coalesce(pg_catalog.max(r.at) OVER w, pg_catalog.now()) AS at,
                       r.rn OPERATOR(pg_catalog.=) pg_catalog.max(r.rn) OVER w AS last
                  FROM (SELECT e.id, coalesce(e.dispatched_at, e.processed_at) AS at,
                               pg_catalog.row_number() OVER (ORDER BY e.id) AS rn,
                               (pg_catalog.row_number() OVER (ORDER BY e.id) OPERATOR(pg_catalog.-) 1)
                               OPERATOR(pg_catalog./) 10000 AS n
                          FROM outbox.log AS e
                         WHERE e.pending_xid OPERATOR(pg_catalog.=) '2') AS r
                WINDOW w AS (PARTITION BY r.n)) AS l
         WHERE l.last) AS g;

-- Events reported processed or acknowledged keep that as outcomes, in the
-- batches just made, each with its time (the rows go to the first
-- generation, below). A batch at a time: the arrays of every event at once
-- could outgrow what a value may hold.
SELECT pg_catalog.count(*)
  FROM (SELECT outbox.record_outcomes(pg_catalog.array_agg(g.batch), pg_catalog.array_agg(0::pg_catalog.int2),
                                      pg_catalog.array_agg(g.id), pg_catalog.array_agg(g.processed_at))
          FROM (SELECT outbox.batch_of(e.pending_xid, e.id, true) AS batch, e.id, e.processed_at
                  FROM outbox.log AS e
                 WHERE e.pending_xid OPERATOR(pg_catalog.=) '2'
                   AND e.processed_at IS NOT NULL) AS g
         GROUP BY g.batch) AS r;

SET LOCAL session_replication_role = origin;

-- The claims start here: whatever this transaction goes on to enqueue is
-- read once it commits.
INSERT INTO outbox.positions (prev) VALUES (outbox.starting_snapshot());

-- outbox.log becomes a table partitioned by generation, as a fresh
-- install makes it, and the rows converted above are copied to its first
-- partition (written once more, as the updates above wrote most of them).
-- What was written per row (processing_started_at, dispatched_at,
-- processed_at, claimed_by, send_id) is not copied: a batch says it now.
-- What roles were granted on the table, its row-level security and
-- its publications are carried to the new one; indexes and triggers
-- someone else added to it are not, and a warning names each.
ALTER TABLE outbox.log RENAME TO log_0_9_0;

CREATE TABLE outbox.log (
    id                    uuid NOT NULL,  -- default: outbox_uuid_v7(), set in api.sql; unique per partition
    event_type            text NOT NULL
                          CONSTRAINT events_event_type_length CHECK (octet_length(event_type) BETWEEN 1 AND 255),
    payload               jsonb NOT NULL DEFAULT '{}',
    queue                 text NOT NULL DEFAULT coalesce(current_setting('outbox.default_queue', true), 'celery')
                          CONSTRAINT events_queue_length CHECK (octet_length(queue) BETWEEN 1 AND 255),
    task                  text  -- NULL: the task is named like the event_type
                          CONSTRAINT events_task_length CHECK (octet_length(task) BETWEEN 1 AND 255),
    headers               jsonb
                          CONSTRAINT events_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    priority              smallint NOT NULL DEFAULT 0
                          CONSTRAINT events_priority_range CHECK (priority BETWEEN 0 AND 9),
    -- What was written of the event, not what it is now: 'pending' (in
    -- line, or sent: its batch says, see outbox.events), 'failed' (a dead
    -- letter), 'processed' (the record of a routed event).
    status                outbox.event_status NOT NULL DEFAULT 'pending',
    retry_count           integer NOT NULL DEFAULT 0,
    created_at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_error            text,
    -- Columns are in the order in which they came (updates add theirs at
    -- the end): an updated database has the same table as a fresh one.
    args                  jsonb  -- positional arguments; the payload (an object) is then the keyword ones
                          CONSTRAINT events_args_array CHECK (jsonb_typeof(args) = 'array'),
    expires_at            timestamptz,  -- not sent after this (Celery's expires)
    -- Subscriptions (sql/subscriptions.sql). A routed event is the record of
    -- an event without a task that matched subscriptions: it is processed at
    -- once, and its deliveries, one row each, carry the work.
    event_id              uuid,     -- on a delivery: the event it delivers
    subscription_id       bigint,   -- on a delivery or a batch: its subscription
    routed_to             integer,  -- on an event without a task: subscriptions it went to (0: none)
    deliveries            integer NOT NULL DEFAULT 0,  -- sends before the one its batch says
    -- The transaction that put the row in line (inserted it, or set it
    -- pending again): where the claim reads it (outbox.cursor). NULL: out
    -- of line until available_at.
    pending_xid           xid8 DEFAULT pg_current_xact_id(),
    -- Per-key order (README, "Per-key order"): events of one ordering_key
    -- (per subscription, for deliveries) are sent one at a time, in the
    -- order their transactions committed, which key_seq records. The head
    -- (key_state 'head') holds its key until it is finished; the events
    -- behind it wait (key_state 'waiting') and are claimed by nobody.
    -- key_state is NULL for events without a key and once a head let go.
    ordering_key          text
                          CONSTRAINT events_ordering_key_length CHECK (octet_length(ordering_key) BETWEEN 1 AND 255),
    key_seq               bigint,
    key_state             text
                          CONSTRAINT events_key_state
                              CHECK (key_state IS NULL OR (key_state IN ('head', 'waiting') AND ordering_key IS NOT NULL)),
    generation            smallint NOT NULL
                          DEFAULT pg_catalog.pg_sequence_last_value('outbox.generation'::pg_catalog.regclass)::smallint,
    CONSTRAINT events_args_with_kwargs CHECK (args IS NULL OR jsonb_typeof(payload) = 'object')
)
PARTITION BY LIST (generation);

-- One partition per generation, each with its own primary key (one on the
-- partitioned table would have to hold `generation`). Rows are inserted,
-- and only exceptional ones updated; vacuum and analyze each after a small
-- fraction of changes rather than the default 20%, so the statistics follow
-- a partition that fills from empty. (The indexes of each are named after
-- it, below.)
DO $$
BEGIN
    FOR generation IN 0..2 LOOP
        EXECUTE pg_catalog.format(
            'CREATE TABLE outbox.log_%1$s PARTITION OF outbox.log'
            ' (CONSTRAINT log_%1$s_pkey PRIMARY KEY (id)) FOR VALUES IN (%1$s)'
            ' WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,'
            ' autovacuum_vacuum_insert_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.02,'
            ' autovacuum_vacuum_cost_delay = 1)', generation);
    END LOOP;
END
$$;

COMMENT ON TABLE outbox.log IS
    'Outbox events as they were written; read and write them through the view outbox.events.';

INSERT INTO outbox.log (id, event_type, payload, queue, task, headers, priority, status, retry_count, created_at,
                        available_at, last_error, args, expires_at, event_id, subscription_id, routed_to,
                        deliveries, pending_xid, ordering_key, key_seq, key_state)
SELECT id, event_type, payload, queue, task, headers, priority, status, retry_count, created_at,
       available_at, last_error, args, expires_at, event_id, subscription_id, routed_to,
       deliveries, pending_xid, ordering_key, key_seq, key_state
  FROM outbox.log_0_9_0;

ALTER TABLE outbox.log ALTER COLUMN id SET DEFAULT @extschema@.outbox_uuid_v7();
ALTER TABLE outbox.log ALTER COLUMN routed_to SET DEFAULT @extschema@.outbox_routed_to_default();

-- What roles were granted on the table and its columns, its row-level
-- security and policies (their expressions as the catalog keeps them, names
-- qualified), and the publications that named it.
DO $$
DECLARE
    old CONSTANT pg_catalog.oid := 'outbox.log_0_9_0'::pg_catalog.regclass;
    item record;
BEGIN
    FOR item IN
        SELECT a.privilege_type, a.is_grantable, c.attname,
               CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                    ELSE a.grantee::pg_catalog.regrole::pg_catalog.text END AS grantee
          FROM (SELECT r.relacl AS acl, NULL::pg_catalog.name AS attname, r.relowner
                  FROM pg_catalog.pg_class AS r WHERE r.oid OPERATOR(pg_catalog.=) old
                UNION ALL
                SELECT t.attacl, t.attname, r.relowner
                  FROM pg_catalog.pg_attribute AS t
                  JOIN pg_catalog.pg_class AS r ON r.oid OPERATOR(pg_catalog.=) t.attrelid
                 WHERE t.attrelid OPERATOR(pg_catalog.=) old AND t.attacl IS NOT NULL AND NOT t.attisdropped
                   AND t.attnum OPERATOR(pg_catalog.>) 0) AS c
         CROSS JOIN LATERAL pg_catalog.aclexplode(c.acl) AS a
         WHERE a.grantee OPERATOR(pg_catalog.<>) c.relowner
    LOOP
        EXECUTE pg_catalog.format('GRANT %s%s ON outbox.log TO %s%s', item.privilege_type,
                                  CASE WHEN item.attname IS NOT NULL
                                       THEN pg_catalog.format(' (%I)', item.attname) ELSE '' END,
                                  item.grantee,
                                  CASE WHEN item.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    IF (SELECT r.relrowsecurity FROM pg_catalog.pg_class AS r WHERE r.oid OPERATOR(pg_catalog.=) old) THEN
        ALTER TABLE outbox.log ENABLE ROW LEVEL SECURITY;
    END IF;
    IF (SELECT r.relforcerowsecurity FROM pg_catalog.pg_class AS r WHERE r.oid OPERATOR(pg_catalog.=) old) THEN
        ALTER TABLE outbox.log FORCE ROW LEVEL SECURITY;
    END IF;
    FOR item IN
        SELECT p.polname, p.polpermissive, p.polcmd,
               pg_catalog.pg_get_expr(p.polqual, old) AS qual,
               pg_catalog.pg_get_expr(p.polwithcheck, old) AS with_check,
               (SELECT pg_catalog.string_agg(CASE WHEN r.role OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                                  ELSE r.role::pg_catalog.regrole::pg_catalog.text END, ', ')
                  FROM pg_catalog.unnest(p.polroles) AS r(role)) AS roles
          FROM pg_catalog.pg_policy AS p
         WHERE p.polrelid OPERATOR(pg_catalog.=) old
    LOOP
        EXECUTE pg_catalog.format('CREATE POLICY %I ON outbox.log AS %s FOR %s TO %s%s%s', item.polname,
                                  CASE WHEN item.polpermissive THEN 'PERMISSIVE' ELSE 'RESTRICTIVE' END,
                                  CASE item.polcmd WHEN 'r' THEN 'SELECT' WHEN 'a' THEN 'INSERT'
                                                   WHEN 'w' THEN 'UPDATE' WHEN 'd' THEN 'DELETE' ELSE 'ALL' END,
                                  item.roles,
                                  CASE WHEN item.qual IS NOT NULL
                                       THEN pg_catalog.format(' USING (%s)', item.qual) ELSE '' END,
                                  CASE WHEN item.with_check IS NOT NULL
                                       THEN pg_catalog.format(' WITH CHECK (%s)', item.with_check) ELSE '' END);
    END LOOP;
    -- A publication that names a partitioned table publishes its
    -- partitions' changes under their own names unless
    -- publish_via_partition_root: it names the partitions then (they alone
    -- may carry a row filter and a column list), else the table.
    FOR item IN
        SELECT b.pubname, t.relid::pg_catalog.regclass AS member,
               (SELECT pg_catalog.string_agg(pg_catalog.quote_ident(t.attname), ', ' ORDER BY k.n)
                  FROM pg_catalog.unnest(r.prattrs) WITH ORDINALITY AS k(attnum, n)
                  JOIN pg_catalog.pg_attribute AS t
                    ON t.attrelid OPERATOR(pg_catalog.=) old AND t.attnum OPERATOR(pg_catalog.=) k.attnum) AS columns,
               pg_catalog.pg_get_expr(r.prqual, old) AS row_filter
          FROM pg_catalog.pg_publication_rel AS r
          JOIN pg_catalog.pg_publication AS b ON b.oid OPERATOR(pg_catalog.=) r.prpubid
          JOIN pg_catalog.pg_partition_tree('outbox.log'::pg_catalog.regclass) AS t
            ON t.isleaf OPERATOR(pg_catalog.<>) b.pubviaroot AND t.level OPERATOR(pg_catalog.<=) 1
         WHERE r.prrelid OPERATOR(pg_catalog.=) old
    LOOP
        EXECUTE pg_catalog.format('ALTER PUBLICATION %I ADD TABLE %s%s%s', item.pubname, item.member,
                                  CASE WHEN item.columns IS NOT NULL
                                       THEN pg_catalog.format(' (%s)', item.columns) ELSE '' END,
                                  CASE WHEN item.row_filter IS NOT NULL
                                       THEN pg_catalog.format(' WHERE (%s)', item.row_filter) ELSE '' END);
    END LOOP;
    FOR item IN
        SELECT 'index' AS kind, i.indexrelid::pg_catalog.regclass::pg_catalog.text AS name,
               pg_catalog.pg_get_indexdef(i.indexrelid) AS definition
          FROM pg_catalog.pg_index AS i
         WHERE i.indrelid OPERATOR(pg_catalog.=) old
           AND NOT EXISTS (SELECT FROM pg_catalog.pg_depend AS d
                            WHERE d.classid OPERATOR(pg_catalog.=) 'pg_catalog.pg_class'::pg_catalog.regclass
                              AND d.objid OPERATOR(pg_catalog.=) i.indexrelid
                              AND d.deptype OPERATOR(pg_catalog.=) 'i')
           AND pg_catalog.split_part(i.indexrelid::pg_catalog.regclass::pg_catalog.text, '.', 2)
               OPERATOR(pg_catalog.<>) ALL (ARRAY['events_pending_xid_idx', 'events_failed_idx',
                                                  'events_key_idx', 'events_key_state_idx', 'events_key_head_idx',
                                                  'events_event_id_idx', 'events_pending_idx', 'events_processing_idx',
                                                  'events_dispatched_idx', 'events_processed_idx'])
        UNION ALL
        SELECT 'trigger', t.tgname, pg_catalog.pg_get_triggerdef(t.oid)
          FROM pg_catalog.pg_trigger AS t
         WHERE t.tgrelid OPERATOR(pg_catalog.=) old
           AND NOT t.tgisinternal
           AND t.tgname OPERATOR(pg_catalog.<>) ALL (ARRAY['events_wake_dispatchers', 'events_take_turn',
                                                           'events_take_turn_again', 'events_route',
                                                           'events_pending_again'])
    LOOP
        RAISE WARNING 'the % % of outbox.events is not carried to outbox.log: %', item.kind, item.name,
            item.definition
            USING HINT = 'Make it again on outbox.log (a partitioned table: an index is made on each partition).';
    END LOOP;
END
$$;

-- Dead letters, of the new table (the view read the old one).
CREATE OR REPLACE VIEW outbox.dead_letters AS
SELECT id, event_type, queue, coalesce(task, event_type) AS task, payload, headers,
       retry_count, last_error, created_at,
       deliveries + (outbox.batch_of(pending_xid, id) IS NOT NULL)::integer AS deliveries,
       args, event_id, subscription_id,
       ordering_key, key_state IS NOT DISTINCT FROM 'head' AS holds_key
  FROM outbox.log
 WHERE status = 'failed';

-- Out of the extension first: that also takes it out of what pg_dump
-- keeps (a dropped member would stay there, a number naming nothing).
ALTER EXTENSION outbox_dispatch DROP TABLE outbox.log_0_9_0;
DROP TABLE outbox.log_0_9_0;

-- The claim (sql/worker/claim.sql) reads the events in line by the
-- transaction that put them there and their id, window after window
-- (outbox.cursor); an event waiting for its key's turn is not in it:
-- however many wait behind blocked keys, the claim never reads them.
CREATE INDEX events_pending_xid_idx ON outbox.log (pending_xid, id)
    WHERE status = 'pending' AND key_state IS DISTINCT FROM 'waiting';
-- Events out of line until they fall due (pending_xid NULL: delayed, or
-- backing off after a failed push), by when; the came-due sweep puts them
-- in line (sql/worker/came_due.sql).
CREATE INDEX events_due_idx ON outbox.log (available_at, id)
    WHERE pending_xid IS NULL AND status = 'pending' AND key_state IS DISTINCT FROM 'waiting';
-- Dead letters.
CREATE INDEX events_failed_idx ON outbox.log (created_at) WHERE status = 'failed';
-- Records of routed events, and events acknowledged while out of a batch:
-- retention.
CREATE INDEX events_recorded_idx ON outbox.log (created_at) WHERE status = 'processed';

-- Per-key order. The events of a key in key_seq order (those that took a
-- turn: an event routed to subscriptions, a record, took none): its newest
-- says whether the key is taken (outbox_key_taken()), and the one after a
-- head is the next to take it; both are the first entry a scan reads,
-- however many finished events of the key are left behind.
-- Unique: two rows of a key never share a turn. (A unique index of a
-- partitioned table holds its partition key: `generation` comes last, so
-- the order is the key's; a row moved to a newer generation is deleted
-- from its old one in the same transaction.)
CREATE UNIQUE INDEX events_key_idx ON outbox.log (ordering_key, (coalesce(subscription_id, 0)), key_seq, generation)
    WHERE key_seq IS NOT NULL;
-- Heads and waiting events, by key: outbox.blocked_keys, the metrics, and
-- the dispatchers' sweep for keys left without a head.
CREATE INDEX events_key_state_idx ON outbox.log (key_state, ordering_key, (coalesce(subscription_id, 0)), key_seq)
    WHERE key_state IS NOT NULL;
-- One head per key, whatever writes the row: a second head would be sent
-- beside the first. (An insert that copies a head takes a turn of its own,
-- outbox_take_turn() in sql/keys.sql; an UPDATE that would make a second
-- head fails here.)
CREATE UNIQUE INDEX events_key_head_idx ON outbox.log (ordering_key, (coalesce(subscription_id, 0)), generation)
    WHERE key_state = 'head';
-- The deliveries of one event.
CREATE INDEX events_event_id_idx ON outbox.log (event_id) WHERE event_id IS NOT NULL;

-- Each partition's indexes are named as the partitioned index they belong
-- to, the partition's name for `events`: log_0_pending_xid_idx is
-- events_pending_xid_idx in log_0.
DO $$
DECLARE
    index_ record;
BEGIN
    FOR index_ IN
        SELECT i.inhrelid::pg_catalog.regclass AS partition_index,
               pg_catalog.replace(p.relname, 'events_', t.relname OPERATOR(pg_catalog.||) '_') AS name
          FROM pg_catalog.pg_inherits AS i
          JOIN pg_catalog.pg_class AS p ON p.oid OPERATOR(pg_catalog.=) i.inhparent
          JOIN pg_catalog.pg_index AS x ON x.indexrelid OPERATOR(pg_catalog.=) i.inhrelid
          JOIN pg_catalog.pg_class AS t ON t.oid OPERATOR(pg_catalog.=) x.indrelid
         WHERE p.relkind OPERATOR(pg_catalog.=) 'I'
           AND t.relnamespace OPERATOR(pg_catalog.=) 'outbox'::pg_catalog.regnamespace
           AND t.relname OPERATOR(pg_catalog.~) '^log_[0-9]+$'
           AND (SELECT c.relname FROM pg_catalog.pg_class AS c WHERE c.oid OPERATOR(pg_catalog.=) i.inhrelid)
               OPERATOR(pg_catalog.<>) pg_catalog.replace(p.relname, 'events_', t.relname OPERATOR(pg_catalog.||) '_')
    LOOP
        EXECUTE pg_catalog.format('ALTER INDEX %s RENAME TO %I', index_.partition_index, index_.name);
    END LOOP;
END
$$;

CREATE TRIGGER events_wake_dispatchers
    BEFORE INSERT ON outbox.log
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.outbox_events_inserted();
CREATE TRIGGER events_take_turn
    BEFORE INSERT ON outbox.log
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending'
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_take_turn();
CREATE TRIGGER events_route
    BEFORE INSERT ON outbox.log
    FOR EACH ROW WHEN (NEW.task IS NULL AND NEW.routed_to IS NULL
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_route();


-- An insert or an update that makes an event pending (a retry, a release,
-- a sweep, a DBA's UPDATE, its key's turn come) or moves when it falls due
-- puts it in line as if that statement's transaction had enqueued it, or
-- out of line until it falls due; so does an insert that names another
-- transaction (a restored dump, a copy). An insert with the defaults, due
-- now, does not call it: the WHEN is evaluated without a function call.
-- Nor does an event the rotation moves to the current generation (it
-- keeps its place: outbox.moving, sql/rotation.sql), nor, for the same
-- reason, the triggers that take a key's turn and route an event.
CREATE OR REPLACE FUNCTION @extschema@.outbox_pending_again() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF NEW.available_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() THEN
        NEW.pending_xid := NULL;
    ELSE
        NEW.pending_xid := pg_catalog.pg_current_xact_id();
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER events_pending_again
    BEFORE INSERT OR UPDATE OF status, available_at, pending_xid ON outbox.log
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       AND (NEW.pending_xid IS DISTINCT FROM pg_catalog.pg_current_xact_id()
                            OR NEW.available_at > pg_catalog.clock_timestamp())
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- Also where triggers are off for replication (a logical replication
-- subscriber applying the rows of another server's history).
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again;

-- An event with a key takes its turn as it is inserted, by
-- outbox_enqueue() or an ORM's INSERT, or as outbox_retry() sends it again
-- after its key went on without it. It takes its key's lock, an advisory
-- lock held to its commit: producers of one key commit one after the other,
-- so key_seq, taken under the lock, is their commit order. It becomes the
-- head when no event of the key is unfinished, or waits behind them.
-- A row inserted with a turn of its own (key_seq and key_state set, as a
-- restore's rows are) keeps it when it fits the key (outbox_turn_fits():
-- in whatever order a restore's rows come); one that does not (a copy of
-- another row, into its key or another) takes a new one. A key never has
-- two heads, nor two rows of one key_seq (events_key_head_idx and
-- events_key_idx say so too).
-- (The lock is the one the dispatchers try, src/keys.rs and
-- sql/keys/lock.sql, before they pass a key on.) SECURITY DEFINER: writers
-- need no rights on the sequence, nor to read outbox.events; every name
-- is qualified, as in outbox_route().
CREATE OR REPLACE FUNCTION @extschema@.outbox_take_turn() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
BEGIN
    PERFORM pg_catalog.pg_advisory_xact_lock(
        pg_catalog.hashtextextended(NEW.ordering_key, coalesce(NEW.subscription_id, 0)));
    IF NEW.key_seq IS NOT NULL AND NEW.key_state IS NOT NULL
       AND @extschema@.outbox_turn_fits(NEW.ordering_key, coalesce(NEW.subscription_id, 0),
                                        NEW.key_seq, NEW.key_state) THEN
        RETURN NEW;
    END IF;
    NEW.key_seq := pg_catalog.nextval('outbox.key_seq'::pg_catalog.regclass);
    NEW.key_state := CASE WHEN @extschema@.outbox_key_taken(NEW.ordering_key, coalesce(NEW.subscription_id, 0))
                          THEN 'waiting' ELSE 'head' END;
    -- Out of line while it waits: its turn coming puts it in line.
    IF NEW.key_state OPERATOR(pg_catalog.=) 'waiting' THEN
        NEW.pending_xid := NULL;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER events_take_turn_again
    BEFORE UPDATE OF status, ordering_key, key_seq, key_state ON outbox.log
    FOR EACH ROW WHEN (NEW.ordering_key IS NOT NULL AND NEW.status = 'pending'
                       AND (NEW.key_seq IS NULL
                            OR (NEW.key_state IS NULL
                                AND (OLD.status <> 'pending' OR OLD.ordering_key IS DISTINCT FROM NEW.ordering_key))))
    EXECUTE FUNCTION @extschema@.outbox_take_turn();

-- Keys whose head is not about to be sent: in flight, waiting for its
-- backoff or its delay, or dead-lettered (since: when its batch claimed it
-- or was marked, else when it became due); then keys with events waiting
-- and no head (head NULL, since: when the first fell due), which the
-- dispatchers pass on within seconds. Served by events_key_state_idx.
CREATE VIEW outbox.blocked_keys AS
SELECT h.ordering_key, h.subscription_id, h.id AS head, h.status,
       CASE h.status
           WHEN 'processing' THEN (SELECT b.claimed_at FROM outbox.batches AS b WHERE b.id = h.batch)
           WHEN 'dispatched' THEN (SELECT b.marked_at FROM outbox.batches AS b WHERE b.id = h.batch)
           ELSE h.available_at
       END AS since,
       h.last_error,
       (SELECT pg_catalog.count(*)
          FROM outbox.log AS w
         WHERE w.key_state = 'waiting'
           AND w.ordering_key = h.ordering_key
           AND coalesce(w.subscription_id, 0) = coalesce(h.subscription_id, 0)) AS waiting
  FROM (SELECT e.id, e.ordering_key, e.subscription_id, e.available_at, e.last_error,
               outbox.event_status(e.status, e.pending_xid, e.id, e.key_state) AS status,
               outbox.batch_of(e.pending_xid, e.id) AS batch
          FROM outbox.log AS e
         WHERE e.key_state = 'head') AS h
 WHERE NOT (h.status = 'pending' AND h.available_at <= pg_catalog.now())
UNION ALL
SELECT w.ordering_key, w.subscription_id, NULL, NULL, pg_catalog.min(w.available_at), NULL, pg_catalog.count(*)
  FROM outbox.log AS w
 WHERE w.key_state = 'waiting'
   AND NOT EXISTS (SELECT FROM outbox.log AS h
                    WHERE h.key_state = 'head'
                      AND h.ordering_key = w.ordering_key
                      AND coalesce(h.subscription_id, 0) = coalesce(w.subscription_id, 0))
 GROUP BY w.ordering_key, w.subscription_id;

COMMENT ON VIEW outbox.blocked_keys IS
    'Keys whose head (the one event of the key that may be sent) is in flight, not yet due, or dead-lettered, with the events waiting behind it; then keys with events waiting and no head (head NULL). A failed head holds its key until outbox_retry() or outbox_skip() (outbox.key_on_failure = block).';

-- The name applications, ORMs and DBAs use. A view of one table, so
-- PostgreSQL updates it by itself: an INSERT (RETURNING included), UPDATE
-- or DELETE through it is one on outbox.log, with the table's defaults,
-- constraints and triggers (its statement triggers too), except `status`,
-- `batch` and `deliveries`, which say what became of the event and are
-- read only. It acts as its caller (security_invoker): a role needs the
-- privilege on both, and the table's row-level security applies to it as
-- to a statement on the table.
CREATE VIEW outbox.events WITH (security_invoker = true) AS
SELECT l.id, l.event_type, l.payload, l.queue, l.task, l.headers, l.priority,
       outbox.event_status(l.status, l.pending_xid, l.id, l.key_state) AS status,
       l.retry_count, l.created_at, l.available_at, l.last_error, l.args, l.expires_at, l.event_id,
       l.subscription_id, l.routed_to,
       l.deliveries OPERATOR(pg_catalog.+) (outbox.batch_of(l.pending_xid, l.id) IS NOT NULL)::integer AS deliveries,
       l.pending_xid, l.ordering_key, l.key_seq, l.key_state,
       outbox.batch_of(l.pending_xid, l.id) AS batch
  FROM outbox.log AS l;

COMMENT ON VIEW outbox.events IS
    'Outbox events. Insert with outbox_enqueue() or a plain INSERT; committed rows are dispatched.';

-- (One call per statement: each rewrites the extension's catalog row.)
DO $$
DECLARE
    partition_ pg_catalog.regclass;
BEGIN
    FOR partition_ IN SELECT p.relid FROM pg_catalog.pg_partition_tree('outbox.log') AS p WHERE p.isleaf LOOP
        PERFORM pg_catalog.pg_extension_config_dump(partition_,
            'WHERE status OPERATOR(pg_catalog.<>) ''pending'' '
            'OR outbox.event_status(status, pending_xid, id, key_state) OPERATOR(pg_catalog.=) '
            'ANY (ARRAY[''pending'', ''processing'']::outbox.event_status[]) '
            'OR (coalesce(pg_catalog.current_setting(''outbox.ack_timeout'', true), '''') OPERATOR(pg_catalog.<>) ''0'' '
            'AND outbox.event_status(status, pending_xid, id, key_state) OPERATOR(pg_catalog.=) '
            '''dispatched''::outbox.event_status)');
    END LOOP;
END
$$;

-- The events outbox.outcomes holds, estimated from the statistics: the
-- rows each partition has, each holding as many events as the average
-- width of `events` the last analyze found says (an array of n ids is
-- about 22 + 16n bytes). Read through pg_stats as the owner (SECURITY
-- DEFINER): pg_statistic itself is a superuser's, and the owner is none
-- where the library cannot be loaded (docs/managed.md).
CREATE FUNCTION outbox.outcome_events_estimate() RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT sum(GREATEST(c.reltuples, 0) * GREATEST(coalesce(s.avg_width, 38) - 22, 16) / 16)::bigint
  FROM pg_partition_tree('outbox.outcomes'::regclass) AS p
  JOIN pg_class AS c ON c.oid = p.relid
  LEFT JOIN pg_stats AS s
         ON s.schemaname = 'outbox' AND s.tablename = c.relname AND s.attname = 'events' AND NOT s.inherited
 WHERE p.isleaf
$$;

-- One row per status, zero counts included, at a cost that does not grow
-- with history. Pending events (in line beyond where the claims have read,
-- and out of line until they fall due), processing ones (the batches not
-- marked) and failed ones are counted exactly, each through a small index.
-- Dispatched and processed, which grow with outbox.retention, are counted
-- exactly while at most 1000 batches are marked and at most 1000 events
-- have an outcome, and beyond that estimated from the statistics of the
-- last vacuum or analyze (outbox.log's rows less the others), and say so.
-- (An outcome is truncated with its event's generation: outcomes are
-- counted without looking their events up.)
-- Events waiting for their key's turn are not pending here (outbox.blocked_keys
-- and the metrics count them).
CREATE VIEW outbox.status AS
WITH waiting AS (
    -- In line, not read yet. A window reads the transactions its prev saw
    -- in progress (behind), then those from prev's xmax on (fresh), each
    -- in (pending_xid, id) order, up to the cursor's position; what its
    -- target does not see, a later window reads. Each range starts where
    -- the unread rows of its transaction start: a large transaction the
    -- window has read is not walked again (500,000 buffers for a scrape
    -- over one of 200,000 events whose window was not closed yet).
    -- Behind: a transaction the target sees and the position passed is
    -- read; the one at the position, from there on; any other, whole.
    SELECT e.created_at, e.available_at
      FROM outbox.cursor AS c
     CROSS JOIN LATERAL pg_catalog.pg_snapshot_xip(c.prev) AS b(xid)
     CROSS JOIN LATERAL (
           SELECT coalesce(pg_catalog.pg_visible_in_snapshot(b.xid, c.target) AND b.xid = c.after_xid, false)
                      AS at_position,
                  coalesce(pg_catalog.pg_visible_in_snapshot(b.xid, c.target) AND b.xid < c.after_xid, false)
                      AS passed) AS r
      JOIN outbox.log AS e
        ON e.pending_xid = b.xid
       AND (e.pending_xid, e.id) > (b.xid, CASE WHEN r.at_position THEN c.after_id
                                                ELSE '00000000-0000-0000-0000-000000000000'::uuid END)
     WHERE NOT r.passed
       AND e.status = 'pending'
       AND e.key_state IS DISTINCT FROM 'waiting'
    UNION ALL
    -- Fresh, beyond the position (from prev's xmax while the window is
    -- still reading behind, or has not begun).
    SELECT e.created_at, e.available_at
      FROM outbox.cursor AS c
      JOIN outbox.log AS e
        ON (e.pending_xid, e.id)
           > (CASE WHEN c.target IS NOT NULL AND c.after_xid >= pg_catalog.pg_snapshot_xmax(c.prev) THEN c.after_xid
                   ELSE outbox.xid_before(pg_catalog.pg_snapshot_xmax(c.prev)) END,
              CASE WHEN c.target IS NOT NULL AND c.after_xid >= pg_catalog.pg_snapshot_xmax(c.prev) THEN c.after_id
                   ELSE 'ffffffff-ffff-ffff-ffff-ffffffffffff'::uuid END)
     WHERE e.status = 'pending'
       AND e.key_state IS DISTINCT FROM 'waiting'
    UNION ALL
    -- Fresh, before the position, of transactions the target does not see.
    SELECT e.created_at, e.available_at
      FROM outbox.cursor AS c
     CROSS JOIN LATERAL pg_catalog.pg_snapshot_xip(c.target) AS t(xid)
      JOIN outbox.log AS e ON e.pending_xid = t.xid
     WHERE t.xid >= pg_catalog.pg_snapshot_xmax(c.prev)
       AND t.xid < c.after_xid
       AND e.status = 'pending'
       AND e.key_state IS DISTINCT FROM 'waiting'
    UNION ALL
    -- Out of line until due.
    SELECT e.created_at, e.available_at
      FROM outbox.log AS e
     WHERE e.pending_xid IS NULL
       AND e.status = 'pending'
       AND e.key_state IS DISTINCT FROM 'waiting'
), exact AS (
    SELECT 'pending'::outbox.event_status AS status, pg_catalog.count(*) AS count,
           pg_catalog.min(w.created_at) AS oldest_created_at,
           coalesce(pg_catalog.now() - pg_catalog.min(w.available_at)
                        FILTER (WHERE w.available_at <= pg_catalog.now()),
                    interval '0') AS lag
      FROM waiting AS w
    UNION ALL
    SELECT 'processing', coalesce(pg_catalog.sum(b.events), 0)::bigint, NULL, NULL
      FROM outbox.batches AS b WHERE b.marked_at IS NULL AND b.abandoned_at IS NULL
    UNION ALL
    SELECT 'failed', pg_catalog.count(*), pg_catalog.min(e.created_at), NULL
      FROM outbox.log AS e WHERE e.status = 'failed'
), reported AS (
    -- The outcome rows as stored, with how many events they hold up to
    -- each (read as far as the first that takes them over 1000).
    SELECT o.events,
           pg_catalog.sum(pg_catalog.cardinality(o.events)) OVER (ROWS UNBOUNDED PRECEDING) AS events_so_far
      FROM outbox.outcomes AS o
), beyond AS (
    SELECT r.events_so_far FROM reported AS r WHERE r.events_so_far > 1000 LIMIT 1
), finished AS (
    -- Processed: the events of the outcome rows, exactly while they are at
    -- most 1000 (each once, though a row of a rotation's move may repeat
    -- one until its generation is truncated), plus those stored processed.
    SELECT (SELECT pg_catalog.count(*)
              FROM (SELECT FROM outbox.batches AS b WHERE b.marked_at IS NOT NULL LIMIT 1001) AS f) AS batches,
           coalesce((SELECT b.events_so_far FROM beyond AS b),
                    (SELECT pg_catalog.count(DISTINCT x.id)
                       FROM reported AS r CROSS JOIN LATERAL pg_catalog.unnest(r.events) AS x(id)))
           + (SELECT pg_catalog.count(*)
                FROM (SELECT FROM outbox.log AS e WHERE e.status = 'processed' LIMIT 1001) AS f) AS processed
), sent AS (
    -- Exact while small: the members of the marked batches without an
    -- outcome.
    SELECT pg_catalog.count(*) AS dispatched
      FROM outbox.batches AS b
     CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
     WHERE b.marked_at IS NOT NULL
       AND (SELECT f.batches FROM finished AS f) <= 1000
       -- The outcomes of those batches read once, into a hash
       -- (sql/worker/settle_reported.sql).
       AND (b.id, m.id) NOT IN (SELECT o.batch, r.id
                                  FROM outbox.outcomes AS o CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
                                 WHERE o.batch IN (SELECT b.id FROM outbox.batches AS b WHERE b.marked_at IS NOT NULL)
                                   AND r.id IS NOT NULL)
), estimate AS (
    -- Finished: outbox.log's rows less those counted; processed: those
    -- with an outcome (outbox.outcome_events_estimate()).
    SELECT GREATEST((SELECT pg_catalog.sum(GREATEST(c.reltuples, 0))::bigint
                       FROM pg_catalog.pg_partition_tree('outbox.log'::pg_catalog.regclass) AS p
                       JOIN pg_catalog.pg_class AS c ON c.oid = p.relid
                      WHERE p.isleaf)
                    - (SELECT pg_catalog.sum(x.count) FROM exact AS x)::bigint, 0) AS finished,
           outbox.outcome_events_estimate() AS processed
)
SELECT status, count, oldest_created_at, pg_catalog.now() - oldest_created_at AS age, lag,
       false AS estimated
  FROM exact
UNION ALL
SELECT 'dispatched',
       CASE WHEN f.batches <= 1000 THEN (SELECT s.dispatched FROM sent AS s)
            ELSE GREATEST(e.finished - GREATEST(e.processed, f.processed), 0) END,
       NULL, NULL, NULL, f.batches > 1000
  FROM finished AS f, estimate AS e
UNION ALL
SELECT 'processed',
       CASE WHEN f.processed <= 1000 THEN f.processed ELSE GREATEST(e.processed, f.processed) END,
       NULL, NULL, NULL, f.processed > 1000
  FROM finished AS f, estimate AS e
 ORDER BY status;

COMMENT ON VIEW outbox.status IS
    'Events per status; lag is how long the oldest due pending event has waited. Pending leaves out events waiting for their key (outbox.blocked_keys). Dispatched and processed are counted while at most 1000 batches are marked and 1000 events have an outcome, then estimated from statistics (estimated = true).';

-- Sent events a worker running outbox_dispatch.celery should have reported
-- by now (outbox.report_timeout, while reports are on) and has not: the
-- message was lost after the push (Redis restarted without persistence, a
-- queue purged), no worker consumes the queue, or the worker does not
-- import the companion. The members without an outcome of the batches
-- marked before then that still await some (settle_reported.sql). Served
-- by batches_unsettled_idx.
CREATE VIEW outbox.unreported AS
SELECT e.id, e.event_type, e.queue, coalesce(e.task, e.event_type) AS task, b.marked_at AS dispatched_at,
       pg_catalog.now() - b.marked_at AS waiting, e.deliveries + 1 AS sends, e.event_id, e.subscription_id
  FROM outbox.batches AS b
 CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
  JOIN outbox.log AS e ON e.id = m.id
 WHERE b.settled_at IS NULL
   AND b.marked_at < pg_catalog.now() - @extschema@.outbox_report_timeout()
   -- The outcomes of those batches read once, into a hash
   -- (sql/worker/settle_reported.sql).
   AND (b.id, m.id) NOT IN (SELECT o.batch, r.id
                              FROM outbox.outcomes AS o CROSS JOIN LATERAL pg_catalog.unnest(o.events) AS r(id)
                             WHERE o.batch IN (SELECT b.id FROM outbox.batches AS b
                                                WHERE b.settled_at IS NULL
                                                  AND b.marked_at < pg_catalog.now()
                                                                    - @extschema@.outbox_report_timeout())
                               AND r.id IS NOT NULL);

COMMENT ON VIEW outbox.unreported IS
    'Dispatched events no worker reported within outbox.report_timeout (while reports are on): lost after the push, or never run.';

-- Every delivery of every routed event: filter on event_id for one event's.
-- status is the delivery's, or its batch's, or 'waiting' for a batch.
CREATE VIEW outbox.deliveries AS
SELECT d.event_id, d.subscription_id, d.task, d.id AS delivery_id, false AS batched,
       outbox.event_status(d.status, d.pending_xid, d.id, d.key_state)::text AS status, d.retry_count,
       d.deliveries + (sent.id IS NOT NULL)::integer AS sends, d.last_error,
       sent.marked_at AS dispatched_at, (SELECT pg_catalog.min(o.at) FROM outbox.outcomes AS o
         WHERE o.batch = outbox.batch_of(d.pending_xid, d.id, true) AND d.id = ANY (o.events)) AS processed_at
  FROM outbox.log AS d
  LEFT JOIN outbox.batches AS sent ON sent.id = outbox.batch_of(d.pending_xid, d.id)
 WHERE d.event_id IS NOT NULL
UNION ALL
SELECT m.event_id, m.subscription_id, s.task, m.batch_id, true,
       CASE WHEN d.id IS NULL THEN 'waiting'
            ELSE outbox.event_status(d.status, d.pending_xid, d.id, d.key_state)::text END, d.retry_count,
       d.deliveries + (sent.id IS NOT NULL)::integer, d.last_error,
       sent.marked_at, (SELECT pg_catalog.min(o.at) FROM outbox.outcomes AS o
                         WHERE o.batch = outbox.batch_of(d.pending_xid, d.id, true) AND d.id = ANY (o.events))
  FROM outbox.batch_members AS m
  JOIN outbox.all_subscriptions AS s ON s.id = m.subscription_id
  LEFT JOIN outbox.log AS d ON d.id = m.batch_id
  LEFT JOIN outbox.batches AS sent ON sent.id = outbox.batch_of(d.pending_xid, d.id);

COMMENT ON VIEW outbox.deliveries IS
    'Per routed event and subscription: the delivery (or batch) that carries it, and its status.';


GRANT SELECT ON outbox.status, outbox.unreported, outbox.deliveries TO pg_monitor;

-- Dead letters go back in line; deliveries are written to the table.
CREATE OR REPLACE FUNCTION @extschema@.outbox_retry(id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Back in line: a report of the failed send, replayed, names a batch
    -- that no longer holds it and finishes nothing. An event with a key
    -- that still holds it is its head again; one whose key went on
    -- without it (outbox.key_on_failure = continue, outbox_skip()) takes
    -- a new turn, behind the key's events (key_seq cleared: the trigger
    -- events_take_turn_again).
    UPDATE outbox.log AS e
       SET status = 'pending',
           retry_count = 0,
           available_at = pg_catalog.clock_timestamp(),
           -- The batch that sent it no longer holds it: its send counted.
           deliveries = e.deliveries + (outbox.batch_of(e.pending_xid, e.id) IS NOT NULL)::integer,
           key_seq = CASE WHEN e.key_state IS NULL THEN NULL ELSE e.key_seq END
     WHERE e.id = outbox_retry.id
       AND e.status = 'failed';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM @extschema@.outbox_wake();
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.outbox_retry_failed(older_than interval DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    retried bigint;
    again uuid;
BEGIN
    IF older_than < interval '0' THEN
        RAISE EXCEPTION 'outbox_retry_failed: older_than must not be negative (got %)', older_than
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE outbox.log AS e
       SET status = 'pending',
           retry_count = 0,
           available_at = pg_catalog.clock_timestamp(),
           deliveries = e.deliveries + (outbox.batch_of(e.pending_xid, e.id) IS NOT NULL)::integer
     WHERE e.status = 'failed'
       AND (e.ordering_key IS NULL OR e.key_state IS NOT NULL)
       AND (older_than IS NULL OR e.created_at <= pg_catalog.now() - older_than);
    GET DIAGNOSTICS retried = ROW_COUNT;
    -- Those whose key went on without them take new turns one by one, in
    -- the order of their keys and, within a key, of their first turns: the
    -- keys' locks are taken in sorted order, and a key gets them back in
    -- the order they were enqueued.
    FOR again IN
        SELECT e.id
          FROM outbox.log AS e
         WHERE e.status = 'failed'
           AND e.ordering_key IS NOT NULL AND e.key_state IS NULL
           AND (older_than IS NULL OR e.created_at <= pg_catalog.now() - older_than)
         ORDER BY e.ordering_key, coalesce(e.subscription_id, 0), e.key_seq
    LOOP
        IF @extschema@.outbox_retry(again) THEN
            retried := retried + 1;
        END IF;
    END LOOP;
    IF retried > 0 THEN
        PERFORM @extschema@.outbox_wake();
    END IF;
    RETURN retried;
END
$$;

CREATE OR REPLACE FUNCTION @extschema@.outbox_route() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
DECLARE
    routed integer;
BEGIN
    PERFORM FROM outbox.all_subscriptions AS s
      WHERE s.unsubscribed_at IS NULL
        AND (s.event_type OPERATOR(pg_catalog.=) NEW.event_type
             OR pg_catalog.starts_with(NEW.event_type, s.prefix));
    IF NOT FOUND THEN
        NEW.routed_to := 0;
        RETURN NEW;
    END IF;

    WITH matched AS (
        SELECT s.id, s.task, s.queue, s.priority, s.batch_max
          FROM outbox.all_subscriptions AS s
         WHERE s.unsubscribed_at IS NULL
           AND (s.event_type OPERATOR(pg_catalog.=) NEW.event_type
                OR pg_catalog.starts_with(NEW.event_type, s.prefix))
    ), delivered AS (
        INSERT INTO outbox.log (event_id, subscription_id, event_type, payload, args, queue, task,
                                   headers, priority, created_at, available_at, expires_at, ordering_key)
        SELECT NEW.id, m.id, NEW.event_type, NEW.payload, NEW.args, coalesce(m.queue, NEW.queue), m.task,
               coalesce(NEW.headers, '{}'::pg_catalog.jsonb) OPERATOR(pg_catalog.||)
                   pg_catalog.jsonb_build_object('outbox_event_id', NEW.id, 'outbox_subscription_id', m.id),
               coalesce(m.priority, NEW.priority), NEW.created_at, NEW.available_at, NEW.expires_at,
               NEW.ordering_key
          FROM matched AS m
         WHERE m.batch_max IS NULL
    ), accumulated AS (
        -- bytes: the member's JSON in its batch (id, event_type, payload,
        -- args and their punctuation), which the flush cuts batches by.
        INSERT INTO outbox.batch_members (event_id, subscription_id, event_type, payload, args, queue, bytes,
                                          available_at)
        SELECT NEW.id, m.id, NEW.event_type, NEW.payload, NEW.args, NEW.queue,
               pg_catalog.octet_length(NEW.payload::pg_catalog.text)
                   OPERATOR(pg_catalog.+) coalesce(pg_catalog.octet_length(NEW.args::pg_catalog.text), 0)
                   OPERATOR(pg_catalog.+) pg_catalog.octet_length(NEW.event_type) OPERATOR(pg_catalog.+) 80,
               NEW.available_at
          FROM matched AS m
         WHERE m.batch_max IS NOT NULL
    )
    SELECT pg_catalog.count(*) INTO routed FROM matched;

    NEW.status := 'processed';
    NEW.routed_to := routed;
    RETURN NEW;
END
$$;

-- What roles were granted on the table, they are granted on the view.
DO $$
DECLARE
    grant_ record;
BEGIN
    -- regrole's text is the role's name, quoted where it must be.
    FOR grant_ IN
        SELECT a.grantee, a.privilege_type, a.is_grantable
          FROM pg_catalog.pg_class AS c
         CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS a
         WHERE c.oid OPERATOR(pg_catalog.=) 'outbox.log'::pg_catalog.regclass
           AND a.grantee OPERATOR(pg_catalog.<>) c.relowner
           AND a.privilege_type OPERATOR(pg_catalog.=) ANY (ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE'])
    LOOP
        EXECUTE pg_catalog.format('GRANT %s ON outbox.events TO %s%s', grant_.privilege_type,
                                  CASE WHEN grant_.grantee OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                                       ELSE grant_.grantee::pg_catalog.regrole::pg_catalog.text END,
                                  CASE WHEN grant_.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$$;

-- The rotation (sql/rotation.sql).
-- When each generation became the current one (NULL: never, since it was
-- truncated), stopped being it, the transaction that last moved events out
-- of it, and whether it gave up all it still needed to keep (drained);
-- first_batch:
-- batches from this id on were claimed once it had begun
-- (outbox.forget_batches()). Not dumped: a restore creates the extension,
-- which starts again at generation 0.
CREATE TABLE outbox.generations (
    generation  smallint PRIMARY KEY CHECK (generation BETWEEN 0 AND 2),
    started_at  timestamptz,
    ended_at    timestamptz,
    moved_xid   xid8,
    drained     boolean NOT NULL DEFAULT false,
    first_batch bigint
);
INSERT INTO outbox.generations (generation, started_at, first_batch)
VALUES (0, pg_catalog.now(), 1), (1, NULL, NULL), (2, NULL, NULL);

-- The events moved out of a generation not yet truncated, where they went:
-- an outcome written for one by a statement whose snapshot did not see it
-- move (an acknowledgement, a report) went to the generation it was in,
-- and follows it before the truncation. Emptied with the truncation.
CREATE TABLE outbox.moved (
    event      uuid NOT NULL,
    generation smallint NOT NULL,  -- where it was
    moved_to   smallint NOT NULL,
    id         uuid NOT NULL,      -- its id there (a new one if its own was taken)
    PRIMARY KEY (generation, event)
);

COMMENT ON TABLE outbox.moved IS
    'Events the rotation moved out of a generation not yet truncated, and where they went.';

COMMENT ON TABLE outbox.generations IS
    'The generations of outbox.log: when each became current and ended, which transaction last moved events out, and whether it is drained.';

-- The events of generation $1 still needed, which a truncation of it must
-- not take: dead letters; events holding or waiting for their key's turn;
-- events out of line (delayed, backing off); events in line the claims
-- have not read (the transactions the cursor's `prev` does not see); and
-- events in a batch not marked, or (acknowledgements on, $2) marked and
-- not settled, without an outcome. Everything else is finished: sent
-- (reported or not), processed, or the record of a routed event. Each set
-- through an index (the dead letters', the keys', the due one, the
-- claim's from `prev`'s xmin on, the batches' in flight), and no event in
-- two of them: read under a LIMIT, they stop at it.
CREATE FUNCTION outbox.unfinished(generation smallint, acks boolean)
RETURNS TABLE (id uuid)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT e.id FROM outbox.log AS e WHERE e.generation = $1 AND e.status = 'failed'
UNION ALL
SELECT e.id FROM outbox.log AS e WHERE e.generation = $1 AND e.key_state IS NOT NULL AND e.status <> 'failed'
UNION ALL
-- (key_state IS DISTINCT FROM 'waiting' as well: the predicate of the
-- indexes, which the planner does not prove from IS NULL.)
SELECT e.id
  FROM outbox.log AS e
 WHERE e.generation = $1
   AND e.pending_xid IS NULL AND e.status = 'pending'
   AND e.key_state IS DISTINCT FROM 'waiting' AND e.key_state IS NULL
UNION ALL
SELECT e.id
  FROM outbox.cursor AS c
  JOIN outbox.log AS e ON e.pending_xid >= pg_snapshot_xmin(c.prev)
 WHERE e.generation = $1
   AND e.status = 'pending' AND e.key_state IS DISTINCT FROM 'waiting' AND e.key_state IS NULL
   AND NOT pg_visible_in_snapshot(e.pending_xid, c.prev)
UNION ALL
SELECT m.id
  FROM (SELECT b.id, b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id
          FROM outbox.batches AS b
         WHERE b.marked_at IS NULL AND b.abandoned_at IS NULL
        UNION ALL
        SELECT b.id, b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id
          FROM outbox.batches AS b
         WHERE $2 AND b.settled_at IS NULL AND b.marked_at IS NOT NULL) AS b
 CROSS JOIN LATERAL outbox.batch_members(b.prev, b.target, b.from_xid, b.from_id, b.to_xid, b.to_id) AS m
 CROSS JOIN LATERAL (SELECT FROM outbox.log AS e, outbox.cursor AS c
                      WHERE e.generation = $1 AND e.id = m.id
                        AND e.status = 'pending' AND e.key_state IS NULL
                        -- Not the set above: read by a claim.
                        AND (e.pending_xid < pg_snapshot_xmin(c.prev) OR pg_visible_in_snapshot(e.pending_xid, c.prev))
                      LIMIT 1) AS e
 -- The outcomes of those batches read once, into a hash
 -- (sql/worker/settle_reported.sql; a lookup per member would read every
 -- outcome row of its batch).
 WHERE (b.id, m.id) NOT IN (SELECT o.batch, r.id
                              FROM outbox.outcomes AS o CROSS JOIN LATERAL unnest(o.events) AS r(id)
                             WHERE o.batch IN (SELECT b.id FROM outbox.batches AS b
                                                WHERE (b.marked_at IS NULL AND b.abandoned_at IS NULL)
                                                   OR ($2 AND b.settled_at IS NULL AND b.marked_at IS NOT NULL))
                               AND r.id IS NOT NULL)
$$;

-- Moves up to $3 of the events of generation $1 still needed to generation
-- $2 (their outcomes follow them at the truncation); returns how many. A
-- moved event keeps everything but its generation, and passes none of the
-- insert triggers (outbox.moving, set for the move alone): it stays in line
-- or out of it, in its batch, with its key's turn. What generation $2 already holds is
-- never refused there, so that the rotation never stops on it (an insert
-- that named a generation of its own, a copy of a row): an event whose id
-- is taken there is moved with a new id, and one whose key's turn is taken
-- (its key_seq, or the key's head) without it, as an event without a key
-- would be (one pending takes a new turn, after the key's others); its
-- last_error says which.
CREATE FUNCTION outbox.move_unfinished(source smallint, target smallint, moves integer, acks boolean) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    moved bigint;
BEGIN
    PERFORM set_config('outbox.moving', 'on', true);
    WITH needed AS (
        SELECT u.id,
               EXISTS (SELECT FROM outbox.log AS t WHERE t.generation = target AND t.id = u.id) AS id_taken,
               EXISTS (SELECT
                         FROM outbox.log AS e
                         JOIN outbox.log AS t
                           ON t.generation = target
                          AND t.ordering_key = e.ordering_key
                          AND coalesce(t.subscription_id, 0) = coalesce(e.subscription_id, 0)
                          AND (t.key_seq = e.key_seq OR (t.key_state = 'head' AND e.key_state = 'head'))
                        WHERE e.generation = source AND e.id = u.id) AS turn_taken
          FROM (SELECT u.id FROM outbox.unfinished(source, acks) AS u LIMIT moves) AS u
    ), carried AS (
        UPDATE outbox.log AS e
           SET generation = target,
               id = CASE WHEN n.id_taken THEN @extschema@.outbox_uuid_v7() ELSE e.id END,
               key_seq = CASE WHEN n.turn_taken THEN NULL ELSE e.key_seq END,
               key_state = CASE WHEN n.turn_taken THEN NULL ELSE e.key_state END,
               last_error = CASE WHEN n.id_taken
                                 THEN format('moved to generation %s with a new id: %s was taken there', target, e.id)
                                 WHEN n.turn_taken
                                 THEN format('moved to generation %s without its turn of key %s: %s was taken there',
                                             target, e.ordering_key, e.key_seq)
                                 ELSE e.last_error
                            END
          FROM needed AS n
         WHERE e.generation = source
           AND e.id = n.id
        RETURNING n.id AS was, e.id
    ), recorded AS (
        INSERT INTO outbox.moved (event, generation, moved_to, id)
        SELECT c.was, source, target, c.id FROM carried AS c
        ON CONFLICT (generation, event) DO UPDATE SET moved_to = excluded.moved_to, id = excluded.id
    )
    SELECT count(*) INTO moved FROM carried;
    PERFORM set_config('outbox.moving', 'off', true);
    RETURN moved;
END
$$;

-- One step of the rotation, in the caller's transaction (each step its own
-- transaction, so that no lock is held for long): what it did, and how
-- many events it truncated. The steps, in the order they come:
--   started    the current generation had no start (after an install, or
--              an advance that did not commit): it starts now;
--   ended      the oldest generation, never current, holds rows (a
--              restore's, an insert that named it): it counts as ended
--              now, and is kept outbox.retention as the others;
--   advanced   the current generation is outbox.retention / 2 old and the
--              next one is empty: the next one is current;
--   waiting    the oldest generation is due, but a transaction that began
--              before it ended (one that may still write it) or, once it
--              is drained, a snapshot that may not see the last moves (one
--              that may still read it as it was) is open: the moves or the
--              truncation would take rows from under it;
--   moved      up to $2 events still needed were moved from the oldest
--              generation to the current one (fewer: it is drained);
--   truncated  the oldest generation, drained, is truncated, unless
--              something in it became needed since (then: moved again);
--   NULL       nothing is due.
CREATE FUNCTION outbox.rotate(retention interval, moves integer, acks boolean,
                              OUT step text, OUT events bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    next_batch CONSTANT bigint := (SELECT coalesce(max(b.id), 0) + 1 FROM outbox.batches AS b);
    current_ smallint;
    oldest smallint;
    now_ outbox.generations;
    old outbox.generations;
BEGIN
    events := 0;
    -- One rotation at a time, whoever runs it; the generation read once
    -- the one before has committed.
    PERFORM FROM outbox.generations AS g ORDER BY g.generation FOR UPDATE;
    current_ := pg_sequence_last_value('outbox.generation'::regclass)::smallint;
    oldest := (current_ + 1) % 3;
    SELECT * INTO now_ FROM outbox.generations AS g WHERE g.generation = current_;
    SELECT * INTO old FROM outbox.generations AS g WHERE g.generation = oldest;
    IF now_.started_at IS NULL THEN
        UPDATE outbox.generations AS g SET started_at = now(), first_batch = next_batch
         WHERE g.generation = current_;
        -- The one it replaced, if that advance did not say so.
        UPDATE outbox.generations AS g SET ended_at = now()
         WHERE g.generation <> current_ AND g.started_at IS NOT NULL AND g.ended_at IS NULL;
        step := 'started';
        RETURN;
    END IF;

    -- Clean: never current since it was truncated, nothing moved out of it
    -- (which leaves dead rows a truncation takes), and nothing in it (a
    -- restore's rows, an insert that named it).
    IF old.started_at IS NULL AND old.moved_xid IS NULL AND NOT old.drained
       AND NOT EXISTS (SELECT FROM outbox.log AS e WHERE e.generation = oldest)
       AND NOT EXISTS (SELECT FROM outbox.outcomes AS o WHERE o.generation = oldest) THEN
        IF now_.started_at > now() - retention / 2 THEN
            RETURN;
        END IF;
        -- Not transactional: should this transaction not commit, the next
        -- step finds the new generation without a start, and starts it.
        PERFORM setval('outbox.generation'::regclass, oldest, true);
        UPDATE outbox.generations AS g
           SET started_at = now(), ended_at = NULL, moved_xid = NULL, drained = false, first_batch = next_batch
         WHERE g.generation = oldest;
        -- After the switch: whatever began before it may still insert
        -- into the generation it read.
        UPDATE outbox.generations AS g SET ended_at = clock_timestamp() WHERE g.generation = current_;
        step := 'advanced';
        RETURN;
    END IF;

    -- Rows in a generation that was never current (a restore's, an insert
    -- that named it): it counts as ended now, and is kept as long.
    IF old.ended_at IS NULL THEN
        UPDATE outbox.generations AS g SET ended_at = now() WHERE g.generation = oldest;
        step := 'ended';
        RETURN;
    END IF;
    IF old.ended_at > now() - retention THEN
        RETURN;
    END IF;
    -- Client sessions and other workers of this database (not autovacuum,
    -- which a TRUNCATE sends away), and prepared transactions, begun before
    -- it ended: they may still insert into it, and their rows are not
    -- visible here until they commit. For the truncation, also any snapshot
    -- that may not see the last moves as committed (its xmin at or before
    -- their transaction): it would find the moved events neither where they
    -- were nor where they went.
    -- A session of a role whose transaction this one may not see (without
    -- pg_read_all_stats: its xact_start and backend_xmin read NULL) may be
    -- as old as any while it is in a transaction (holds its virtual
    -- transaction id's lock, which pg_locks shows every role): the
    -- rotation waits for it too.
    IF EXISTS (SELECT FROM pg_stat_activity AS a
                WHERE a.datname = current_database()
                  AND a.pid <> pg_backend_pid()
                  -- (NULL in the row of a session this role may not see)
                  AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
                  AND (a.xact_start < old.ended_at
                       OR (old.drained AND age(a.backend_xmin) >= age(xid(old.moved_xid)))
                       OR (NOT (pg_has_role('pg_read_all_stats', 'USAGE') OR pg_has_role(a.usesysid, 'USAGE'))
                           AND EXISTS (SELECT FROM pg_locks AS l
                                        WHERE l.pid = a.pid AND l.locktype = 'virtualxid' AND l.granted))))
       OR EXISTS (SELECT FROM pg_prepared_xacts AS p
                   WHERE p.database = current_database()
                     AND p.prepared < old.ended_at) THEN
        step := 'waiting';
        RETURN;
    END IF;

    IF NOT old.drained THEN
        events := outbox.move_unfinished(oldest, current_, moves, acks);
        IF events < moves THEN
            -- The members of the oldest generation's batch deliveries go
            -- with them (they are finished: nothing above needed them).
            DELETE FROM outbox.batch_members AS m
             WHERE m.batch_id IS NOT NULL
               AND EXISTS (SELECT FROM outbox.log AS d WHERE d.generation = oldest AND d.id = m.batch_id);
        END IF;
        UPDATE outbox.generations AS g
           SET moved_xid = CASE WHEN events > 0 THEN pg_current_xact_id() ELSE g.moved_xid END,
               drained = events < moves
         WHERE g.generation = oldest;
        step := 'moved';
        RETURN;
    END IF;

    -- Drained: nothing writes it or reads it as it was. Truncated unless
    -- something in it became needed since (an UPDATE made an event pending
    -- again): that is moved, and the truncation waits for whoever may
    -- have seen it where it was.
    EXECUTE format('LOCK TABLE outbox.%I, outbox.%I IN ACCESS EXCLUSIVE MODE',
                   'log_' || oldest, 'outcomes_' || oldest);
    events := outbox.move_unfinished(oldest, current_, moves, acks);
    IF events > 0 THEN
        -- Many (a DBA's UPDATE of old events): drained again, without the
        -- lock.
        UPDATE outbox.generations AS g SET moved_xid = pg_current_xact_id(), drained = events < moves
         WHERE g.generation = oldest;
        step := 'moved';
        RETURN;
    END IF;
    -- The outcomes of the events moved out of it, recorded before the move
    -- or by a statement that did not see it (all of them have ended: the
    -- wait above), follow them, found by the batch that read them at their
    -- position. One that kept its id is recorded again where it went, in
    -- the same batch. One given a new id is out of its batch (its position
    -- changed): it is stored processed.
    PERFORM outbox.record_outcomes(array_agg(r.batch), array_agg(r.moved_to), array_agg(r.id), array_agg(r.at))
       FROM (SELECT DISTINCT ON (m.moved_to, m.id) o.batch, m.moved_to, m.id, o.at
               FROM outbox.moved AS m
               JOIN outbox.log AS e ON e.generation = m.moved_to AND e.id = m.id
               JOIN outbox.outcomes AS o
                 ON o.generation = oldest
                AND o.batch = outbox.batch_of(e.pending_xid, m.event, true)
                AND m.event = ANY (o.events)
              WHERE m.generation = oldest
                AND m.id = m.event
                AND NOT EXISTS (SELECT FROM outbox.outcomes AS t
                                 WHERE t.generation = m.moved_to AND t.batch = o.batch AND m.id = ANY (t.events))
              ORDER BY m.moved_to, m.id, o.at) AS r;
    UPDATE outbox.log AS e
       SET status = 'processed'
      FROM outbox.moved AS m
     WHERE m.generation = oldest
       AND m.id <> m.event
       AND e.generation = m.moved_to
       AND e.id = m.id
       AND e.status = 'pending'
       AND EXISTS (SELECT FROM outbox.outcomes AS o
                    WHERE o.generation = oldest
                      AND o.batch = outbox.batch_of(e.pending_xid, m.event, true)
                      AND m.event = ANY (o.events));
    DELETE FROM outbox.moved AS m WHERE m.generation = oldest;
    -- Its events as the statistics count them, kept by every insert and
    -- delete (a count would read the partition whole).
    events := pg_stat_get_live_tuples(('outbox.log_' || oldest)::regclass);
    EXECUTE format('TRUNCATE outbox.%I, outbox.%I', 'log_' || oldest, 'outcomes_' || oldest);
    UPDATE outbox.generations AS g
       SET started_at = NULL, ended_at = NULL, moved_xid = NULL, drained = false, first_batch = NULL
     WHERE g.generation = oldest;
    step := 'truncated';
END
$$;

-- Batches whose events are all gone (truncated with their generation),
-- up to $1: claimed before the oldest generation left began (an id below
-- its first_batch), marked or abandoned, and none of their events left in
-- any generation (an event moved forward keeps its batch). Returns how
-- many were deleted. A range of the primary key.
CREATE FUNCTION outbox.forget_batches(batches integer) RETURNS bigint
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
WITH gone AS (
    DELETE FROM outbox.batches AS b
     WHERE b.id IN (SELECT c.id
                      FROM outbox.batches AS c
                     WHERE c.id < (SELECT min(g.first_batch) FROM outbox.generations AS g)
                       AND (c.marked_at IS NOT NULL OR c.abandoned_at IS NOT NULL)
                       AND NOT EXISTS (SELECT FROM outbox.batch_members(c.prev, c.target, c.from_xid, c.from_id,
                                                                         c.to_xid, c.to_id))
                     ORDER BY c.id
                     LIMIT $1)
    RETURNING b.id
)
SELECT count(*) FROM gone
$$;

REVOKE ALL ON FUNCTION outbox.unfinished(smallint, boolean),
    outbox.move_unfinished(smallint, smallint, integer, boolean), outbox.rotate(interval, integer, boolean),
    outbox.forget_batches(integer) FROM PUBLIC;

-- Scrapes without JIT (sql/api.sql).
ALTER FUNCTION @extschema@.outbox_metrics() SET jit = off;
ALTER FUNCTION @extschema@.outbox_metrics_prometheus() SET jit = off;
