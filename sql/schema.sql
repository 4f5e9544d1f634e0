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

CREATE TYPE outbox.event_status AS ENUM
    ('pending', 'processing', 'dispatched', 'processed', 'failed');

CREATE TABLE outbox.log (
    id                    uuid PRIMARY KEY,  -- default: outbox_uuid_v7(), set in api.sql
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
    status                outbox.event_status NOT NULL DEFAULT 'pending',
    retry_count           integer NOT NULL DEFAULT 0,
    created_at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    processing_started_at timestamptz,
    dispatched_at         timestamptz,
    processed_at          timestamptz,
    last_error            text,
    claimed_by            integer,  -- index of the dispatcher that claimed it
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
    deliveries            integer NOT NULL DEFAULT 0,  -- times pushed to Redis
    send_id               uuid,     -- the last send's id (new at every claim), which its report must name
    -- The transaction that made the row pending (inserted it, or set it
    -- pending again): where the claim is in line (core/src/frontier.rs).
    pending_xid           xid8 NOT NULL DEFAULT pg_current_xact_id(),
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
    CONSTRAINT events_args_with_kwargs CHECK (args IS NULL OR jsonb_typeof(payload) = 'object')
)
-- A queue table churns: every row is inserted, updated two or three times
-- and deleted. Vacuum and analyze it after a small fraction of changes
-- rather than the default 20%, so dead rows never pile up in front of the
-- claim's index scan.
WITH (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 1
);

COMMENT ON TABLE outbox.log IS
    'Outbox events as they were written; read and write them through the view outbox.events.';

-- pg_dump keeps the events (undelivered ones above all): the table belongs
-- to the extension, whose member tables are otherwise dumped empty.
SELECT pg_catalog.pg_extension_config_dump('outbox.log', '');

-- The name applications, ORMs and DBAs use. A view of one table, so
-- PostgreSQL updates it by itself: an INSERT (RETURNING included), UPDATE
-- or DELETE through it is one on outbox.log, with the table's defaults,
-- constraints and triggers (its statement triggers too). It acts as its
-- caller (security_invoker): a role needs the privilege on both, and the
-- table's row-level security applies to it as to a statement on the table.
CREATE VIEW outbox.events WITH (security_invoker = true) AS
SELECT l.id, l.event_type, l.payload, l.queue, l.task, l.headers, l.priority, l.status, l.retry_count,
       l.created_at, l.available_at, l.processing_started_at, l.dispatched_at, l.processed_at, l.last_error,
       l.claimed_by, l.args, l.expires_at, l.event_id, l.subscription_id, l.routed_to, l.deliveries, l.send_id,
       l.pending_xid, l.ordering_key, l.key_seq, l.key_state
  FROM outbox.log AS l;

COMMENT ON VIEW outbox.events IS
    'Outbox events. Insert with outbox_enqueue() or a plain INSERT; committed rows are dispatched.';

-- The claim. Each dispatcher scans pending events in the order their
-- transactions made them pending, from where it got to (a dead entry left
-- behind by a claim is never walked again, however long vacuum is held off);
-- and, by when they fall due, the events it passed before they were due,
-- those it could not lock, and the earliest one still to come.
-- An event waiting for its key's turn is in neither: however many wait
-- behind blocked keys, the claim never reads them.
CREATE INDEX events_pending_xid_idx ON outbox.log (pending_xid, id)
    WHERE status = 'pending' AND key_state IS DISTINCT FROM 'waiting';
CREATE INDEX events_pending_idx ON outbox.log (available_at, id)
    WHERE status = 'pending' AND key_state IS DISTINCT FROM 'waiting';
-- An update that makes an event pending again (a retry, a release, a sweep,
-- a DBA's UPDATE, its key's turn come) or moves when it falls due puts it
-- in line again, as if enqueued by that update's transaction; so does an
-- insert that names another transaction (a restored dump, a copy). An
-- insert with the default does not call it.
CREATE FUNCTION @extschema@.outbox_pending_again() RETURNS trigger
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    NEW.pending_xid := pg_catalog.pg_current_xact_id();
    RETURN NEW;
END
$$;
CREATE TRIGGER events_pending_again
    BEFORE INSERT OR UPDATE OF status, available_at, pending_xid, key_state ON outbox.log
    FOR EACH ROW WHEN (NEW.status = 'pending' AND NEW.pending_xid <> pg_catalog.pg_current_xact_id())
    EXECUTE FUNCTION @extschema@.outbox_pending_again();
-- Also where triggers are off for replication (a logical replication
-- subscriber applying the rows of another server's history).
ALTER TABLE outbox.log ENABLE ALWAYS TRIGGER events_pending_again;

-- Stuck claims, and the claims a restarted dispatcher releases.
CREATE INDEX events_processing_idx ON outbox.log (processing_started_at, claimed_by)
    WHERE status = 'processing';
-- Unacknowledged dispatched events.
CREATE INDEX events_dispatched_idx ON outbox.log (dispatched_at) WHERE status = 'dispatched';
-- Dead letters.
CREATE INDEX events_failed_idx ON outbox.log (created_at) WHERE status = 'failed';
-- The lifecycle sweeper's deletes.
CREATE INDEX events_processed_idx ON outbox.log (processed_at) WHERE status = 'processed';

-- Per-key order. The events of a key in key_seq order (those that took a
-- turn: an event routed to subscriptions, a record, took none): its newest
-- says whether the key is taken (outbox_key_taken()), and the one after a
-- head is the next to take it; both are the first entry a scan reads,
-- however many finished events of the key are left behind.
-- Unique: two rows of a key never share a turn.
CREATE UNIQUE INDEX events_key_idx ON outbox.log (ordering_key, (coalesce(subscription_id, 0)), key_seq)
    WHERE key_seq IS NOT NULL;
-- Heads and waiting events, by key: outbox.blocked_keys, the metrics, and
-- the dispatchers' sweep for keys left without a head.
CREATE INDEX events_key_state_idx ON outbox.log (key_state, ordering_key, (coalesce(subscription_id, 0)), key_seq)
    WHERE key_state IS NOT NULL;
-- One head per key, whatever writes the row: a second head would be sent
-- beside the first. (An insert that copies a head takes a turn of its own,
-- outbox_take_turn() in sql/keys.sql; an UPDATE that would make a second
-- head fails here.)
CREATE UNIQUE INDEX events_key_head_idx ON outbox.log (ordering_key, (coalesce(subscription_id, 0)))
    WHERE key_state = 'head';
-- key_seq: the order in which the transactions that enqueued for one key
-- committed (each takes it under the key's lock, held to its commit).
CREATE SEQUENCE outbox.key_seq;

-- The deliveries of one event.
CREATE INDEX events_event_id_idx ON outbox.log (event_id) WHERE event_id IS NOT NULL;

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
    created_by      name NOT NULL,  -- the role that subscribed (README, "Privileges")
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

-- The database whose events these are: CREATE EXTENSION records its OID.
-- A copy (CREATE DATABASE ... TEMPLATE) carries the row with the events of
-- the database it copied, events sent from there already: its dispatchers
-- send nothing until outbox_adopt() is run in it (README, "Several
-- databases"), or find nothing to send or confirm and adopt it themselves.
-- Not dumped: a restore runs CREATE EXTENSION, which records the new OID.
CREATE TABLE outbox.installed_in (
    database oid NOT NULL,
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row)
);
INSERT INTO outbox.installed_in (database)
SELECT d.oid FROM pg_catalog.pg_database AS d WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database();

COMMENT ON TABLE outbox.installed_in IS
    'The OID of the database CREATE EXTENSION ran in: a copy of it is not dispatched until outbox_adopt().';

SELECT pg_catalog.pg_extension_config_dump('outbox.all_subscriptions', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.subscription_id_seq', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.batch_members', '');
SELECT pg_catalog.pg_extension_config_dump('outbox.key_seq', '');

-- The extension's schema again, for the functions pgrx declares next.
SET LOCAL search_path = @extschema@;
