-- outbox_dispatch: the schema, the events table and its indexes.
-- Functions live in the extension's schema (public by default), data and
-- views in schema outbox.

-- Every name below resolves in pg_catalog or is qualified: nothing binds an
-- object the database owner may have put in the extension's schema (the
-- search_path CREATE EXTENSION sets). Restored at the end for the functions
-- pgrx declares, which name no schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- Events travel as JSON text in UTF-8: the dispatchers read payloads and
-- names as UTF-8, and a database in another encoding would garble or refuse
-- them at dispatch, long after the commit. Refuse it here, up front.
DO $$
BEGIN
    IF pg_catalog.getdatabaseencoding() OPERATOR(pg_catalog.<>) 'UTF8' THEN
        RAISE EXCEPTION 'outbox_dispatch needs a UTF8 database; database "%" is %',
            pg_catalog.current_database(), pg_catalog.getdatabaseencoding()
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'CREATE DATABASE … ENCODING ''UTF8'' TEMPLATE template0, and create the extension there.';
    END IF;
END
$$;

CREATE SCHEMA outbox;
COMMENT ON SCHEMA outbox IS 'Transactional outbox: events delivered to Redis as Celery tasks';

-- The role that installed the outbox (the owner of its schema): the
-- extension's owner, or the role that ran `outbox-dispatch install`.
CREATE FUNCTION outbox.owner() RETURNS oid
LANGUAGE sql STABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT n.nspowner FROM pg_namespace AS n WHERE n.nspname = 'outbox' $$;

CREATE TYPE outbox.event_status AS ENUM
    ('pending', 'processing', 'dispatched', 'processed', 'failed');

-- The generation rows are inserted in: which partition of outbox.log (and
-- of outbox.outcomes) takes them. The column's default reads it from this
-- sequence, which nothing advances (a setval moves it; a read writes
-- nothing, where nextval would write WAL). Readable by everyone, since
-- every insert reads it. The rotation moves it on (sql/rotation.sql).
CREATE SEQUENCE outbox.generation AS smallint MINVALUE 0 MAXVALUE 2;
SELECT pg_catalog.setval('outbox.generation', 0, true);
GRANT SELECT ON SEQUENCE outbox.generation TO PUBLIC;

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
    -- letter), 'processed' (the record of a routed event). Never more: the
    -- planner reads this constraint to leave the other statuses' filters
    -- on outbox.events out of these rows (sql/events.sql).
    status                outbox.event_status NOT NULL DEFAULT 'pending'
                          CONSTRAINT events_status_written CHECK (status IN ('pending', 'failed', 'processed')),
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
    -- Per-key order (docs/guides/per-key-order.md): events of one ordering_key
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

-- pg_dump keeps the events not delivered yet (pending, processing), the
-- dead letters and the records of routed events, of each partition (a
-- restore puts them back in the partition they came from): the partitions
-- belong to the extension, whose member tables are otherwise dumped empty.
-- Not what was
-- delivered: the batches that say so name this cluster's transactions,
-- and are not dumped; but, where acknowledgements are on
-- (outbox.ack_timeout > 0 for pg_dump's session), the events delivered and
-- not acknowledged, sent again after a restore. (Added once outbox.event_status() exists, below.)

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
-- An insert or an update that makes an event pending (a retry, a release,
-- a sweep, a DBA's UPDATE, its key's turn come) or moves when it falls due
-- puts it in line as if that statement's transaction had enqueued it, or
-- out of line until it falls due; so does an insert that names another
-- transaction (a restored dump, a copy). An insert with the defaults, due
-- now, does not call it: the WHEN is evaluated without a function call.
-- Nor does an event the rotation moves to the current generation (it
-- keeps its place: outbox.moving, sql/rotation.sql), nor, for the same
-- reason, the triggers that take a key's turn and route an event.
--
-- An event goes out of line due after the moment it is written, and its
-- transaction holds a shared advisory lock (1869968482: 'outb', and a
-- number drawn at random, once a transaction: outbox_due.locked_by says
-- which transaction took it) until it ends: the dispatchers start their
-- scans of events_due_idx no lower than its start while it is open
-- (sql/worker/due_bound.sql), and above the entries a pinned xmin keeps.
-- The lock is tried, never waited for, and drawn again where another
-- session holds it: any role may take an advisory lock, but no role can
-- hold the 2^31 numbers, nor foresee the one drawn; where three draws all
-- fail, the event goes in line at once, with a warning, rather than hold
-- up the writer, or a dispatcher backing off.
CREATE FUNCTION @extschema@.outbox_pending_again() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF NEW.available_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() THEN
        IF coalesce(pg_catalog.current_setting('outbox_due.locked_by', true), '') OPERATOR(pg_catalog.<>)
               pg_catalog.pg_current_xact_id()::pg_catalog.text THEN
            FOR attempt IN 1..3 LOOP
                IF pg_catalog.pg_try_advisory_xact_lock_shared(
                       1869968482,
                       (pg_catalog.random() OPERATOR(pg_catalog.*) 2147483647::pg_catalog.float8)::pg_catalog.int4) THEN
                    PERFORM pg_catalog.set_config('outbox_due.locked_by',
                                                  pg_catalog.pg_current_xact_id()::pg_catalog.text, true);
                    EXIT;
                END IF;
            END LOOP;
        END IF;
        IF pg_catalog.current_setting('outbox_due.locked_by', true) OPERATOR(pg_catalog.=)
               pg_catalog.pg_current_xact_id()::pg_catalog.text THEN
            NEW.pending_xid := NULL;
            RETURN NEW;
        END IF;
        RAISE WARNING 'outbox: event % goes in line now, not at %: other sessions hold the advisory locks (1869968482, n) by which this transaction would say that it delays an event',
            NEW.id, NEW.available_at
            USING HINT = 'Revoke CONNECT from PUBLIC on the outbox''s database (docs/operations/security.md).';
    END IF;
    NEW.pending_xid := pg_catalog.pg_current_xact_id();
    RETURN NEW;
END
$$;
CREATE TRIGGER events_pending_again
    BEFORE INSERT ON outbox.log
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       AND (NEW.pending_xid IS DISTINCT FROM pg_catalog.pg_current_xact_id()
                            OR NEW.available_at > pg_catalog.clock_timestamp())
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- An update that sets the status (a retry, a release, a DBA's UPDATE
-- ... SET status = 'pending', which sends an event again).
CREATE TRIGGER events_pending_again_updated
    BEFORE UPDATE OF status ON outbox.log
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       AND (NEW.pending_xid IS DISTINCT FROM pg_catalog.pg_current_xact_id()
                            OR NEW.available_at > pg_catalog.clock_timestamp())
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- An update that moves when it falls due or its place: one that leaves
-- them as they were (an edit of its payload through outbox.events, whose
-- rule writes every column but the status) leaves the event where it is.
CREATE TRIGGER events_pending_again_moved
    BEFORE UPDATE OF available_at, pending_xid ON outbox.log
    FOR EACH ROW WHEN (NEW.status = 'pending'
                       AND (OLD.available_at IS DISTINCT FROM NEW.available_at
                            OR OLD.pending_xid IS DISTINCT FROM NEW.pending_xid)
                       AND (NEW.pending_xid IS DISTINCT FROM pg_catalog.pg_current_xact_id()
                            OR NEW.available_at > pg_catalog.clock_timestamp())
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- Also where triggers are off for replication (a logical replication
-- subscriber applying the rows of another server's history).
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again;
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again_updated;
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again_moved;

-- The triggers of outbox.log that fire always, also where triggers are
-- off for replication (events_from_writers in sql/keys.sql; without the
-- library, events_moving_refused in sql/standalone/tail.sql); and the
-- partitions of the log where one does not: a data-only restore with
-- --disable-triggers, or a copy made with the triggers off, leaves them
-- disabled while it writes
-- (disabled: true), then, after its ENABLE TRIGGER ALL, firing for
-- ordinary sessions only. The rows written meanwhile kept the transaction
-- ids they came with, which may lie inside windows the claims have read
-- (sql/worker/reline_restored.sql); until the dispatchers have put them
-- in line and made the triggers fire always again (outbox.fire_always()),
-- the rotation moves and truncates nothing of such a partition.
CREATE FUNCTION outbox.always_firing() RETURNS SETOF name
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT unnest('{events_pending_again,events_pending_again_updated,events_pending_again_moved,events_from_writers,events_moving_refused}'::name[]) $$;

CREATE FUNCTION outbox.triggers_off() RETURNS TABLE (generation smallint, disabled boolean, pages bigint)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
SELECT substr(c.relname, 5)::smallint, bool_or(t.tgenabled = 'D'),
       pg_relation_size(c.oid) / current_setting('block_size')::bigint
  FROM pg_inherits AS i
  JOIN pg_class AS c ON c.oid = i.inhrelid
  JOIN pg_trigger AS t ON t.tgrelid = c.oid
 WHERE i.inhparent = 'outbox.log'::regclass
   AND t.tgname IN (SELECT outbox.always_firing())
   AND t.tgenabled <> 'A'
 GROUP BY c.oid, c.relname
$$;

-- The triggers of generation $1's partition fire always again, as on the
-- log (outbox.triggers_off()).
CREATE FUNCTION outbox.fire_always(generation smallint) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    table_ name;
    trigger_ name;
BEGIN
    FOR table_, trigger_ IN
        SELECT c.relname, t.tgname
          FROM pg_trigger AS t
          JOIN pg_class AS c ON c.oid = t.tgrelid
         WHERE t.tgrelid IN ('outbox.log'::regclass, format('outbox.log_%s', generation)::regclass)
           AND t.tgname IN (SELECT outbox.always_firing())
           AND t.tgenabled <> 'A'
    LOOP
        EXECUTE format('ALTER TABLE ONLY outbox.%I ENABLE ALWAYS TRIGGER %I', table_, trigger_);
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION outbox.fire_always(smallint) FROM PUBLIC;

-- Dead letters.
CREATE INDEX events_failed_idx ON outbox.log (created_at) WHERE status = 'failed';
-- Records of routed events, and events acknowledged while out of a batch:
-- retention.
CREATE INDEX events_recorded_idx ON outbox.log (created_at) WHERE status = 'processed';

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

INSERT INTO outbox.positions (prev) VALUES (outbox.starting_snapshot());

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
-- Its events are those of the window between its two positions still in line
-- there (outbox_batch_members()). An event is written only when something
-- exceptional happens to it (a failed push, a dead letter, a release, a
-- re-send); otherwise its batch is its state (docs/design/how-it-works.md).
-- Messages carry `send`, which a report must name.
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
    settled_at   timestamptz,  -- nothing is awaited of its events any more (acknowledgements off, or swept)
    -- Marked while acknowledgements were on (outbox.ack_timeout above 0):
    -- what it sent is sent again unless acknowledged within the setting.
    -- One marked while they were off awaits none, whatever the setting
    -- becomes.
    awaits_ack   boolean NOT NULL DEFAULT false,
    -- The transactions its window read behind (in progress at `prev`,
    -- ended at `target`) whose events it read, but for its last event's:
    -- those whose last event in line it read before its own last (NULL
    -- for none). outbox.held_by() finds their events' page by them.
    read_past    pg_catalog.xid8[]
)
WITH (fillfactor = 50);

COMMENT ON TABLE outbox.batches IS
    'The claims of the dispatchers, one row each: which events they read, and whether they were pushed.';

-- The batch of an event: those whose last position is at or after it.
CREATE INDEX batches_to_idx ON outbox.batches (to_xid, to_id);
-- The batch of an event of a transaction that ran while others were
-- claimed, on a page that reads past its end: walked from the event's
-- place, batches_to_idx would pass every page claimed meanwhile
-- (outbox.held_by()). Searched at every lookup: no pending list.
CREATE INDEX batches_read_past_idx ON outbox.batches USING gin (read_past) WITH (fastupdate = off)
    WHERE read_past IS NOT NULL;
-- Claims not marked yet: the stuck sweeper, a restarted dispatcher.
CREATE INDEX batches_unmarked_idx ON outbox.batches (claimed_at, dispatcher)
    WHERE marked_at IS NULL AND abandoned_at IS NULL;
-- Batches whose events may still be acknowledged: the unacknowledged
-- sweeper; then retention.
CREATE INDEX batches_unsettled_idx ON outbox.batches (marked_at)
    WHERE settled_at IS NULL AND marked_at IS NOT NULL;
CREATE INDEX batches_settled_idx ON outbox.batches (settled_at) WHERE settled_at IS NOT NULL;
-- Batches whose acknowledgements are awaited: the unacknowledged sweeper
-- (sql/worker/settle_unacked.sql).
CREATE INDEX batches_unacked_idx ON outbox.batches (marked_at)
    WHERE settled_at IS NULL AND awaits_ack;
CREATE INDEX batches_abandoned_idx ON outbox.batches (abandoned_at) WHERE abandoned_at IS NOT NULL;

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

-- The page that read past the end of transaction $1's events in line (a
-- transaction its window read behind: outbox.batches.read_past), if any:
-- one at most. GIN is read by bitmap alone, which the dispatchers turn
-- off for their sessions (src/worker/setup.rs): on here, for this query,
-- which has no LIMIT for the planner to walk another index to.
CREATE FUNCTION outbox.read_past(xid pg_catalog.xid8) RETURNS pg_catalog.int8
LANGUAGE sql STABLE STRICT
SET search_path = pg_catalog, pg_temp
SET enable_bitmapscan = on
AS $$
SELECT b.id FROM outbox.batches AS b WHERE b.read_past @> ARRAY[$1]
$$;

-- The batch that read an event in line at ($1, $2): the page of a window
-- that holds its place (the first batch whose last place is at or after
-- it, of the window that read its transaction). No row: none yet (or
-- out of line). Looked for among the first pages from its place in
-- batches_to_idx (where it is, but for the event of a transaction that
-- ran while many others were claimed), then as the page that read past
-- its transaction's end (outbox.read_past()), then walked for (a page
-- claimed before 1.1.0, which did not say what it read past; none yet).
-- Plain SQL with every name qualified and no SET clause, so that a
-- caller inlines it (outbox.batch_of(), and the library's
-- outbox.state_at() when a place is not the last batch's it found).
CREATE FUNCTION outbox.held_by(xid pg_catalog.xid8, event pg_catalog.uuid)
RETURNS TABLE (id pg_catalog.int8, from_xid pg_catalog.xid8, from_id pg_catalog.uuid, to_xid pg_catalog.xid8,
               to_id pg_catalog.uuid, prev pg_catalog.pg_snapshot, target pg_catalog.pg_snapshot,
               marked_at pg_catalog.timestamptz, abandoned_at pg_catalog.timestamptz)
LANGUAGE sql STABLE ROWS 1
AS $$
SELECT h.id, h.from_xid, h.from_id, h.to_xid, h.to_id, h.prev, h.target, h.marked_at, h.abandoned_at
  FROM ((SELECT b.id, b.from_xid, b.from_id, b.to_xid, b.to_id, b.prev, b.target, b.marked_at, b.abandoned_at
           FROM (SELECT c.*
                   FROM outbox.batches AS c
                  WHERE (c.to_xid, c.to_id) OPERATOR(pg_catalog.>=) ($1, $2)
                  ORDER BY c.to_xid, c.to_id
                  LIMIT 16) AS b
          WHERE pg_catalog.pg_visible_in_snapshot($1, b.target)
            AND NOT pg_catalog.pg_visible_in_snapshot($1, b.prev)
            AND ((b.from_xid, b.from_id) OPERATOR(pg_catalog.<) ($1, $2)) IS NOT FALSE
          ORDER BY b.to_xid, b.to_id
          LIMIT 1)
        UNION ALL
        (SELECT b.id, b.from_xid, b.from_id, b.to_xid, b.to_id, b.prev, b.target, b.marked_at, b.abandoned_at
           FROM outbox.batches AS b
          WHERE b.id OPERATOR(pg_catalog.=) outbox.read_past($1)
            AND (b.to_xid, b.to_id) OPERATOR(pg_catalog.>=) ($1, $2)
            AND pg_catalog.pg_visible_in_snapshot($1, b.target)
            AND NOT pg_catalog.pg_visible_in_snapshot($1, b.prev)
            AND ((b.from_xid, b.from_id) OPERATOR(pg_catalog.<) ($1, $2)) IS NOT FALSE)
        UNION ALL
        (SELECT b.id, b.from_xid, b.from_id, b.to_xid, b.to_id, b.prev, b.target, b.marked_at, b.abandoned_at
           FROM outbox.batches AS b
          WHERE (b.to_xid, b.to_id) OPERATOR(pg_catalog.>=) ($1, $2)
            AND pg_catalog.pg_visible_in_snapshot($1, b.target)
            AND NOT pg_catalog.pg_visible_in_snapshot($1, b.prev)
            AND ((b.from_xid, b.from_id) OPERATOR(pg_catalog.<) ($1, $2)) IS NOT FALSE
          ORDER BY b.to_xid, b.to_id
          LIMIT 1)) AS h
 LIMIT 1
$$;

-- Its id; an abandoned batch (its events went back in line, but those
-- with an outcome) only with $3: what became of the event at that place.
CREATE FUNCTION outbox.batch_of(pending_xid xid8, id uuid, abandoned boolean DEFAULT false) RETURNS bigint
LANGUAGE sql STABLE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT h.id FROM outbox.held_by($1, $2) AS h WHERE $3 OR h.abandoned_at IS NULL
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

-- (The view outbox.events, which derives it a set of rows at a time: sql/events.sql.)

-- Whether the batch that sent an event awaits acknowledgements, as they
-- were when it was marked (batches.awaits_ack): what pg_dump keeps of
-- what was sent (below), whatever outbox.ack_timeout says now.
CREATE FUNCTION outbox.awaits_ack(pending_xid xid8, id uuid) RETURNS boolean
LANGUAGE sql STABLE STRICT SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
SELECT coalesce((SELECT b.awaits_ack FROM outbox.batches AS b WHERE b.id OPERATOR(pg_catalog.=) outbox.batch_of($1, $2)),
                false)
$$;

-- extension only: begin (what pg_dump keeps; sql/standalone/ goes without)
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
            'OR (outbox.event_status(status, pending_xid, id, key_state) OPERATOR(pg_catalog.=) '
            '''dispatched''::outbox.event_status AND outbox.awaits_ack(pending_xid, id))');
    END LOOP;
END
$$;
-- extension only: end


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
-- key_seq: the order in which the transactions that enqueued for one key
-- committed (each takes it under the key's lock, held to its commit).
CREATE SEQUENCE outbox.key_seq;

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

-- Subscriptions: which tasks an event without a task goes to. Rows are
-- never deleted (outbox_unsubscribe() stamps unsubscribed_at): deliveries
-- and waiting batch members keep naming them.
CREATE SEQUENCE outbox.subscription_id_seq;

CREATE TABLE outbox.all_subscriptions (
    id              bigint PRIMARY KEY DEFAULT nextval('outbox.subscription_id_seq'),
    event_type      text NOT NULL,  -- exact, or a prefix when it ends in '*'
    prefix          text GENERATED ALWAYS AS
                        (CASE WHEN right(event_type, 1) = '*' THEN left(event_type, -1) END) STORED,
    task            text NOT NULL,
    queue           text,      -- NULL: the event's queue
    priority        smallint,  -- NULL: the event's priority
    batch_max       integer,   -- set: accumulated; events per batch at most
    batch_wait      interval,  -- how long the oldest waiting event may wait (NULL: until batch_max)
    created_at      timestamptz NOT NULL DEFAULT now(),
    unsubscribed_at timestamptz,
    created_by      name NOT NULL,  -- the role that subscribed (docs/operations/security.md)
    -- Why the last batch of an accumulated subscription could not be made
    -- for a reason that would not pass (its members were dead-lettered).
    last_error      text,
    last_error_at   timestamptz,
    CONSTRAINT all_subscriptions_batch CHECK (batch_max IS NOT NULL OR batch_wait IS NULL)
);

ALTER SEQUENCE outbox.subscription_id_seq OWNED BY outbox.all_subscriptions.id;

COMMENT ON TABLE outbox.all_subscriptions IS
    'Every subscription, unsubscribed ones included; manage with outbox_subscribe() and outbox_unsubscribe(), read outbox.subscriptions.';

-- One active subscription per event type and task.
CREATE UNIQUE INDEX all_subscriptions_active_idx ON outbox.all_subscriptions (event_type, task)
    WHERE unsubscribed_at IS NULL;

-- Events waiting for an accumulated subscription, then (batch_id set) the
-- batch delivery that carried them, until that delivery is purged.
CREATE TABLE outbox.batch_members (
    event_id        uuid NOT NULL,
    subscription_id bigint NOT NULL,
    event_type      text NOT NULL,
    payload         jsonb,  -- NULL once in a batch, which carries it
    args            jsonb,
    available_at    timestamptz NOT NULL,
    batch_id        uuid,   -- outbox.events.id of the batch delivery; NULL: waiting
    queue           text NOT NULL,     -- the event's: a subscription without a queue sends there
    bytes           integer NOT NULL,  -- the member's size in its batch's JSON
    PRIMARY KEY (event_id, subscription_id)
)
WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02
);

COMMENT ON TABLE outbox.batch_members IS
    'Events of accumulated subscriptions: waiting (batch_id NULL), or delivered in the batch batch_id.';

-- The flush: a subscription's waiting members, oldest due first.
CREATE INDEX batch_members_waiting_idx ON outbox.batch_members (subscription_id, available_at)
    WHERE batch_id IS NULL;
-- The purge of a batch's members with the batch.
CREATE INDEX batch_members_batch_idx ON outbox.batch_members (batch_id) WHERE batch_id IS NOT NULL;

-- The database whose events these are: CREATE EXTENSION records its OID. A
-- copy (CREATE DATABASE ... TEMPLATE) carries the row with the events of the
-- database it copied, events sent from there already: its dispatchers send
-- nothing until outbox_adopt() is run in it
-- (docs/guides/several-databases.md), or find nothing to send or confirm and
-- adopt it themselves. Not dumped: a restore runs CREATE EXTENSION, which
-- records the new OID.
CREATE TABLE outbox.installed_in (
    database oid NOT NULL,
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row)
);
INSERT INTO outbox.installed_in (database)
SELECT d.oid FROM pg_catalog.pg_database AS d WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database();

COMMENT ON TABLE outbox.installed_in IS
    'The OID of the database CREATE EXTENSION ran in: a copy of it is not dispatched until outbox_adopt().';

-- extension only: begin (what pg_dump keeps; sql/standalone/ goes without)
SELECT pg_catalog.pg_extension_config_dump('outbox.all_subscriptions', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.subscription_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.batch_members', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.key_seq', '');
-- extension only: end

-- The extension's schema again, for the functions pgrx declares next.
SET LOCAL search_path = @extschema@;
