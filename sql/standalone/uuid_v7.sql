-- outbox_dispatch without the library: outbox_uuid_v7(), the id default of
-- every insert. Its own file, run by an install and again by an update
-- from 0.10.0, whose ids were ordered only to the millisecond
-- (sidecar/src/script.rs, UPDATES).
SET LOCAL search_path = pg_catalog, pg_temp;

-- A time-ordered UUID (version 7), as RFC 9562's third method makes it and
-- PostgreSQL 18's own uuidv7() does: the milliseconds since the epoch, the
-- fraction of the millisecond in the next 12 bits (to the microsecond, the
-- clock's own precision), then random bits. Two ids a session takes in
-- turn are in order unless the clock did not move between them (several
-- in one statement within a microsecond, or the clock set back);
-- PostgreSQL 18's keeps even those in order, and is used where it exists.
-- Every name qualified and no SET clause: it is the id default of every
-- insert. PL/pgSQL elsewhere, whose expressions a session plans once (an
-- SQL function would be parsed again by every INSERT it is inlined into).
-- An install takes over no function of this name another role made (an
-- update replaces the one the installing role made), whether or not
-- `outbox-dispatch install` checked the schema first.
DO $install$
DECLARE
    planted regrole := (SELECT p.proowner::regrole
                          FROM pg_proc AS p
                         WHERE p.oid = to_regprocedure($name$@extschema@.outbox_uuid_v7()$name$)
                           AND p.proowner <> (SELECT r.oid FROM pg_roles AS r WHERE r.rolname = current_user));
BEGIN
    IF planted IS NOT NULL THEN
        RAISE EXCEPTION '%.outbox_uuid_v7() belongs to role %, not to the installing role', $name$@extschema@$name$, planted
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Drop it, or install into a schema only this role creates in.';
    END IF;
    IF pg_catalog.current_setting('server_version_num')::pg_catalog.int4 OPERATOR(pg_catalog.>=) 180000 THEN
        EXECUTE $create$
            CREATE OR REPLACE FUNCTION @extschema@.outbox_uuid_v7() RETURNS pg_catalog.uuid
            LANGUAGE sql VOLATILE PARALLEL SAFE
            AS 'SELECT pg_catalog.uuidv7()'
        $create$;
    ELSE
        EXECUTE $create$
            CREATE OR REPLACE FUNCTION @extschema@.outbox_uuid_v7() RETURNS pg_catalog.uuid
            LANGUAGE plpgsql VOLATILE PARALLEL SAFE
            AS $body$
            DECLARE
                -- Microseconds since the epoch; EXTRACT is exact (numeric).
                us CONSTANT pg_catalog.int8 := pg_catalog.floor(
                    EXTRACT(epoch FROM pg_catalog.clock_timestamp()) OPERATOR(pg_catalog.*) 1000000);
            BEGIN
                RETURN (pg_catalog.lpad(pg_catalog.to_hex(us OPERATOR(pg_catalog./) 1000), 12, '0')
                        OPERATOR(pg_catalog.||) '7'
                        -- 0 to 4091: the microsecond within the millisecond, in 4096ths
                        OPERATOR(pg_catalog.||) pg_catalog.lpad(pg_catalog.to_hex(
                            us OPERATOR(pg_catalog.%) 1000 OPERATOR(pg_catalog.*) 4096 OPERATOR(pg_catalog./) 1000),
                            3, '0')
                        -- "-Vxxx-xxxxxxxxxxxx": the variant and 62 random bits
                        OPERATOR(pg_catalog.||) pg_catalog.substr(pg_catalog.gen_random_uuid()::pg_catalog.text, 19)
                       )::pg_catalog.uuid;
            END
            $body$
        $create$;
    END IF;
END
$install$;
