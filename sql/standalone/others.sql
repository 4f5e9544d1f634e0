-- outbox_dispatch without the library: before an install, who else could
-- plant an overload of an outbox_* function in the functions' schema ($1,
-- quoted), which a caller's call would resolve to. Run by `outbox-dispatch
-- install` (sidecar/src/install.rs), which refuses the schema when this
-- names anyone: each role that may create there, and each outbox_*
-- function there, whose holder is another's; PUBLIC for a grant to all.
--
-- A holder of CREATE is the installer's own when it is the installer, a
-- superuser, or a role the installer acts for that no other role which
-- logs in acts for as well: CREATE granted to a group is every member's. A
-- role acts for a holder when it has the holder's privileges, or may SET
-- ROLE to a role that has them: from PostgreSQL 16 pg_has_role() reads
-- USAGE (inherited, every grant of the chain with INHERIT) and SET (every
-- grant with SET) apart, and SET ROLE is checked against the role that
-- logged in, so a role may SET ROLE to one that inherits the holder's
-- privileges; before 16, every member may do both (MEMBER). A role's
-- administrators (ADMIN alone, CREATEROLE before 16) could make themselves
-- members, and are trusted as the installer's own administrators are. The
-- schema's owner may always grant itself CREATE; pg_database_owner stands
-- for the database's owner. An outbox_* function already there is what a
-- caller's call would find: it must be the installer's or a superuser's.
WITH me AS (
    SELECT r.oid,
           pg_catalog.current_setting('server_version_num')::pg_catalog.int4 OPERATOR(pg_catalog.>=) 160000
               AS options
      FROM pg_catalog.pg_roles AS r
     WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER
), schema AS (
    SELECT n.oid, n.nspowner, n.nspacl, d.datdba
      FROM pg_catalog.pg_namespace AS n
      JOIN pg_catalog.pg_database AS d ON d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
     WHERE n.oid OPERATOR(pg_catalog.=) pg_catalog.to_regnamespace($1)
), holders (holder, function) AS (
    SELECT DISTINCT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 'pg_database_owner'::pg_catalog.regrole
                         THEN s.datdba ELSE a.grantee END,
                    NULL::pg_catalog.text
      FROM schema AS s
     CROSS JOIN LATERAL (SELECT e.grantee
                           FROM pg_catalog.aclexplode(coalesce(s.nspacl,
                                    pg_catalog.acldefault('n', s.nspowner))) AS e
                          WHERE e.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
                         UNION
                         SELECT s.nspowner) AS a
    UNION ALL
    SELECT p.proowner, p.oid::pg_catalog.regprocedure::pg_catalog.text
      FROM pg_catalog.pg_proc AS p
      JOIN schema AS s ON p.pronamespace OPERATOR(pg_catalog.=) s.oid
     WHERE p.proname OPERATOR(pg_catalog.~~) 'outbox\_%'
), heirs (holder, heir) AS (
    -- The roles that have each holder's privileges, the holder among them.
    SELECT h.holder, x.oid
      FROM (SELECT DISTINCT holder FROM holders
             WHERE function IS NULL AND holder OPERATOR(pg_catalog.<>) 0) AS h
     CROSS JOIN me
      JOIN pg_catalog.pg_roles AS x
        ON pg_catalog.pg_has_role(x.oid, h.holder, CASE WHEN me.options THEN 'USAGE' ELSE 'MEMBER' END)
), acting (holder, role) AS (
    -- The roles that have them, or may SET ROLE to a role that has them.
    SELECT DISTINCT e.holder, r.oid
      FROM heirs AS e
     CROSS JOIN me
      JOIN pg_catalog.pg_roles AS r
        ON pg_catalog.pg_has_role(r.oid, e.heir, CASE WHEN me.options THEN 'SET' ELSE 'MEMBER' END)
), standing (holder, mine, shared, members) AS (
    -- Per holder: whether the installer acts for it; whether a role acts
    -- for it that logs in and is neither the installer nor a superuser (the
    -- holder itself, when it logs in); those of them that belong to it.
    SELECT a.holder,
           pg_catalog.bool_or(a.role OPERATOR(pg_catalog.=) me.oid),
           pg_catalog.bool_or(r.rolcanlogin AND NOT r.rolsuper AND r.oid OPERATOR(pg_catalog.<>) me.oid),
           pg_catalog.array_agg(r.rolname::pg_catalog.text ORDER BY r.rolname)
               FILTER (WHERE r.rolcanlogin AND NOT r.rolsuper AND r.oid OPERATOR(pg_catalog.<>) me.oid
                             AND r.oid OPERATOR(pg_catalog.<>) a.holder)
      FROM acting AS a
      JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) a.role
     CROSS JOIN me
     GROUP BY a.holder
)
SELECT coalesce(h.function,
                CASE WHEN h.holder OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                     WHEN s.members IS NULL THEN r.rolname::pg_catalog.text
                     ELSE pg_catalog.format('%s (which %s belongs to)', r.rolname,
                                            pg_catalog.array_to_string(s.members, ', '))
                END)
  FROM holders AS h
  LEFT JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) h.holder
  LEFT JOIN standing AS s ON s.holder OPERATOR(pg_catalog.=) h.holder AND h.function IS NULL
 WHERE NOT coalesce(r.rolsuper
                    OR h.holder OPERATOR(pg_catalog.=) (SELECT me.oid FROM me)
                    OR (s.mine AND NOT s.shared),
                    false)
 ORDER BY 1
