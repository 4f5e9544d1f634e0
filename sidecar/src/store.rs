//! The store's host outside the server: `outbox_core::store` on a
//! PostgreSQL client. Statements are prepared once per connection; a
//! transaction's deadline is kept by a watchdog thread that cancels the
//! statement running when it passes, as `statement_timeout` would.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use postgres::types::{ToSql, Type as PgType};
use postgres::{CancelToken, Client, IsolationLevel, Statement, Transaction};

use outbox_core::store::sql::{Arg, Db, DbError, Rows, Stmt, Tx, Type, Value};

use crate::script::VERSION;

/// SQLSTATE of a connection that failed (class 08).
const CONNECTION_FAILURE: &str = "08006";

fn db_error(e: postgres::Error) -> DbError {
    match e.as_db_error() {
        Some(db) => DbError::new(db.code().code(), db.message()),
        None => DbError::new(CONNECTION_FAILURE, crate::connect::chain(&e)),
    }
}

fn pg_type(t: Type) -> PgType {
    match t {
        Type::Bool => PgType::BOOL,
        Type::Int4 => PgType::INT4,
        Type::Int8 => PgType::INT8,
        Type::Float8 => PgType::FLOAT8,
        Type::Text => PgType::TEXT,
        Type::Oid => PgType::OID,
        Type::Uuid => PgType::UUID,
        Type::Int8Array => PgType::INT8_ARRAY,
        Type::Float8Array => PgType::FLOAT8_ARRAY,
        Type::BoolArray => PgType::BOOL_ARRAY,
        Type::TextArray => PgType::TEXT_ARRAY,
        Type::UuidArray => PgType::UUID_ARRAY,
    }
}

fn param(arg: &Arg) -> &(dyn ToSql + Sync) {
    match arg {
        Arg::Bool(b) => b,
        Arg::Int4(i) => i,
        Arg::Int8(i) => i,
        Arg::Float8(f) => f,
        Arg::Text(t) => t,
        Arg::Oid(o) => o,
        Arg::Uuid(u) => u,
        Arg::Int8Array(a) => a,
        Arg::Float8Array(a) => a,
        Arg::BoolArray(a) => a,
        Arg::TextArray(a) => a,
        Arg::UuidArray(a) => a,
    }
}

fn value(row: &postgres::Row, i: usize) -> Result<Value, DbError> {
    let unreadable = |e: postgres::Error| DbError::internal(format!("column {}: {e}", i + 1));
    let ty = row.columns()[i].type_().clone();
    let value = match ty {
        PgType::BOOL => row.try_get::<_, Option<bool>>(i).map_err(unreadable)?.map(Value::Bool),
        PgType::INT2 => row.try_get::<_, Option<i16>>(i).map_err(unreadable)?.map(|v| Value::Int(v.into())),
        PgType::INT4 => row.try_get::<_, Option<i32>>(i).map_err(unreadable)?.map(|v| Value::Int(v.into())),
        PgType::INT8 => row.try_get::<_, Option<i64>>(i).map_err(unreadable)?.map(Value::Int),
        PgType::OID => row.try_get::<_, Option<u32>>(i).map_err(unreadable)?.map(|v| Value::Int(v.into())),
        PgType::FLOAT8 => row.try_get::<_, Option<f64>>(i).map_err(unreadable)?.map(Value::Float),
        PgType::UUID => row.try_get::<_, Option<uuid::Uuid>>(i).map_err(unreadable)?.map(Value::Uuid),
        PgType::TEXT | PgType::VARCHAR | PgType::NAME | PgType::BPCHAR => {
            row.try_get::<_, Option<String>>(i).map_err(unreadable)?.map(Value::Text)
        }
        other => {
            return Err(DbError::internal(format!(
                "column {} is of type {other}, which no statement returns",
                i + 1
            )))
        }
    };
    Ok(value.unwrap_or(Value::Null))
}

/// When the watchdog cancels the statement running; `gone` once its
/// connection is dropped.
#[derive(Default)]
struct Armed {
    at: Option<Instant>,
    gone: bool,
}

/// Cancels the connection's statement once a deadline passes, from a
/// thread of its own (the connection's is blocked in the statement).
#[derive(Clone)]
pub struct Watchdog {
    armed: Arc<(Mutex<Armed>, Condvar)>,
}

impl Watchdog {
    fn new(cancel: impl Fn() + Send + 'static) -> Watchdog {
        let armed = Arc::new((Mutex::new(Armed::default()), Condvar::new()));
        let watched = Arc::clone(&armed);
        std::thread::spawn(move || {
            let (lock, changed) = &*watched;
            let mut armed = lock.lock().unwrap_or_else(|e| e.into_inner());
            while !armed.gone {
                match armed.at {
                    None => armed = changed.wait(armed).unwrap_or_else(|e| e.into_inner()),
                    Some(at) if at <= Instant::now() => {
                        armed.at = None;
                        // Unlocked: a cancel slow to connect must not hold
                        // up the next arm.
                        drop(armed);
                        cancel();
                        armed = lock.lock().unwrap_or_else(|e| e.into_inner());
                    }
                    Some(at) => {
                        armed = changed
                            .wait_timeout(armed, at - Instant::now())
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                }
            }
        });
        Watchdog { armed }
    }

    /// Cancels at `at` what runs then; `None`: at no time.
    fn arm(&self, at: Option<Instant>) {
        let (lock, changed) = &*self.armed;
        lock.lock().unwrap_or_else(|e| e.into_inner()).at = at;
        changed.notify_one();
    }

    /// Cancels what runs now: a shutdown.
    pub fn cancel_now(&self) {
        self.arm(Some(Instant::now()));
    }

    fn stop(&self) {
        let (lock, changed) = &*self.armed;
        lock.lock().unwrap_or_else(|e| e.into_inner()).gone = true;
        changed.notify_one();
    }
}

/// A dispatcher's connection: the store's transactions, and between them
/// what its host asks of the database (its leases, its settings), each
/// under a deadline its watchdog keeps. Its own: no other dispatcher waits
/// on it.
#[derive(Clone)]
pub struct Session {
    client: Rc<RefCell<Client>>,
    watchdog: Watchdog,
}

impl Session {
    /// `cancel` cancels what `client` runs (a new connection of its own).
    pub fn new(client: Client, cancel: impl Fn(&CancelToken) + Send + 'static) -> Session {
        let token = client.cancel_token();
        Session { client: Rc::new(RefCell::new(client)), watchdog: Watchdog::new(move || cancel(&token)) }
    }

    /// Runs `body` between the store's transactions, cancelled once it has
    /// run `deadline`.
    pub fn run<R>(
        &self,
        deadline: Duration,
        body: impl FnOnce(&mut Client) -> Result<R, postgres::Error>,
    ) -> Result<R, String> {
        let Ok(mut client) = self.client.try_borrow_mut() else {
            return Err("the connection is in a transaction of the store".into());
        };
        self.watchdog.arm(Some(Instant::now() + deadline));
        let result = body(&mut client);
        self.watchdog.arm(None);
        result.map_err(|e| crate::connect::chain(&e))
    }

    /// What cancels this connection's statement from another thread.
    pub fn watchdog(&self) -> Watchdog {
        self.watchdog.clone()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The last of the clones: nothing is left to watch.
        if Rc::strong_count(&self.client) == 1 {
            self.watchdog.stop();
        }
    }
}

/// The store's host on one connection.
pub struct PgDb {
    session: Session,
    statements: HashMap<Stmt, Statement>,
    /// This release was found installed (looked for once, again after a
    /// failure).
    installed: bool,
    /// Set once the connection is found closed.
    closed: Arc<AtomicBool>,
}

impl PgDb {
    pub fn new(session: Session) -> PgDb {
        PgDb { session, statements: HashMap::new(), installed: false, closed: Arc::default() }
    }

    /// A flag set once the connection is found closed: a new one is needed.
    pub fn closed(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.closed)
    }

    /// Whether the outbox of this release is installed.
    fn look(tx: &mut Transaction<'_>) -> Result<bool, DbError> {
        // Not a plain subquery: without the table, it would not parse.
        let installed: Option<String> = match tx
            .query_one("SELECT pg_catalog.to_regclass('outbox.installed') IS NOT NULL", &[])
            .map_err(db_error)?
            .get(0)
        {
            false => None,
            true => tx
                .query_opt("SELECT version FROM outbox.installed ORDER BY installed_at DESC LIMIT 1", &[])
                .map_err(db_error)?
                .map(|row| row.get(0)),
        };
        match installed {
            None => Ok(false),
            Some(version) if version == VERSION => Ok(true),
            Some(version) => Err(DbError::internal(format!(
                "outbox_dispatch {version} is installed in this database and this outbox-dispatch is \
                 {VERSION}: run the outbox-dispatch of {version}"
            ))),
        }
    }
}

impl Db for PgDb {
    fn transaction(
        &mut self,
        deadline: Duration,
        body: &mut dyn FnMut(&mut dyn Tx) -> Result<(), DbError>,
    ) -> Result<bool, DbError> {
        let ends_at = Instant::now() + deadline;
        let watchdog = &self.session.watchdog;
        let mut client = self.session.client.borrow_mut();
        watchdog.arm(Some(ends_at));
        let result = (|| {
            let mut tx = client
                .build_transaction()
                .isolation_level(IsolationLevel::ReadCommitted)
                .start()
                .map_err(db_error)?;
            if !self.installed {
                self.installed = PgDb::look(&mut tx)?;
                if !self.installed {
                    return Ok(false);
                }
            }
            let mut ptx = PgTx { tx, statements: &mut self.statements, ends_at, watchdog };
            body(&mut ptx)?;
            // Disarmed first: a cancel during a synchronous commit's wait
            // for a standby would return before the standby has it.
            watchdog.arm(None);
            ptx.tx.commit().map_err(db_error)?;
            Ok(true)
        })();
        watchdog.arm(None);
        if result.is_err() {
            self.installed = false;
            if client.is_closed() {
                self.closed.store(true, Ordering::SeqCst);
            }
        }
        result
    }
}

/// A transaction on the connection.
struct PgTx<'a, 't> {
    tx: Transaction<'t>,
    statements: &'a mut HashMap<Stmt, Statement>,
    ends_at: Instant,
    watchdog: &'a Watchdog,
}

impl Tx for PgTx<'_, '_> {
    fn run(&mut self, stmt: Stmt, args: &[Arg]) -> Result<Rows, DbError> {
        let statement = match self.statements.get(&stmt) {
            Some(statement) => statement.clone(),
            None => {
                let types: Vec<PgType> = stmt.params().iter().map(|t| pg_type(*t)).collect();
                let statement = self.tx.prepare_typed(stmt.sql(), &types).map_err(db_error)?;
                self.statements.insert(stmt, statement.clone());
                statement
            }
        };
        let mut iter = self.tx.query_raw(&statement, args.iter().map(param)).map_err(db_error)?;
        let mut rows = Vec::new();
        while let Some(row) =
            postgres::fallible_iterator::FallibleIterator::next(&mut iter).map_err(db_error)?
        {
            rows.push((0..row.len()).map(|i| value(&row, i)).collect::<Result<Vec<_>, _>>()?);
        }
        let touched = iter.rows_affected().unwrap_or(rows.len() as u64);
        Ok(Rows { rows, touched })
    }

    fn run_text(&mut self, sql: &'static str) -> Result<(), DbError> {
        self.tx.batch_execute(sql).map_err(db_error)
    }

    fn subtransaction(
        &mut self,
        until: Instant,
        body: &mut dyn FnMut(&mut dyn Tx) -> Result<(), DbError>,
    ) -> Result<(), DbError> {
        self.watchdog.arm(Some(until.min(self.ends_at)));
        let result = (|| {
            let savepoint = self.tx.savepoint("outbox_dispatch").map_err(db_error)?;
            let mut inner = PgTx {
                tx: savepoint,
                statements: &mut *self.statements,
                ends_at: until.min(self.ends_at),
                watchdog: self.watchdog,
            };
            let done = body(&mut inner);
            match done {
                Ok(()) => inner.tx.commit().map_err(db_error),
                Err(e) => {
                    inner.tx.rollback().map_err(db_error)?;
                    Err(e)
                }
            }
        })();
        self.watchdog.arm(Some(self.ends_at));
        result
    }

    fn time_left(&self) -> Duration {
        self.ends_at.saturating_duration_since(Instant::now())
    }
}
