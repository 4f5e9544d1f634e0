-- outbox_dispatch without the library: the leases the sidecars coordinate
-- with (sidecar/src/lease.rs), in place of the library's shared memory: a
-- dispatcher's number, which says whose claims a restart puts back in
-- line, and the turns one dispatcher of the database takes at a time
-- (housekeeping, collecting reports). Its own file, run by an install and
-- by the update from 1.0.0, whose sidecars took session advisory locks:
-- any role that may connect can take any advisory lock, and one that held
-- the numbers stopped every sidecar. A lease is a row of a table only the
-- outbox's owner may write: no other role can take, hold or squat one.
--
-- A lease is its holder's while the holder's session lives (its backend:
-- pid, role and start, so that a pid used again is another session) and,
-- for a turn, until it expires: a holder that cannot renew in time stops
-- acting on it. Each is taken, renewed and given back by a statement of its own,
-- never in a transaction kept open (which would hold back every vacuum).
SET LOCAL search_path = pg_catalog, pg_temp;

-- UNLOGGED: after a crash every holder's session is gone with it.
CREATE UNLOGGED TABLE outbox.sidecar_leases (
    name          text PRIMARY KEY,
    holder        text NOT NULL,
    backend_pid   integer NOT NULL,
    backend_role  oid NOT NULL,
    backend_start timestamptz NOT NULL,
    taken_at      timestamptz NOT NULL,
    expires_at    timestamptz
);

COMMENT ON TABLE outbox.sidecar_leases IS
    'The sidecars'' leases (outbox-dispatch run): a dispatcher''s number (dispatcher N) while its session lives, a turn (housekeeping, reports) until it expires. The owner''s alone to write.';

-- Whether the session of backend pid, of role, started at started, lives.
-- Read afresh, not from the statistics this transaction read already: a
-- session that took a lease since must not be missed. A session of that
-- role whose start this role may not see (a member's, without
-- pg_read_all_stats) lives; one of another role never holds a lease (the
-- pid of a holder gone, which a session of any role may get again).
CREATE FUNCTION outbox.session_lives(pid integer, role oid, started timestamptz) RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_stat_clear_snapshot();
    RETURN EXISTS (SELECT FROM pg_stat_activity AS a
                    WHERE a.pid = session_lives.pid AND a.usesysid = session_lives.role
                      AND (a.backend_start = session_lives.started OR a.backend_start IS NULL));
END
$$;

-- Takes lease name for holder, this session, for ttl (NULL: while the
-- session lives), or renews it when this session holds it already. Free
-- is a lease without a row, expired, or whose holder's session is gone.
-- Returns NULL once taken; else who holds it, as a sentence.
CREATE FUNCTION outbox.take_lease(name text, holder text, ttl interval) RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    me CONSTANT pg_stat_activity := (SELECT a FROM pg_stat_activity AS a WHERE a.pid = pg_backend_pid());
    held outbox.sidecar_leases;
BEGIN
    INSERT INTO outbox.sidecar_leases AS l (name, holder, backend_pid, backend_role, backend_start, taken_at,
                                            expires_at)
    VALUES (take_lease.name, take_lease.holder, pg_backend_pid(), me.usesysid, me.backend_start, now(), now() + ttl)
    ON CONFLICT ON CONSTRAINT sidecar_leases_pkey DO UPDATE
       SET holder = excluded.holder, backend_pid = excluded.backend_pid, backend_role = excluded.backend_role,
           backend_start = excluded.backend_start,
           taken_at = CASE WHEN l.backend_pid = excluded.backend_pid AND l.backend_start = excluded.backend_start
                           THEN l.taken_at ELSE excluded.taken_at END,
           expires_at = excluded.expires_at
     WHERE (l.backend_pid = excluded.backend_pid AND l.backend_start = excluded.backend_start)
        OR l.expires_at <= now()
        OR NOT outbox.session_lives(l.backend_pid, l.backend_role, l.backend_start);
    IF FOUND THEN
        RETURN NULL;
    END IF;
    SELECT * INTO held FROM outbox.sidecar_leases AS l WHERE l.name = take_lease.name;
    RETURN format('%s (backend pid %s, since %s%s)', held.holder, held.backend_pid, held.taken_at,
                  CASE WHEN held.expires_at IS NULL THEN '' ELSE format(', until %s', held.expires_at) END);
END
$$;

-- Gives lease name back, when this session holds it.
CREATE FUNCTION outbox.give_lease(name text) RETURNS boolean
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DELETE FROM outbox.sidecar_leases AS l
 WHERE l.name = give_lease.name AND l.backend_pid = pg_backend_pid()
   AND l.backend_start = (SELECT a.backend_start FROM pg_stat_activity AS a WHERE a.pid = pg_backend_pid())
RETURNING true
$$;

-- The lowest dispatcher number free (below most), taken for holder while
-- this session lives; NULL when every one is held.
CREATE FUNCTION outbox.take_dispatcher_number(holder text, most integer) RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    n integer;
BEGIN
    FOR n IN
        SELECT g.n
          FROM generate_series(0, most - 1) AS g(n)
          LEFT JOIN outbox.sidecar_leases AS l ON l.name = 'dispatcher ' || g.n
         WHERE l.name IS NULL OR l.backend_pid = pg_backend_pid()
            OR NOT outbox.session_lives(l.backend_pid, l.backend_role, l.backend_start)
         ORDER BY g.n
    LOOP
        -- Another sidecar may take it first: then the next.
        IF outbox.take_lease('dispatcher ' || n, holder, NULL) IS NULL THEN
            RETURN n;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

REVOKE ALL ON FUNCTION outbox.session_lives(integer, oid, timestamptz), outbox.take_lease(text, text, interval),
    outbox.give_lease(text), outbox.take_dispatcher_number(text, integer) FROM PUBLIC;
GRANT SELECT ON outbox.sidecar_leases TO pg_monitor;

-- The extension's schema again, for the files that follow.
SET LOCAL search_path = @extschema@;
