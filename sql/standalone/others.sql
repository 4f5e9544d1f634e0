-- outbox_dispatch without the library: before an install, who else could
-- plant an overload of an outbox_* function in the functions' schema ($1,
-- quoted), which a caller's call would resolve to. Run by `outbox-dispatch
-- install` (sidecar/src/install.rs), which refuses the schema when this
-- names anyone: each role that may create there, and each outbox_*
-- function there, whose holder is another's; PUBLIC for a grant to all.
--
-- A holder is the installer's own when it is the installer, a superuser,
-- or a group the installer belongs to that no other role which logs in
-- belongs to as well, directly or through another group: CREATE granted to
-- a group is every member's. The schema's owner may always grant itself
-- CREATE; pg_database_owner stands for the database's owner. A superuser
-- installing is a member of every role, so its membership is read from
-- pg_auth_members, not pg_has_role.
WITH RECURSIVE me AS (
    SELECT r.oid FROM pg_catalog.pg_roles AS r WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER
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
), acting (holder, role) AS (
    -- Each holder, and every role that belongs to it, however deep.
    SELECT DISTINCT h.holder, h.holder FROM holders AS h WHERE h.holder OPERATOR(pg_catalog.<>) 0
    UNION
    SELECT a.holder, m.member
      FROM acting AS a
      JOIN pg_catalog.pg_auth_members AS m ON m.roleid OPERATOR(pg_catalog.=) a.role
), standing (holder, mine, shared, members) AS (
    -- Per holder: whether the installer acts for it; whether a role that
    -- logs in and is neither the installer nor a superuser does (the
    -- holder itself too); those of them that belong to it, to name.
    SELECT a.holder,
           pg_catalog.bool_or(a.role OPERATOR(pg_catalog.=) me.oid),
           pg_catalog.bool_or(r.rolcanlogin AND NOT r.rolsuper AND r.oid OPERATOR(pg_catalog.<>) me.oid),
           pg_catalog.string_agg(r.rolname::pg_catalog.text, ', ' ORDER BY r.rolname)
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
                     ELSE pg_catalog.format('%s (which %s belongs to)', r.rolname, s.members)
                END)
  FROM holders AS h
  LEFT JOIN pg_catalog.pg_roles AS r ON r.oid OPERATOR(pg_catalog.=) h.holder
  LEFT JOIN standing AS s ON s.holder OPERATOR(pg_catalog.=) h.holder
 CROSS JOIN me
 WHERE h.holder OPERATOR(pg_catalog.=) 0
    OR NOT (coalesce(r.rolsuper, false) OR h.holder OPERATOR(pg_catalog.=) me.oid OR (s.mine AND NOT s.shared))
 ORDER BY 1
