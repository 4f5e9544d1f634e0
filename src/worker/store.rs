//! The dispatcher's store in the server: `outbox_core::store` on SPI. The
//! statements are prepared once per dispatcher and kept; each transaction
//! is PostgreSQL's own (worker_spi's calls), with a deadline armed as
//! `statement_timeout` and subtransactions as PL/pgSQL's.

use std::ffi::CString;
use std::time::{Duration, Instant};

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{PgBuiltInOids, PgOid};
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiError};
use pgrx::{PgSqlErrorCode, PgTryBuilder};

use outbox_core::store::sql::{Arg, Db, DbError, Rows, Stmt, Tx, Type, Value};

unsafe extern "C-unwind" {
    /// utils/timeout.h, which pgrx does not bind.
    fn enable_timeout_after(id: u32, delay_ms: std::ffi::c_int);
    fn disable_timeout(id: u32, keep_indicator: bool);
}

/// `STATEMENT_TIMEOUT` of utils/timeout.h's `TimeoutId`: the fourth
/// predefined reason in every PostgreSQL this builds for (15 to 18).
const STATEMENT_TIMEOUT: u32 = 3;

const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");
const INSTALLED_VERSION: &str =
    "SELECT extversion FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'outbox_dispatch'";

/// A prepared statement and its text, which `pg_stat_activity` shows while
/// it runs.
struct Plan {
    plan: OwnedPreparedStatement,
    text: CString,
}

/// The plans of every [`Stmt`], in [`Stmt::ALL`]'s order, prepared the
/// first time the extension is found and kept for the life of the
/// dispatcher.
struct Plans(Vec<Plan>);

impl Plans {
    fn prepare(client: &SpiClient<'_>) -> Result<Plans, SpiError> {
        Stmt::ALL
            .iter()
            .map(|stmt| {
                let types: Vec<PgOid> = stmt.params().iter().map(|t| pg_type(*t)).collect();
                let plan = client.prepare_mut(stmt.sql(), &types)?.keep();
                Ok(Plan { plan, text: CString::new(stmt.sql()).expect("no NUL in SQL files") })
            })
            .collect::<Result<_, _>>()
            .map(Plans)
    }

    fn of(&self, stmt: Stmt) -> &Plan {
        &self.0[stmt.index()]
    }
}

fn pg_type(t: Type) -> PgOid {
    PgOid::BuiltIn(match t {
        Type::Bool => PgBuiltInOids::BOOLOID,
        Type::Int4 => PgBuiltInOids::INT4OID,
        Type::Int8 => PgBuiltInOids::INT8OID,
        Type::Float8 => PgBuiltInOids::FLOAT8OID,
        Type::Text => PgBuiltInOids::TEXTOID,
        Type::Oid => PgBuiltInOids::OIDOID,
        Type::Uuid => PgBuiltInOids::UUIDOID,
        Type::Int8Array => PgBuiltInOids::INT8ARRAYOID,
        Type::Float8Array => PgBuiltInOids::FLOAT8ARRAYOID,
        Type::BoolArray => PgBuiltInOids::BOOLARRAYOID,
        Type::TextArray => PgBuiltInOids::TEXTARRAYOID,
        Type::UuidArray => PgBuiltInOids::UUIDARRAYOID,
    })
}

fn pg_uuid(id: uuid::Uuid) -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(id.into_bytes())
}

fn datum(arg: &Arg) -> DatumWithOid<'static> {
    match arg {
        Arg::Bool(b) => (*b).into(),
        Arg::Int4(i) => (*i).into(),
        Arg::Int8(i) => (*i).into(),
        Arg::Float8(f) => (*f).into(),
        Arg::Text(t) => t.clone().into(),
        Arg::Oid(o) => pg_sys::Oid::from(*o).into(),
        Arg::Uuid(u) => u.map(pg_uuid).into(),
        Arg::Int8Array(a) => a.clone().into(),
        Arg::Float8Array(a) => a.clone().into(),
        Arg::BoolArray(a) => a.clone().into(),
        Arg::TextArray(a) => a.clone().into(),
        Arg::UuidArray(a) => a.iter().copied().map(pg_uuid).collect::<Vec<_>>().into(),
    }
}

fn db_error(e: SpiError) -> DbError {
    DbError::internal(e.to_string())
}

/// The rows of an SPI result, each column read by the kind of its type.
fn rows_of(table: pgrx::spi::SpiTupleTable<'_>) -> Result<Rows, DbError> {
    let touched = table.len() as u64;
    let Ok(columns) = table.columns() else {
        // A statement that returns no rows.
        return Ok(Rows { rows: Vec::new(), touched });
    };
    let types = (1..=columns)
        .map(|i| table.column_type_oid(i).map(|oid| oid.value()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(db_error)?;
    let mut rows = Vec::with_capacity(table.len());
    for row in table {
        let mut values = Vec::with_capacity(columns);
        for (i, oid) in types.iter().enumerate() {
            values.push(value(&row, i + 1, *oid).map_err(db_error)?);
        }
        rows.push(values);
    }
    Ok(Rows { rows, touched })
}

fn value(row: &pgrx::spi::SpiHeapTupleData<'_>, ordinal: usize, oid: pg_sys::Oid) -> Result<Value, SpiError> {
    let or_null = |v: Option<Value>| v.unwrap_or(Value::Null);
    Ok(or_null(match oid {
        pg_sys::BOOLOID => row.get::<bool>(ordinal)?.map(Value::Bool),
        pg_sys::INT2OID => row.get::<i16>(ordinal)?.map(|i| Value::Int(i.into())),
        pg_sys::INT4OID => row.get::<i32>(ordinal)?.map(|i| Value::Int(i.into())),
        pg_sys::INT8OID => row.get::<i64>(ordinal)?.map(Value::Int),
        pg_sys::OIDOID => row.get::<pg_sys::Oid>(ordinal)?.map(|o| Value::Int(o.to_u32().into())),
        pg_sys::FLOAT8OID => row.get::<f64>(ordinal)?.map(Value::Float),
        pg_sys::UUIDOID => {
            row.get::<pgrx::Uuid>(ordinal)?.map(|u| Value::Uuid(uuid::Uuid::from_bytes(*u.as_bytes())))
        }
        pg_sys::TEXTOID | pg_sys::VARCHAROID | pg_sys::NAMEOID | pg_sys::BPCHAROID => {
            row.get::<String>(ordinal)?.map(Value::Text)
        }
        _ => row.get::<pgrx::AnyElement>(ordinal)?.map(|any| Value::Text(output_text(any.datum(), oid))),
    }))
}

/// A value of any other type as its type's output function writes it.
fn output_text(datum: pg_sys::Datum, oid: pg_sys::Oid) -> String {
    let (mut output, mut varlena) = (pg_sys::InvalidOid, false);
    // SAFETY: a catalog lookup and the type's own output function, of a
    // datum of that type, inside the transaction that read it.
    unsafe {
        pg_sys::getTypeOutputInfo(oid, &mut output, &mut varlena);
        let text = pg_sys::OidOutputFunctionCall(output, datum);
        std::ffi::CStr::from_ptr(text).to_string_lossy().into_owned()
    }
}

/// A transaction's statements through SPI: the kept plans, or (for the SQL
/// functions, which run once per call) the statements' text.
pub struct SpiTx<'a, 'c> {
    client: &'a mut SpiClient<'c>,
    plans: Option<&'a Plans>,
}

impl<'a, 'c> SpiTx<'a, 'c> {
    /// The statements as text, in the calling session's transaction.
    pub fn unprepared(client: &'a mut SpiClient<'c>) -> Self {
        SpiTx { client, plans: None }
    }
}

impl Tx for SpiTx<'_, '_> {
    fn run(&mut self, stmt: Stmt, args: &[Arg]) -> Result<Rows, DbError> {
        let args: Vec<DatumWithOid> = args.iter().map(datum).collect();
        let table = match self.plans {
            Some(plans) => {
                let plan = plans.of(stmt);
                report_running(&plan.text);
                if stmt.reads_only() {
                    self.client.select(&plan.plan, None, &args)
                } else {
                    self.client.update(&plan.plan, None, &args)
                }
            }
            None => self.client.update(stmt.sql(), None, &args),
        };
        rows_of(table.map_err(db_error)?)
    }

    fn run_text(&mut self, sql: &'static str) -> Result<(), DbError> {
        self.client.update(sql, None, &[]).map_err(db_error)?;
        Ok(())
    }

    fn subtransaction(
        &mut self,
        until: Instant,
        body: &mut dyn FnMut(&mut dyn Tx) -> Result<(), DbError>,
    ) -> Result<(), DbError> {
        within(until, || subtransaction(|| body(self)))
    }

    fn time_left(&self) -> Duration {
        time_left()
    }
}

/// The store's host in the server.
#[derive(Default)]
pub struct SpiDb {
    plans: Option<Plans>,
}

impl Db for SpiDb {
    fn transaction(
        &mut self,
        deadline: Duration,
        body: &mut dyn FnMut(&mut dyn Tx) -> Result<(), DbError>,
    ) -> Result<bool, DbError> {
        let plans = &mut self.plans;
        transaction(deadline, || {
            if !extension_exists() {
                *plans = None;
                return Ok(false);
            }
            if plans.is_none() {
                let installed =
                    crate::read_one::<String>(INSTALLED_VERSION).map_err(db_error)?.unwrap_or_default();
                if installed != LIBRARY_VERSION {
                    return Err(DbError::internal(format!(
                        "outbox_dispatch {installed} is installed in this database and the library is \
                         {LIBRARY_VERSION}: run ALTER EXTENSION outbox_dispatch UPDATE"
                    )));
                }
            }
            Spi::connect_mut(|client| {
                if plans.is_none() {
                    *plans = Some(Plans::prepare(client).map_err(db_error)?);
                }
                let plans = plans.as_ref().expect("prepared above");
                body(&mut SpiTx { client, plans: Some(plans) })?;
                Ok(true)
            })
        })
    }
}

/// `pg_stat_activity` shows the dispatcher running `what`.
pub fn report_running(what: &std::ffi::CStr) {
    // SAFETY: PostgreSQL copies the text.
    unsafe { pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_RUNNING, what.as_ptr()) };
}

/// Is the extension created? The catalog cache answers first; when it says
/// no, the catalog itself is read with a fresh snapshot. The commit of
/// `CREATE EXTENSION` wakes the dispatchers from its commit callback,
/// before it sends its cache invalidations, and PostgreSQL 18 looks
/// extensions up through a cache: a negative entry kept from before would
/// hide the new extension, and the wake would be lost.
fn extension_exists() -> bool {
    // SAFETY: a catalog lookup inside a transaction.
    let cached =
        unsafe { pg_sys::get_extension_oid(c"outbox_dispatch".as_ptr(), true) != pg_sys::InvalidOid };
    cached
        || crate::read_one::<bool>(
            "SELECT EXISTS (SELECT FROM pg_catalog.pg_extension \
              WHERE extname OPERATOR(pg_catalog.=) 'outbox_dispatch')",
        )
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// Runs `body` in a transaction of its own and commits it; an error
/// PostgreSQL raises inside rolls it back and is returned. The transaction
/// is cancelled (an error like any other) once it has run `deadline`:
/// PostgreSQL arms `statement_timeout` for top-level statements only, never
/// under SPI. The table statistics are flushed as PostgreSQL's own workers
/// flush them, so that autovacuum sees the dispatcher's writes.
pub(super) fn transaction<R>(
    deadline: Duration,
    body: impl FnOnce() -> Result<R, DbError>,
) -> Result<R, DbError> {
    // SAFETY: the transaction calls of worker_spi, on the main thread,
    // outside any transaction; the timeout is PostgreSQL's own, whose
    // handler cancels the statement running when it fires.
    unsafe {
        pg_sys::SetCurrentStatementStartTimestamp();
        pg_sys::StartTransactionCommand();
        pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
    }
    let ends_at = Instant::now() + deadline;
    ENDS_AT.set(Some(ends_at));
    arm(ends_at);
    let result = PgTryBuilder::new(std::panic::AssertUnwindSafe(move || match body() {
        Ok(value) => {
            // SAFETY: ends the transaction begun above. The deadline is
            // disarmed first: a cancel during a synchronous commit's wait
            // for a standby would return before the standby has it.
            unsafe {
                pg_sys::PopActiveSnapshot();
                disable_timeout(STATEMENT_TIMEOUT, false);
                pg_sys::CommitTransactionCommand();
            }
            Ok(value)
        }
        Err(e) => {
            // SAFETY: rolls back the transaction begun above.
            unsafe { pg_sys::AbortCurrentTransaction() };
            Err(e)
        }
    }))
    .catch_others(|caught| {
        let error = match &caught {
            pg_sys::panic::CaughtError::PostgresError(report) => caught_error(report),
            // A bug of ours: not something to carry on from.
            _ => caught.rethrow(),
        };
        // SAFETY: the error was caught inside the transaction begun above.
        unsafe { pg_sys::AbortCurrentTransaction() };
        Err(error)
    })
    .execute();
    // SAFETY: disarms the timeout armed above (a no-op once it fired).
    unsafe {
        disable_timeout(STATEMENT_TIMEOUT, false);
    }
    ENDS_AT.set(None);
    super::signals::ignore_cancel();
    // SAFETY: plain statistics and activity reporting.
    unsafe {
        pg_sys::pgstat_report_stat(false);
        pg_sys::pgstat_report_activity(pg_sys::BackendState::STATE_IDLE, std::ptr::null());
    }
    result
}

/// An error PostgreSQL raised, with its SQLSTATE.
fn caught_error(report: &pg_sys::panic::ErrorReportWithLevel) -> DbError {
    DbError::new(sqlstate(report.sql_error_code()), report.message())
}

/// The five characters of a SQLSTATE, which PostgreSQL packs six bits
/// each, first lowest.
fn sqlstate(code: PgSqlErrorCode) -> String {
    let packed = code as isize;
    (0..5).map(|i| (((packed >> (6 * i)) & 0x3f) as u8 + b'0') as char).collect()
}

thread_local! {
    /// When the transaction under way must end: its statement deadline.
    static ENDS_AT: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
}

/// Arms the statement deadline to fire at `at` (at once if it is past).
fn arm(at: Instant) {
    let ms = at.saturating_duration_since(Instant::now()).as_millis().clamp(1, i32::MAX as u128) as i32;
    // SAFETY: PostgreSQL's own timeout; arming it again moves it.
    unsafe { enable_timeout_after(STATEMENT_TIMEOUT, ms) };
}

/// The time left to the transaction under way.
fn time_left() -> Duration {
    ENDS_AT.get().map_or(Duration::ZERO, |at| at.saturating_duration_since(Instant::now()))
}

/// Runs `body` with the statement deadline at `until` (never later than
/// the transaction's own), then puts the transaction's back.
fn within<R>(until: Instant, body: impl FnOnce() -> R) -> R {
    let ends = ENDS_AT.get().unwrap_or(until);
    arm(until.min(ends));
    let result = body();
    arm(ends);
    result
}

/// Runs `body` in a subtransaction of the current transaction, as a
/// PL/pgSQL exception block does: an error PostgreSQL raises inside rolls
/// back what `body` did, and the transaction goes on. An intervention other
/// than a cancel (a shutdown: the rest of SQLSTATE class 57) is raised
/// again, for the whole transaction.
fn subtransaction(body: impl FnOnce() -> Result<(), DbError>) -> Result<(), DbError> {
    // SAFETY: PL/pgSQL's sequence, on the main thread inside a transaction:
    // the memory context and resource owner in use are restored after the
    // subtransaction ends either way.
    let (context, owner) = unsafe { (pg_sys::CurrentMemoryContext, pg_sys::CurrentResourceOwner) };
    let restore = move || unsafe {
        pg_sys::MemoryContextSwitchTo(context);
        pg_sys::CurrentResourceOwner = owner;
    };
    unsafe {
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
    }
    PgTryBuilder::new(std::panic::AssertUnwindSafe(move || {
        let result = body();
        // SAFETY: ends the subtransaction begun above.
        unsafe {
            match result {
                Ok(_) => pg_sys::ReleaseCurrentSubTransaction(),
                Err(_) => pg_sys::RollbackAndReleaseCurrentSubTransaction(),
            }
        }
        restore();
        result
    }))
    .catch_others(move |caught| {
        restore();
        // SAFETY: the error was caught inside the subtransaction begun above.
        unsafe { pg_sys::RollbackAndReleaseCurrentSubTransaction() };
        restore();
        let report = match &caught {
            pg_sys::panic::CaughtError::PostgresError(report) => report,
            // A bug of ours: not something to carry on from.
            _ => caught.rethrow(),
        };
        let error = caught_error(report);
        if error.code.starts_with("57") && error.code != "57014" {
            caught.rethrow()
        }
        Err(error)
    })
    .execute()
}
