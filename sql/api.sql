-- outbox_dispatch: the SQL API and the views. Runs last, after the
-- functions written in Rust (src/api.rs, src/views.rs) exist.

-- Every name below resolves in pg_catalog or is qualified: nothing binds an
-- object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

ALTER TABLE outbox.log ALTER COLUMN id SET DEFAULT @extschema@.outbox_uuid_v7();

-- The defaults of outbox.log's columns are those of the view outbox.events
-- (sql/events.sql: a rule's NEW has a view's, not the table's); not those of the columns that say
-- what became of the event, which are never written.
DO $$
DECLARE
    column_ record;
BEGIN
    FOR column_ IN
        SELECT a.attname, pg_get_expr(d.adbin, d.adrelid) AS default_
          FROM pg_attribute AS a
          JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE a.attrelid = 'outbox.log'::regclass
           AND a.attname IN (SELECT v.attname FROM pg_attribute AS v
                              WHERE v.attrelid = 'outbox.events'::regclass AND v.attnum > 0)
           AND a.attname NOT IN ('status', 'deliveries')
    LOOP
        EXECUTE format('ALTER VIEW outbox.events ALTER COLUMN %I SET DEFAULT %s', column_.attname, column_.default_);
    END LOOP;
END
$$;


-- Every insert path (outbox_enqueue() or an ORM's INSERT) wakes the
-- dispatchers when its transaction commits. Once per statement, not per row;
-- BEFORE rather than AFTER, which would queue an after-trigger event per
-- statement. (An INSERT that then fails aborts the transaction, and with it
-- the wake; one caught by a savepoint costs a spurious wake at most.)
CREATE TRIGGER events_wake_dispatchers
    BEFORE INSERT ON outbox.log
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.outbox_events_inserted();

-- Enqueue one event in the caller's transaction; returns its id, which is
-- also the Celery task id. Every argument is checked first, with an error
-- that names it and its limit; nothing is inserted when one is refused.
-- The payload's size is its stored (jsonb) size, args included, the one
-- measure: the dispatchers never refuse an accepted event for its size.
-- expires counts from now, as Celery's does (not from the end of delay).
-- Every name is qualified, operators included (OPERATOR(pg_catalog.…)):
-- nothing resolves through a search_path the database owner may have set.
-- (A SET search_path clause would do the same at about a tenth of enqueue
-- throughput, measured: this is the hot path.)
CREATE FUNCTION @extschema@.outbox_enqueue(
    event_type text,
    payload    jsonb,
    queue      text     DEFAULT NULL,
    task       text     DEFAULT NULL,
    headers    jsonb    DEFAULT NULL,
    delay      interval DEFAULT NULL,
    priority   integer  DEFAULT 0,
    expires    interval DEFAULT NULL,
    args       jsonb    DEFAULT NULL,
    ordering_key text   DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    max_name_bytes CONSTANT integer := 255;
    max_payload    CONSTANT integer := @extschema@.outbox_max_payload_bytes();
    resolved_queue CONSTANT pg_catalog.text := coalesce(queue,
                                      pg_catalog.current_setting('outbox.default_queue', true), 'celery');
    -- Made here rather than returned by the INSERT: RETURNING would need
    -- SELECT on outbox.events, which writers are not granted.
    new_id         CONSTANT pg_catalog.uuid := @extschema@.outbox_uuid_v7();
    payload_bytes  CONSTANT integer := pg_catalog.pg_column_size(payload)
                                       OPERATOR(pg_catalog.+) coalesce(pg_catalog.pg_column_size(args), 0);
    event_bytes    CONSTANT integer := pg_catalog.octet_length(event_type);
    queue_bytes    CONSTANT integer := pg_catalog.octet_length(resolved_queue);
    task_bytes     CONSTANT integer := pg_catalog.octet_length(task);
    key_bytes      CONSTANT integer := pg_catalog.octet_length(ordering_key);
    enqueued_at    CONSTANT pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
    -- One test for the common case; the ones inside say what is wrong.
    IF event_type IS NULL OR payload IS NULL OR priority IS NULL
       OR event_bytes OPERATOR(pg_catalog.<) 1 OR event_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR queue_bytes OPERATOR(pg_catalog.<) 1 OR queue_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR task_bytes OPERATOR(pg_catalog.<) 1 OR task_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR key_bytes OPERATOR(pg_catalog.<) 1 OR key_bytes OPERATOR(pg_catalog.>) max_name_bytes
       OR payload_bytes OPERATOR(pg_catalog.>) max_payload
       OR pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object'
       OR delay OPERATOR(pg_catalog.<) interval '0' OR NOT pg_catalog.isfinite(delay)
       OR priority OPERATOR(pg_catalog.<) 0 OR priority OPERATOR(pg_catalog.>) 9
       OR expires OPERATOR(pg_catalog.<=) interval '0'
       OR pg_catalog.jsonb_typeof(args) OPERATOR(pg_catalog.<>) 'array'
       OR (args IS NOT NULL AND pg_catalog.jsonb_typeof(payload) OPERATOR(pg_catalog.<>) 'object')
    THEN
        IF event_type IS NULL OR event_bytes OPERATOR(pg_catalog.=) 0 THEN
            RAISE EXCEPTION 'outbox_enqueue: event_type must not be null or empty'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF event_bytes OPERATOR(pg_catalog.>) max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: event_type is % bytes, the limit is % bytes',
                event_bytes, max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF queue_bytes OPERATOR(pg_catalog.<) 1 OR queue_bytes OPERATOR(pg_catalog.>) max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: queue is % bytes, it must be 1 to % bytes',
                queue_bytes, max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF task_bytes OPERATOR(pg_catalog.<) 1 OR task_bytes OPERATOR(pg_catalog.>) max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: task is % bytes, it must be 1 to % bytes',
                task_bytes, max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF key_bytes OPERATOR(pg_catalog.<) 1 OR key_bytes OPERATOR(pg_catalog.>) max_name_bytes THEN
            RAISE EXCEPTION 'outbox_enqueue: ordering_key is % bytes, it must be 1 to % bytes (or null: no key)',
                key_bytes, max_name_bytes
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF payload IS NULL THEN
            RAISE EXCEPTION 'outbox_enqueue: payload must not be null (use ''{}'' for a task without arguments)'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF payload_bytes OPERATOR(pg_catalog.>) max_payload THEN
            RAISE EXCEPTION 'outbox_enqueue: payload is % bytes as jsonb, over outbox.max_payload_bytes (% bytes)',
                payload_bytes, max_payload
                USING ERRCODE = 'program_limit_exceeded',
                      HINT = 'args count towards it.';
        END IF;
        IF pg_catalog.jsonb_typeof(headers) OPERATOR(pg_catalog.<>) 'object' THEN
            RAISE EXCEPTION 'outbox_enqueue: headers must be a JSON object, not %',
                pg_catalog.jsonb_typeof(headers)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF delay OPERATOR(pg_catalog.<) interval '0' OR NOT pg_catalog.isfinite(delay) THEN
            RAISE EXCEPTION 'outbox_enqueue: delay must be finite and not negative (got %)', delay
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF expires OPERATOR(pg_catalog.<=) interval '0' THEN
            RAISE EXCEPTION 'outbox_enqueue: expires must be positive (got %)', expires
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF pg_catalog.jsonb_typeof(args) OPERATOR(pg_catalog.<>) 'array' THEN
            RAISE EXCEPTION 'outbox_enqueue: args must be a JSON array, not %', pg_catalog.jsonb_typeof(args)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF args IS NOT NULL AND pg_catalog.jsonb_typeof(payload) OPERATOR(pg_catalog.<>) 'object' THEN
            RAISE EXCEPTION 'outbox_enqueue: with args, payload must be a JSON object (the keyword arguments), not %',
                pg_catalog.jsonb_typeof(payload)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RAISE EXCEPTION 'outbox_enqueue: priority is %, it must be 0 (highest) to 9', priority
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    INSERT INTO outbox.events (id, event_type, payload, args, queue, task, headers, priority,
                               available_at, expires_at, ordering_key)
    VALUES (new_id, event_type, payload, args, resolved_queue, task, headers, priority,
            enqueued_at OPERATOR(pg_catalog.+) coalesce(delay, interval '0'),
            enqueued_at OPERATOR(pg_catalog.+) expires, ordering_key);
    RETURN new_id;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb, text) IS
    'Enqueue an event in the current transaction; it is delivered as a Celery task after COMMIT.';

-- A copy of a database (CREATE DATABASE ... TEMPLATE) holds the events of
-- the database it copied, sent from there already: its dispatchers send
-- nothing until this makes them the copy's own. Its events pending,
-- processing or dispatched (and unconfirmed) are then sent from here too.
-- Returns whether the database was a copy not yet adopted.
CREATE FUNCTION @extschema@.outbox_adopt() RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    UPDATE outbox.installed_in AS i
       SET database = d.oid
      FROM pg_catalog.pg_database AS d
     WHERE d.datname = pg_catalog.current_database()
       AND i.database <> d.oid;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    PERFORM @extschema@.outbox_wake();
    RETURN true;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_adopt() IS
    'In a copy of a database (CREATE DATABASE ... TEMPLATE): send the events it holds from here.';

-- A failed event back to pending, its retries reset. Returns whether it was
-- failed. As the owner (a role granted it, operators, has no privilege on
-- outbox.log, whose updates write an event's place and its key's turn).
CREATE FUNCTION @extschema@.outbox_retry(id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
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

-- Every failed event (created at least older_than ago, when given) back to
-- pending, retries reset, as outbox_retry() does. Returns how many. As
-- the owner, as outbox_retry().
CREATE FUNCTION @extschema@.outbox_retry_failed(older_than interval DEFAULT NULL) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
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

-- Refuses a caller that is not the outbox's owner, naming the function
-- it called (an invoker's statement on the log would be refused before it
-- runs, in PostgreSQL's words, which name no owner).
CREATE FUNCTION outbox.only_owner(caller text) RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT pg_has_role(current_user, outbox.owner(), 'USAGE') THEN
        RAISE EXCEPTION '%: only the outbox''s owner (role %) may, not role %', caller, outbox.owner()::regrole,
            current_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END
$$;

-- The events outbox_resend() and outbox_discard() act on: those of
-- outbox.events with `status` (or any of `statuses` when NULL) that the
-- given filters name, oldest first, up to `max_events`: ids, and the
-- positions of their rows. Only the filters given are written into the
-- statement, so that it reads the indexes they allow (each status its
-- own: sql/events.sql). Refuses, naming the argument and its limit, a call
-- that names no event, a status the caller cannot act on, and a bound out
-- of range.
CREATE FUNCTION outbox.chosen(caller text, statuses outbox.event_status[], ids uuid[], queue text, task text,
                              event_type text, status outbox.event_status, created_after timestamptz,
                              created_before timestamptz, max_events integer)
RETURNS TABLE (id uuid, generation smallint)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    filters text[] := '{}';
BEGIN
    IF num_nonnulls(ids, queue, task, event_type, status, created_after, created_before) = 0 THEN
        RAISE EXCEPTION '%: name the events: ids, queue, task, event_type, status, created_after or created_before',
            caller
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF status IS NOT NULL AND NOT status = ANY (statuses) THEN
        RAISE EXCEPTION '%: status is %, it must be one of %', caller, status, array_to_string(statuses, ', ')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF max_events IS NULL OR max_events < 1 OR max_events > 100000 THEN
        RAISE EXCEPTION '%: max_events is %, it must be 1 to 100000 (call again for more)', caller,
            coalesce(max_events::text, 'null')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF ids IS NOT NULL THEN filters := array_append(filters, 'e.id = ANY ($1)'); END IF;
    IF queue IS NOT NULL THEN filters := array_append(filters, 'e.queue = $2'); END IF;
    IF task IS NOT NULL THEN filters := array_append(filters, 'coalesce(e.task, e.event_type) = $3'); END IF;
    IF event_type IS NOT NULL THEN filters := array_append(filters, 'e.event_type = $4'); END IF;
    IF created_after IS NOT NULL THEN filters := array_append(filters, 'e.created_at >= $6'); END IF;
    IF created_before IS NOT NULL THEN filters := array_append(filters, 'e.created_at < $7'); END IF;
    RETURN QUERY EXECUTE
        'SELECT e.id, l.generation FROM outbox.events AS e JOIN outbox.log AS l ON l.id = e.id '
        || 'WHERE e.status = ANY ($5) AND ' || array_to_string(array_append(filters, 'true'), ' AND ')
        || ' ORDER BY e.created_at, e.id LIMIT $8'
        USING ids, queue, task, event_type, CASE WHEN status IS NULL THEN statuses ELSE ARRAY[status] END,
              created_after, created_before, max_events;
END
$$;

-- Sends again up to `max_events` events already sent or dead-lettered
-- (dispatched, processed, failed) that the filters name: each back in
-- line now, with its retries reset and its sends counted, and a
-- last_error that says who sent it again; one of a key whose key went on
-- without it takes a new turn behind the key's events (as outbox_retry()),
-- a head its key waits for is sent again as its head. The outbox's owner
-- alone; logged. Returns how many; call again while it returns
-- max_events. What is pending or processing is on its way already.
CREATE FUNCTION @extschema@.outbox_resend(
    ids            uuid[] DEFAULT NULL,
    queue          text DEFAULT NULL,
    task           text DEFAULT NULL,
    event_type     text DEFAULT NULL,
    status         outbox.event_status DEFAULT NULL,
    created_after  timestamptz DEFAULT NULL,
    created_before timestamptz DEFAULT NULL,
    max_events     integer DEFAULT 1000
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    chosen record;
    resent bigint := 0;
BEGIN
    PERFORM outbox.only_owner('outbox_resend');
    -- One at a time, oldest first: those of a key take their new turns in
    -- the order they were enqueued.
    FOR chosen IN
        SELECT c.id, c.generation
          FROM outbox.chosen('outbox_resend', '{dispatched,processed,failed}', outbox_resend.ids, outbox_resend.queue, outbox_resend.task, outbox_resend.event_type,
                             outbox_resend.status, outbox_resend.created_after, outbox_resend.created_before, outbox_resend.max_events) AS c
    LOOP
        UPDATE outbox.log AS e
           SET status = 'pending',
               retry_count = 0,
               available_at = clock_timestamp(),
               -- Out of its batch: its send counted, its place taken anew
               -- (the trigger puts it in line as this transaction's).
               deliveries = e.deliveries + (outbox.batch_of(e.pending_xid, e.id) IS NOT NULL)::integer,
               pending_xid = NULL,
               key_seq = CASE WHEN e.key_state IS NULL THEN NULL ELSE e.key_seq END,
               last_error = format('sent again by outbox_resend() (role %s, %s)', current_user, now())
         WHERE e.id = chosen.id
           AND e.generation = chosen.generation;
        resent := resent + 1;
    END LOOP;
    RAISE LOG 'outbox_resend: role % sent % events again (ids %, queue %, task %, event_type %, status %, created % to %)',
        current_user, resent, ids, queue, task, event_type, status, created_after, created_before;
    IF resent > 0 THEN
        PERFORM @extschema@.outbox_wake();
    END IF;
    RETURN resent;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_resend(uuid[], text, text, text, outbox.event_status, timestamptz, timestamptz, integer) IS
    'Send again up to max_events events already sent or dead-lettered that the filters name (the outbox''s owner alone).';

-- Deletes up to `max_events` events not sent yet, or dead-lettered
-- (pending, failed), that the filters name: they are never sent. A key
-- whose head goes passes to the event behind it within seconds (the
-- dispatchers' sweep of keys). The outbox's owner alone; logged, since
-- nothing of the events is left. Returns how many; call again while it
-- returns max_events. What is processing is being pushed: not taken. A
-- claim reads the events it takes without writing them: the discard locks
-- the rows it chose (SKIP LOCKED: one another session holds is left for
-- the next call), then takes the claims' turn (outbox.claim_turn, as
-- sql/worker/lock_cursor.sql does; rows, then the turn, the order a
-- dispatcher takes them in), so that its delete reads what every claim
-- that committed took, and deletes only what is still pending or failed.
-- In READ COMMITTED alone, where each statement reads what committed
-- before it. No claim runs until its transaction ends.
CREATE FUNCTION @extschema@.outbox_discard(
    ids            uuid[] DEFAULT NULL,
    queue          text DEFAULT NULL,
    task           text DEFAULT NULL,
    event_type     text DEFAULT NULL,
    status         outbox.event_status DEFAULT NULL,
    created_after  timestamptz DEFAULT NULL,
    created_before timestamptz DEFAULT NULL,
    max_events     integer DEFAULT 1000
) RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    locked_ids uuid[];
    locked_generations smallint[];
    discarded bigint;
BEGIN
    PERFORM outbox.only_owner('outbox_discard');
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'outbox_discard: the transaction is %, it must be read committed', current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'A snapshot taken before a claim committed would delete an event being pushed.';
    END IF;
    SELECT array_agg(l.id), array_agg(l.generation)
      INTO locked_ids, locked_generations
      FROM (SELECT l.id, l.generation
              FROM outbox.chosen('outbox_discard', '{pending,failed}', outbox_discard.ids, outbox_discard.queue,
                                 outbox_discard.task, outbox_discard.event_type, outbox_discard.status,
                                 outbox_discard.created_after, outbox_discard.created_before,
                                 outbox_discard.max_events) AS c
              JOIN outbox.log AS l ON l.id = c.id AND l.generation = c.generation
               FOR UPDATE OF l SKIP LOCKED) AS l;
    PERFORM FROM outbox.claim_turn FOR UPDATE;
    WITH gone AS (
        DELETE FROM outbox.log AS e
         USING unnest(locked_ids, locked_generations) AS k(id, generation)
         WHERE e.id = k.id
           AND e.generation = k.generation
           AND outbox.event_status(e.status, e.pending_xid, e.id, e.key_state) IN ('pending', 'failed')
        RETURNING e.id
    )
    SELECT count(*) INTO discarded FROM gone;
    RAISE LOG 'outbox_discard: role % discarded % events (ids %, queue %, task %, event_type %, status %, created % to %)',
        current_user, discarded, ids, queue, task, event_type, status, created_after, created_before;
    RETURN discarded;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_discard(uuid[], text, text, text, outbox.event_status, timestamptz, timestamptz, integer) IS
    'Delete up to max_events events not sent yet, or dead-lettered, that the filters name (the outbox''s owner alone).';

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
    -- In line, not read yet.
    SELECT u.created_at, u.available_at FROM outbox.unread AS u
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

CREATE VIEW outbox.workers AS
SELECT * FROM @extschema@.outbox_dispatchers();

COMMENT ON VIEW outbox.workers IS
    'One row per dispatcher of every database served, then one per database outbox.database names that is not served (state not served, last_error says why).';

CREATE VIEW outbox.metrics AS
SELECT * FROM @extschema@.outbox_metrics();

COMMENT ON VIEW outbox.metrics IS
    'One row per metric sample (Prometheus style); outbox_metrics_prometheus() renders the same as text.';

CREATE VIEW outbox.dead_letters AS
SELECT id, event_type, queue, coalesce(task, event_type) AS task, payload, headers,
       retry_count, last_error, created_at,
       deliveries + (outbox.batch_of(pending_xid, id) IS NOT NULL)::integer AS deliveries,
       args, event_id, subscription_id,
       ordering_key, key_state IS NOT DISTINCT FROM 'head' AS holds_key
  FROM outbox.log
 WHERE status = 'failed';

COMMENT ON VIEW outbox.dead_letters IS
    'Failed events with their last error: outbox.max_retries failed pushes, expired before delivery, never acknowledged after outbox.max_redeliveries re-sends, or failed in the Celery task. A delivery to a subscription has event_id and subscription_id; a batch, subscription_id alone. holds_key: it blocks its ordering_key until outbox_retry() or outbox_skip().';

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

-- Privileges. PostgreSQL lets PUBLIC execute every new function; here
-- nobody but the owner may do anything until granted (docs/operations/security.md).
-- outbox_uuid_v7() stays public: it is the id default of every insert path.
REVOKE ALL ON FUNCTION
    @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, interval, integer, interval, jsonb, text),
    @extschema@.outbox_ack(uuid),
    @extschema@.outbox_ack(uuid, uuid),
    @extschema@.outbox_skip(uuid),
    @extschema@.outbox_inbox_claim(uuid, text),
    @extschema@.outbox_retry(uuid),
    @extschema@.outbox_retry_failed(interval),
    @extschema@.outbox_resend(uuid[], text, text, text, outbox.event_status, timestamptz, timestamptz, integer),
    @extschema@.outbox_discard(uuid[], text, text, text, outbox.event_status, timestamptz, timestamptz, integer),
    @extschema@.outbox_adopt(),
    @extschema@.outbox_wake(),
    @extschema@.outbox_workers(),
    @extschema@.outbox_dispatchers(),
    @extschema@.outbox_metrics(),
    @extschema@.outbox_metrics_prometheus(),
    @extschema@.outbox_events_inserted(),
    @extschema@.outbox_pending_again(),
    @extschema@.outbox_take_turn(),
    @extschema@.outbox_key_taken(text, bigint),
    @extschema@.outbox_turn_fits(text, bigint, bigint, text)
    FROM PUBLIC;

-- A scrape reads outbox.status, whose estimated cost can pass
-- jit_above_cost (a bloated cursor, a snapshot's list of transactions,
-- estimated at a thousand rows); compiling it took 200-300 ms of a scrape
-- that runs in 10.
ALTER FUNCTION @extschema@.outbox_metrics() SET jit = off;
ALTER FUNCTION @extschema@.outbox_metrics_prometheus() SET jit = off;

-- Monitoring: members of pg_monitor read the views that carry no payloads.
GRANT USAGE ON SCHEMA outbox TO pg_monitor;
GRANT SELECT ON outbox.status, outbox.workers, outbox.metrics, outbox.unreported TO pg_monitor;
GRANT EXECUTE ON FUNCTION
    @extschema@.outbox_workers(),
    @extschema@.outbox_dispatchers(),
    @extschema@.outbox_metrics(),
    @extschema@.outbox_metrics_prometheus()
    TO pg_monitor;

-- The launcher starts this database's dispatchers at this commit (when
-- outbox.database covers it).
SELECT @extschema@.outbox_wake();
