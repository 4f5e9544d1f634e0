-- outbox_dispatch without the library: before an install, who else could
-- plant an overload of an outbox_* function in the functions' schema ($1,
-- quoted), which a caller's call would resolve to. Run by `outbox-dispatch
-- install` (sidecar/src/install.rs), which refuses the schema when this
-- names anyone: each role that may create there, and each outbox_*
-- function there, whose holder is another's; PUBLIC for a grant to all.
--
-- A holder is the installer's own when it is the installer, a superuser,
-- or a role the installer acts for that no other role which logs in acts
-- for as well: CREATE granted to a group is every member's. A role acts
-- for a holder when it has the holder's privileges (USAGE) or may SET ROLE
-- to it, directly or through other groups, as pg_has_role() reads the
-- membership options of PostgreSQL 16 and later (before 16, every member
-- may SET ROLE). A role's administrators (ADMIN alone, CREATEROLE before
-- 16) could make themselves members, and are trusted as the installer's
-- own administrators are. The schema's owner may always grant itself
-- CREATE; pg_database_owner stands for the database's owner.
WITH me AS (
    SELECT r.oid,
           CASE WHEN pg_catalog.current_setting('server_version_num')::pg_catalog.int4
                     OPERATOR(pg_catalog.>=) 160000
                THEN 'USAGE, SET' ELSE 'MEMBER' END AS acting
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
), standing (holder, mine, shared, members) AS (
    -- Per holder: whether the installer acts for it; whether a role acts
    -- for it that logs in and is neither the installer nor a superuser (the
    -- holder itself, when it logs in); those of them that belong to it.
    SELECT h.holder,
           pg_catalog.pg_has_role(me.oid, h.holder, me.acting),
           pg_catalog.bool_or(r.oid IS NOT NULL),
           pg_catalog.array_agg(r.rolname::pg_catalog.text ORDER BY r.rolname)
               FILTER (WHERE r.oid OPERATOR(pg_catalog.<>) h.holder)
      FROM (SELECT DISTINCT holder FROM holders WHERE holder OPERATOR(pg_catalog.<>) 0) AS h
     CROSS JOIN me
      LEFT JOIN pg_catalog.pg_roles AS r
             ON r.rolcanlogin AND NOT r.rolsuper AND r.oid OPERATOR(pg_catalog.<>) me.oid
            AND pg_catalog.pg_has_role(r.oid, h.holder, me.acting)
     GROUP BY h.holder, me.oid, me.acting
)
SELECT coalesce(h.function,
                CASE WHEN h.holder OPERATOR(pg_catalog.=) 0 THEN 'PUBLIC'
                     WHEN s.members IS NULL THEN r.rolname::pg_catalog.text
                     ELSE pg_catalog.format('%s (which %s belongs to)', r.rolname,
                                            pg_catalog.array_to_string(s.members, ', '))
                END)
  FROM holders AS h
  LEFT JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) h.holder
  LEFT JOIN standing AS s ON s.holder OPERATOR(pg_catalog.=) h.holder
 WHERE NOT coalesce(r.rolsuper
                    OR h.holder OPERATOR(pg_catalog.=) (SELECT me.oid FROM me)
                    OR (s.mine AND NOT s.shared),
                    false)
 ORDER BY 1
