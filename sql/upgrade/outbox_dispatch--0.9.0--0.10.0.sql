-- outbox_dispatch 0.9.0 → 0.10.0. Frozen once released: later changes go in
-- a script of their own.
\echo Use "ALTER EXTENSION outbox_dispatch UPDATE" to load this file. \quit

-- Every name in this script resolves in pg_catalog or is qualified: nothing
-- binds an object the database owner may have put in the extension's schema.
SET LOCAL search_path = pg_catalog, pg_temp;

-- The events' table is outbox.log; outbox.events is a view of it, which
-- applications use as before. Everything bound to the table (its indexes,
-- triggers, constraints, the views over it, pg_dump's configuration) stays
-- bound through the rename.
ALTER TABLE outbox.events RENAME TO log;
ALTER TABLE outbox.log RENAME CONSTRAINT events_pkey TO log_pkey;

COMMENT ON TABLE outbox.log IS
    'Outbox events as they were written; read and write them through the view outbox.events.';

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

-- Deliveries are written to the table.
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
    NEW.processed_at := pg_catalog.clock_timestamp();
    NEW.routed_to := routed;
    RETURN NEW;
END
$$;
