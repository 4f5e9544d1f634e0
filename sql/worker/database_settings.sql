-- The settings this database and the dispatchers' role chose for their
-- sessions (ALTER DATABASE … SET, ALTER ROLE … SET, ALTER ROLE … IN DATABASE
-- … SET), each with the server's own value to set back: the last line of
-- the configuration files that sets it, else its built-in default (role:
-- none). Read once, as a dispatcher starts (setup.rs). Catalogs of a few
-- rows, read whole.
SELECT o.name,
       CASE WHEN o.name = 'role' THEN 'none' ELSE
           coalesce((SELECT f.setting
                       FROM pg_catalog.pg_file_settings AS f
                      WHERE pg_catalog.lower(f.name) = o.name
                        AND f.error IS NULL
                      ORDER BY f.seqno DESC
                      LIMIT 1),
                    (SELECT s.boot_val
                       FROM pg_catalog.pg_settings AS s
                      WHERE pg_catalog.lower(s.name) = o.name)) END
  FROM (SELECT DISTINCT pg_catalog.lower(pg_catalog.split_part(c, '=', 1)) AS name
          FROM pg_catalog.pg_db_role_setting AS d,
               pg_catalog.unnest(d.setconfig) AS c
         WHERE d.setdatabase = ANY (ARRAY[0, (SELECT b.oid FROM pg_catalog.pg_database AS b
                                               WHERE b.datname = pg_catalog.current_database())])
           AND d.setrole = ANY (ARRAY[0, (SELECT r.oid FROM pg_catalog.pg_roles AS r
                                           WHERE r.rolname = session_user)])) AS o
 ORDER BY 1
