-- outbox_dispatch: subscriptions, one event to every subscribed task.
--
-- An event inserted without a task (by outbox_enqueue() or an ORM's INSERT)
-- is routed when it is inserted, to the subscriptions its INSERT sees:
-- changes to subscriptions committed later never rewrite it. Each matching
-- subscription gets its own delivery, a row of outbox.events with its own
-- id (the Celery task id), status, retries and dead letter; an accumulated
-- one (batch_max, batch_wait) gets the event as a batch member instead, and
-- the dispatchers deliver its members together, as one task. The event's
-- own row stays as its record, processed at once, routed_to saying how many
-- subscriptions it went to. An event that matches none is dispatched as it
-- always was (routed_to = 0), to the task named like its event type.
-- A delivery keeps the event's ordering_key, as a key of its subscription:
-- each subscribed task gets the events of one key in order
-- (docs/guides/per-key-order.md). An accumulated subscription's batches have
-- no key: they carry their members in the order the members fell due.

-- Every name below resolves in pg_catalog or is qualified: nothing binds an
-- object the database owner may have put in the extension's schema (the
-- search_path CREATE EXTENSION sets). Restored at the end.
SET LOCAL search_path = pg_catalog, pg_temp;

-- The BEFORE INSERT row trigger. SECURITY DEFINER: writers need INSERT on
-- outbox.events, not on the subscription tables. It runs as the owner with
-- the writer's search_path, so every name is qualified, operators included
-- (a SET search_path clause would cost most of an enqueue, measured).
-- The first look only asks whether anything matches: an event that matches
-- nothing then skips starting the statement with two modifying CTEs; one
-- that matches pays the look again, on a table of a few rows.
CREATE FUNCTION @extschema@.outbox_route() RETURNS trigger
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

-- Only rows that may need routing call it: events without a task not yet
-- routed (deliveries and batches have a task; a restored dump's routed
-- events have routed_to).
CREATE TRIGGER events_route
    BEFORE INSERT ON outbox.log
    FOR EACH ROW WHEN (NEW.task IS NULL AND NEW.routed_to IS NULL
                       AND pg_catalog.current_setting('outbox.moving', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION @extschema@.outbox_route();

-- No event is routed while no subscription is active: routed_to then
-- defaults to 0 and the trigger above is not called, so that an event
-- without a task costs what it did before subscriptions existed. The
-- default function caches the answer per backend (src/subscriptions.rs);
-- every change to the subscriptions drops the caches at its commit.
ALTER TABLE outbox.log ALTER COLUMN routed_to SET DEFAULT @extschema@.outbox_routed_to_default();

CREATE TRIGGER all_subscriptions_changed
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON outbox.all_subscriptions
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.outbox_subscriptions_changed();

-- outbox_subscribe() and outbox_unsubscribe() (src/subscriptions.rs) are
-- written in Rust and run as their caller: they know the role calling
-- (current_user there, which SECURITY DEFINER would hide), and call the two
-- functions below as the extension's owner, the only role that may execute
-- them, passing it.

-- Subscribe task to event_type (exact, or every type it prefixes when it
-- ends in '*'; '*' alone is every event) for role owner. queue and priority
-- override the event's. With batch_max or batch_wait the subscription
-- accumulates: its events are delivered together, as one task whose one
-- argument is their list, once batch_max of them wait (1000 when only
-- batch_wait is given) or the oldest has waited batch_wait, whichever comes
-- first. Returns the id.
CREATE FUNCTION @extschema@.outbox_subscription_add(
    owner      name,
    event_type text,
    task       text,
    queue      text,
    priority   integer,
    batch_max  integer,
    batch_wait interval
) RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    max_name_bytes CONSTANT integer := 255;
    max_batch      CONSTANT integer := 1000;
    existing       bigint;
    new_id         bigint;
BEGIN
    IF event_type IS NULL OR octet_length(event_type) NOT BETWEEN 1 AND max_name_bytes THEN
        RAISE EXCEPTION 'outbox_subscribe: event_type is % bytes, it must be 1 to % bytes',
            coalesce(octet_length(event_type), 0), max_name_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF strpos(left(event_type, -1), '*') > 0 THEN
        RAISE EXCEPTION 'outbox_subscribe: event_type "%" has a * before its end; only a trailing * (a prefix) is a pattern',
            event_type
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF task IS NULL OR octet_length(task) NOT BETWEEN 1 AND max_name_bytes THEN
        RAISE EXCEPTION 'outbox_subscribe: task is % bytes, it must be 1 to % bytes',
            coalesce(octet_length(task), 0), max_name_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(queue) NOT BETWEEN 1 AND max_name_bytes THEN
        RAISE EXCEPTION 'outbox_subscribe: queue is % bytes, it must be 1 to % bytes (or NULL: the event''s)',
            octet_length(queue), max_name_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF priority NOT BETWEEN 0 AND 9 THEN
        RAISE EXCEPTION 'outbox_subscribe: priority is %, it must be 0 (highest) to 9 (or NULL: the event''s)',
            priority
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF batch_max NOT BETWEEN 1 AND max_batch THEN
        RAISE EXCEPTION 'outbox_subscribe: batch_max is %, it must be 1 to %', batch_max, max_batch
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF batch_wait <= interval '0' THEN
        RAISE EXCEPTION 'outbox_subscribe: batch_wait must be positive (got %)', batch_wait
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    SELECT s.id INTO existing
      FROM outbox.all_subscriptions AS s
     WHERE s.event_type = outbox_subscription_add.event_type
       AND s.task = outbox_subscription_add.task
       AND s.unsubscribed_at IS NULL;
    IF FOUND THEN
        RAISE EXCEPTION 'outbox_subscribe: task "%" is subscribed to "%" already (subscription %)',
            task, event_type, existing
            USING ERRCODE = 'unique_violation',
                  HINT = 'outbox_unsubscribe() it first to change it.';
    END IF;

    INSERT INTO outbox.all_subscriptions AS s (event_type, task, queue, priority, batch_max, batch_wait, created_by)
    VALUES (event_type, task, queue, priority,
            CASE WHEN batch_wait IS NOT NULL THEN coalesce(batch_max, max_batch) ELSE batch_max END,
            batch_wait, owner)
    RETURNING s.id INTO new_id;
    RETURN new_id;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_subscription_add(name, text, text, text, integer, integer, interval) IS
    'outbox_subscribe() for role owner; the extension''s owner alone may call it.';

-- Ends subscription id for events inserted after this commits, for role
-- asking. Returns whether it was active. Deliveries made already stay; its
-- waiting batch members are delivered at once, in batches of its batch_max.
-- Only a role with the privileges of the role that subscribed, or of the
-- extension's owner, may end a subscription.
CREATE FUNCTION @extschema@.outbox_subscription_end(asking oid, id bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    owner name;
BEGIN
    IF id IS NULL THEN
        RAISE EXCEPTION 'outbox_unsubscribe: id must not be null'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s.created_by INTO owner
      FROM outbox.all_subscriptions AS s
     WHERE s.id = outbox_subscription_end.id
       AND s.unsubscribed_at IS NULL
       FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT coalesce(pg_has_role(asking, to_regrole(quote_ident(owner)), 'USAGE'), false)
       AND NOT pg_has_role(asking, (SELECT x.extowner FROM pg_extension AS x
                                     WHERE x.extname = 'outbox_dispatch'), 'USAGE')
    THEN
        RAISE EXCEPTION 'outbox_unsubscribe: subscription % belongs to role "%"', id, owner
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Only a role with its privileges, or the extension owner''s, may end it.';
    END IF;
    UPDATE outbox.all_subscriptions AS s
       SET unsubscribed_at = now()
     WHERE s.id = outbox_subscription_end.id;
    PERFORM @extschema@.outbox_wake();
    RETURN true;
END
$$;

COMMENT ON FUNCTION @extschema@.outbox_subscription_end(oid, bigint) IS
    'outbox_unsubscribe() for role asking; the extension''s owner alone may call it.';

-- Active subscriptions, and unsubscribed ones whose members still wait.
CREATE VIEW outbox.subscriptions AS
SELECT s.id, s.event_type, s.task, s.queue, s.priority, s.batch_max, s.batch_wait,
       w.waiting, w.oldest_available_at, s.created_at, s.unsubscribed_at,
       s.created_by, s.last_error, s.last_error_at
  FROM outbox.all_subscriptions AS s
 CROSS JOIN LATERAL (
       SELECT pg_catalog.count(*) AS waiting, pg_catalog.min(m.available_at) AS oldest_available_at
         FROM outbox.batch_members AS m
        WHERE m.subscription_id = s.id AND m.batch_id IS NULL) AS w
 WHERE s.unsubscribed_at IS NULL OR w.waiting > 0
 ORDER BY s.id;

COMMENT ON VIEW outbox.subscriptions IS
    'Subscriptions; waiting counts the events an accumulated one holds for its next batch; last_error says why its last batch could not be made.';

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

-- outbox_routed_to_default() stays public: it is the default of every insert.
REVOKE ALL ON FUNCTION
    @extschema@.outbox_route(),
    @extschema@.outbox_subscriptions_changed(),
    @extschema@.outbox_subscription_add(name, text, text, text, integer, integer, interval),
    @extschema@.outbox_subscription_end(oid, bigint),
    @extschema@.outbox_subscribe(text, text, text, integer, integer, interval),
    @extschema@.outbox_unsubscribe(bigint)
    FROM PUBLIC;

COMMENT ON FUNCTION @extschema@.outbox_subscribe(text, text, text, integer, integer, interval) IS
    'Deliver events of event_type (or of a prefix ending in *) enqueued without a task to task; returns the subscription id.';

GRANT SELECT ON outbox.subscriptions, outbox.deliveries TO pg_monitor;

-- The extension's schema again, for the functions pgrx declares next.
SET LOCAL search_path = @extschema@;
