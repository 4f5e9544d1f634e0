//! `outbox-dispatch install`: the schema and the SQL API, installed into a
//! database by its owner as a migration would, in one transaction, after
//! checks that name what is missing; or an outbox an earlier release
//! installed, updated to this one.

use std::fmt;

use postgres::{Client, IsolationLevel, Transaction};

use crate::script::{self, ScriptError, VERSION};

/// What an install did.
#[derive(Debug, PartialEq, Eq)]
pub enum Installed {
    /// The schema and the API were created.
    Now,
    /// This release was installed already: nothing was done.
    Already,
    /// The outbox of this earlier release was updated to this one.
    Updated(String),
}

/// Why an install did nothing.
#[derive(Debug)]
pub enum InstallError {
    /// The database refused a statement, or the connection broke.
    Database(postgres::Error),
    /// The database is not one to install into, or the role may not: the
    /// reason, and what to do.
    Refused(String),
}

impl fmt::Display for InstallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InstallError::Database(e) => match e.as_db_error() {
                Some(db) => write!(f, "{}: {} ({})", db.severity(), db.message(), db.code().code()),
                None => write!(f, "{e}"),
            },
            InstallError::Refused(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for InstallError {}

impl From<postgres::Error> for InstallError {
    fn from(e: postgres::Error) -> Self {
        InstallError::Database(e)
    }
}

impl From<ScriptError> for InstallError {
    fn from(e: ScriptError) -> Self {
        InstallError::Refused(e.to_string())
    }
}

/// How long the install waits for any one lock: a session that holds one
/// it needs (a long transaction of the application, during an update)
/// makes it fail, naming that session, rather than wait for ever, and
/// rather than queue every writer behind its request.
const LOCK_WAIT: &str = "10s";
/// SQLSTATEs of a lock not granted in time; of a schema made by a
/// concurrent install that committed first (outbox's row of pg_namespace).
const LOCK_NOT_AVAILABLE: &str = "55P03";
const UNIQUE_VIOLATION: &str = "23505";
const DUPLICATE_SCHEMA: &str = "42P06";

/// Who else could plant an outbox_* function in the functions' schema ($1):
/// the roles that may create there and the functions there that are not
/// the installing role's own, each named.
const OTHERS: &str = include_str!("../../sql/standalone/others.sql");

/// Installs this release into the database `client` is connected to, its
/// functions into `schema`; a no-op where it is installed already. Two
/// installs at once: the second waits for the first's schema, and finds
/// it installed. A lock not granted within [`LOCK_WAIT`] ends it, naming
/// the sessions that hold locks in the database.
pub fn install(client: &mut Client, schema: &str) -> Result<Installed, InstallError> {
    match install_once(client, schema) {
        Err(InstallError::Database(e))
            if sqlstate(&e) == Some(UNIQUE_VIOLATION) || sqlstate(&e) == Some(DUPLICATE_SCHEMA) =>
        {
            install_once(client, schema)
        }
        Err(InstallError::Database(e)) if sqlstate(&e) == Some(LOCK_NOT_AVAILABLE) => {
            Err(InstallError::Refused(waited(client, &e)))
        }
        done => done,
    }
}

fn sqlstate(e: &postgres::Error) -> Option<&str> {
    e.as_db_error().map(|db| db.code().code())
}

/// What an install that waited [`LOCK_WAIT`] for a lock says: the lock
/// PostgreSQL names, and the sessions holding locks in the database
/// (the one it waited for among them, unless it ended since). Read after
/// the install's transaction, whose search_path pin ended with it: every
/// name is qualified, operators included.
fn waited(client: &mut Client, error: &postgres::Error) -> String {
    let holders: Vec<String> = client
        .query(
            "SELECT pg_catalog.format('pid %s (role %s, application %L, %s)', a.pid, a.usename, \
                                      a.application_name, \
                                      CASE WHEN a.state IS NULL THEN 'a transaction this role may not see' \
                                           ELSE pg_catalog.format('%s since %s', a.state, a.state_change) END) \
               FROM pg_catalog.pg_stat_activity AS a \
              WHERE a.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid() \
                AND a.pid OPERATOR(pg_catalog.=) ANY (SELECT l.pid FROM pg_catalog.pg_locks AS l \
                                                       WHERE l.granted AND l.locktype OPERATOR(pg_catalog.<>) 'virtualxid' \
                                                         AND (l.database OPERATOR(pg_catalog.=) a.datid \
                                                              OR l.locktype OPERATOR(pg_catalog.=) 'transactionid')) \
                AND a.datname OPERATOR(pg_catalog.=) pg_catalog.current_database() \
              ORDER BY a.xact_start NULLS LAST, a.pid",
            &[],
        )
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default();
    let message = error.as_db_error().map_or_else(|| error.to_string(), |db| db.message().to_string());
    let held = match holders.is_empty() {
        true => "no session holds one now: run it again".to_string(),
        false => format!(
            "sessions holding locks in the database: {}; end them or run it again",
            holders.join("; ")
        ),
    };
    format!("the install waited {LOCK_WAIT} for a lock and gave up ({message}); {held}")
}

fn install_once(client: &mut Client, schema: &str) -> Result<Installed, InstallError> {
    let script = script::script(schema)?;
    // READ COMMITTED whatever the role's default: the checks after the lock
    // see what an install that held it committed.
    let mut tx = client.build_transaction().isolation_level(IsolationLevel::ReadCommitted).start()?;
    // What the database's owner or the role's settings gave the session is
    // nobody's to trust: no name of the checks, the script or the update
    // resolves through their search_path, and their text reads as written.
    tx.batch_execute(
        "SET LOCAL search_path = pg_catalog, pg_temp; \
         SET LOCAL standard_conforming_strings = on; \
         SET LOCAL array_nulls = on; \
         SET LOCAL transform_null_equals = off; \
         SET LOCAL DateStyle = 'ISO, YMD'; \
         SET LOCAL IntervalStyle = postgres",
    )?;
    tx.batch_execute(&format!(
        "SET LOCAL lock_timeout = '{LOCK_WAIT}'; SET LOCAL application_name = 'outbox-dispatch install'"
    ))?;
    refuse_a_role_the_database_chose(&mut tx)?;
    if let Some(installed) = installed_version(&mut tx)? {
        if installed == VERSION {
            return Ok(Installed::Already);
        }
        // Two updates at once take turns on the outbox's own table, which
        // only its owner may lock: the second reads the release again.
        tx.batch_execute("LOCK TABLE outbox.installed IN SHARE ROW EXCLUSIVE MODE")?;
        let installed: String = tx.query_one("SELECT version FROM outbox.installed", &[])?.get(0);
        if installed == VERSION {
            return Ok(Installed::Already);
        }
        let update = script::update(&installed, schema).map_err(|e| {
            InstallError::Refused(format!(
                "outbox_dispatch {installed} is installed in this database, and {e}: run the \
                 outbox-dispatch of {installed}"
            ))
        })?;
        refuse_another_schema(&mut tx, &installed, schema)?;
        refuse_others(&mut tx, schema)?;
        tx.batch_execute(&update)?;
        refuse_others(&mut tx, schema)?;
        tx.commit()?;
        return Ok(Installed::Updated(installed));
    }
    check_privileges(&mut tx, schema)?;
    tx.batch_execute(&script)?;
    // Again, as the last statement: a grant, or another's function,
    // committed while the script ran is seen now (READ COMMITTED).
    refuse_others(&mut tx, schema)?;
    tx.commit()?;
    Ok(Installed::Now)
}

/// Refuses a session whose role the database's settings switched (ALTER
/// DATABASE ... SET role): its owner, who may not be the installer, would
/// choose who owns the outbox. The role's own settings, or the client's,
/// are the installer's choice.
fn refuse_a_role_the_database_chose(tx: &mut Transaction<'_>) -> Result<(), InstallError> {
    let row = tx.query_one(
        "SELECT session_user::text, current_user::text, current_database()::text,
                EXISTS (SELECT FROM pg_db_role_setting AS s
                          JOIN pg_database AS d ON d.oid = s.setdatabase
                         CROSS JOIN LATERAL unnest(s.setconfig) AS c (setting)
                         WHERE d.datname = current_database() AND s.setrole = 0
                           AND c.setting LIKE 'role=%')",
        &[],
    )?;
    let (connected, acting, database, chosen): (String, String, String, bool) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if connected == acting || !chosen {
        return Ok(());
    }
    Err(InstallError::Refused(format!(
        "the session runs as role \"{acting}\", not \"{connected}\" who connected, and the database's \
         settings set a role (ALTER DATABASE {db} SET role): its owner would choose who owns the outbox; \
         ALTER DATABASE {db} RESET role first",
        db = script::quote_ident(&database)
    )))
}

/// Refuses to update an outbox whose functions are in another schema than
/// `schema`: the update would put its functions beside, not in place of,
/// those the outbox calls (its id default, outbox_uuid_v7()).
fn refuse_another_schema(
    tx: &mut Transaction<'_>,
    installed: &str,
    schema: &str,
) -> Result<(), InstallError> {
    let row = tx.query_opt(
        "SELECT p.pronamespace::regnamespace::text, p.pronamespace = to_regnamespace($1)
           FROM pg_attrdef AS d
           JOIN pg_depend AS e ON e.classid = 'pg_attrdef'::regclass AND e.objid = d.oid
                              AND e.refclassid = 'pg_proc'::regclass
           JOIN pg_proc AS p ON p.oid = e.refobjid
          WHERE d.adrelid = 'outbox.log'::regclass AND p.proname = 'outbox_uuid_v7'",
        &[&script::quote_ident(schema)],
    )?;
    match row.map(|row| (row.get::<_, String>(0), row.get::<_, Option<bool>>(1))) {
        Some((_, Some(true))) => Ok(()),
        Some((theirs, _)) => Err(InstallError::Refused(format!(
            "outbox_dispatch {installed} put its functions in schema {theirs}, not \"{schema}\": \
             update with --schema {theirs}"
        ))),
        None => Err(InstallError::Refused(format!(
            "outbox_dispatch {installed} is installed, but outbox.log's id default calls no \
             outbox_uuid_v7(): the schema was changed by hand, and is not updated"
        ))),
    }
}

/// The release installed without the library, if any; refuses a database
/// with the extension, or with a schema `outbox` of something else.
fn installed_version(tx: &mut Transaction<'_>) -> Result<Option<String>, InstallError> {
    let row = tx.query_one(
        "SELECT (SELECT x.extversion FROM pg_catalog.pg_extension AS x WHERE x.extname = 'outbox_dispatch'),
                pg_catalog.to_regnamespace('outbox') IS NOT NULL,
                EXISTS (SELECT FROM pg_catalog.pg_class AS c JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
                         WHERE n.nspname = 'outbox' AND c.relname = 'installed'),
                pg_catalog.current_database()::pg_catalog.text",
        &[],
    )?;
    let (extension, schema, table, database): (Option<String>, bool, bool, String) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if let Some(version) = extension {
        return Err(InstallError::Refused(format!(
            "database \"{database}\" has the extension outbox_dispatch {version}: it is served by the \
             library's own dispatchers, and needs no install (ALTER EXTENSION outbox_dispatch UPDATE \
             updates it)"
        )));
    }
    if !schema {
        return Ok(None);
    }
    if !table {
        return Err(InstallError::Refused(format!(
            "database \"{database}\" has a schema \"outbox\" that outbox-dispatch did not install: \
             rename or drop it first"
        )));
    }
    // Installed by this role, not made to look installed by another: the
    // schema and a plain table `installed` both this role's, so that what
    // reads and updates it runs no code of another's (a trigger, a rule, a
    // view), even for a role that holds every other's privileges.
    let row = tx.query_one(
        "SELECT n.nspowner::pg_catalog.regrole::pg_catalog.text,
                n.nspowner = c.relowner AND c.relowner = (SELECT r.oid FROM pg_catalog.pg_roles AS r
                                                            WHERE r.rolname = current_user)
                AND c.relkind = 'r' AND NOT c.relhasrules AND NOT c.relhastriggers
           FROM pg_catalog.pg_namespace AS n, pg_catalog.pg_class AS c
          WHERE n.nspname = 'outbox' AND c.relnamespace = n.oid AND c.relname = 'installed'",
        &[],
    )?;
    let (owner, ours): (String, bool) = (row.get(0), row.get(1));
    if !ours {
        return Err(InstallError::Refused(format!(
            "schema \"outbox\" of database \"{database}\" belongs to role {owner}, or its table \
             outbox.installed is not as outbox-dispatch made it: install as {owner}, or check who made it"
        )));
    }
    let version: String = tx.query_one("SELECT version FROM outbox.installed", &[])?.get(0);
    Ok(Some(version))
}

/// The privileges the script needs, each named with the GRANT that gives
/// it when it is missing; a warning for the one the rotation wants.
fn check_privileges(tx: &mut Transaction<'_>, schema: &str) -> Result<(), InstallError> {
    let row = tx.query_one(
        "SELECT current_user::pg_catalog.text, pg_catalog.current_database()::pg_catalog.text,
                pg_catalog.has_database_privilege(pg_catalog.current_database(), 'CREATE'),
                pg_catalog.to_regnamespace($1) IS NOT NULL,
                pg_catalog.to_regnamespace($1) IS NOT NULL
                    AND pg_catalog.has_schema_privilege(pg_catalog.to_regnamespace($1), 'CREATE'),
                pg_catalog.pg_has_role('pg_read_all_stats', 'USAGE')",
        &[&script::quote_ident(schema)],
    )?;
    let (role, database): (String, String) = (row.get(0), row.get(1));
    let (create_schema, schema_exists, create_in_schema, read_stats): (bool, bool, bool, bool) =
        (row.get(2), row.get(3), row.get(4), row.get(5));
    if !create_schema {
        return Err(InstallError::Refused(format!(
            "role \"{role}\" lacks CREATE on database \"{database}\", which creating schema outbox needs \
             (GRANT CREATE ON DATABASE {db} TO {r})",
            db = script::quote_ident(&database),
            r = script::quote_ident(&role)
        )));
    }
    if !schema_exists {
        return Err(InstallError::Refused(format!(
            "schema \"{schema}\" (--schema, for the functions) does not exist in database \"{database}\""
        )));
    }
    if !create_in_schema {
        return Err(InstallError::Refused(format!(
            "role \"{role}\" lacks CREATE on schema \"{schema}\", which the functions go into \
             (GRANT CREATE ON SCHEMA {s} TO {r}, or --schema another)",
            s = script::quote_ident(schema),
            r = script::quote_ident(&role)
        )));
    }
    refuse_others(tx, schema)?;
    if !read_stats {
        eprintln!(
            "outbox-dispatch: warning: role \"{role}\" is not a member of pg_read_all_stats: the \
             dispatchers' rotation cannot see other roles' open transactions, and will not truncate \
             (GRANT pg_read_all_stats TO {})",
            script::quote_ident(&role)
        );
    }
    Ok(())
}

/// Refuses a functions' schema where another role may create, or made an
/// outbox_* function (sql/standalone/others.sql says who counts as
/// another).
fn refuse_others(tx: &mut Transaction<'_>, schema: &str) -> Result<(), InstallError> {
    let others: Vec<String> =
        tx.query(OTHERS, &[&script::quote_ident(schema)])?.iter().map(|row| row.get(0)).collect();
    if others.is_empty() {
        return Ok(());
    }
    Err(InstallError::Refused(format!(
        "schema \"{schema}\" is open to others: {} may create in it or made functions there, which \
         could stand in for outbox_* functions; revoke CREATE from them, or --schema one only this \
         role creates in",
        others.join(", ")
    )))
}
