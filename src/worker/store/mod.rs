//! The dispatcher's statements against `outbox.log` (the SQL is in
//! sql/worker/). Each public function is one short transaction: no
//! transaction is ever held open across broker I/O. A statement's error
//! (a lock not granted within `lock_timeout`, say) rolls the transaction
//! back and comes back as a [`StoreError`]; the dispatcher shows it and
//! tries again, it does not die of it.

use std::ffi::CString;
use std::time::{Duration, Instant};

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{PgBuiltInOids, PgOid};
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiError};
use pgrx::{PgSqlErrorCode, PgTryBuilder};

use outbox_core::report::Report;

use crate::config::KeyPolicy;
use crate::counters::{self, Counter};
use crate::keys::{self, Head, Key};

mod batches;
mod claim;

pub use batches::{Backoff, Flushed};

unsafe extern "C-unwind" {
    /// utils/timeout.h, which pgrx does not bind.
    fn enable_timeout_after(id: u32, delay_ms: std::ffi::c_int);
    fn disable_timeout(id: u32, keep_indicator: bool);
}

/// `STATEMENT_TIMEOUT` of utils/timeout.h's `TimeoutId`: the fourth
/// predefined reason in every PostgreSQL this builds for (15 to 18).
const STATEMENT_TIMEOUT: u32 = 3;

/// One claimed event, copied out of SPI memory.
#[derive(Debug, Clone)]
pub struct ClaimedEvent {
    pub id: uuid::Uuid,
    pub event_type: String,
    pub payload: String,
    pub queue: String,
    pub task: String,
    pub headers: Option<String>,
    pub priority: u8,
    pub retry_count: i32,
    pub created_at: String,
    /// `created_at` in seconds since the Unix epoch, for the latency histogram.
    pub created_epoch: f64,
    /// Positional arguments (a JSON array's text) besides the payload's.
    pub args: Option<String>,
    /// When it expires, in ISO 8601 and in seconds since the Unix epoch.
    pub expires: Option<(String, f64)>,
    /// This send's id (its batch's), which the message carries and its
    /// report names.
    pub send: uuid::Uuid,
    /// Where the claim read it: what proves it is still in the batch.
    pub position: Position,
    /// Its key, when it is its key's head.
    pub head: Option<Key>,
}

/// An event's place in line: the transaction that put it there
/// (`pending_xid`, as PostgreSQL writes an `xid8`).
pub type Position = String;

/// One claim's batch (`outbox.batches`): with the dispatcher's index, the
/// token that proves its events are still this claim's.
#[derive(Debug, Clone, Copy)]
pub struct Batch {
    pub id: i64,
}

/// Whose events this database holds (`sql/worker/home.sql`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Home {
    /// Its own.
    Own,
    /// A copy's, with nothing left to send or confirm: adopted just now.
    Adopted(u32),
    /// Those of the database of this OID, which it is a copy of: not to be
    /// sent from here until `outbox_adopt()`, in the schema named (quoted).
    CopyOf(u32, String),
}

/// What a claim found.
pub enum Claim {
    /// The extension is not created in this database (yet, or any more).
    NoExtension,
    Claimed {
        /// Batches of accumulated subscriptions made just before the claim.
        flushed: Flushed,
        events: Vec<ClaimedEvent>,
        /// The claim's batch; `None` when nothing was claimed.
        batch: Option<Batch>,
        /// Set when the claim found nothing: how long until the earliest
        /// delayed event falls due, if any waits.
        next_due: Option<Duration>,
    },
}

/// What one push did to the events of one claim, to be recorded.
#[derive(Default)]
pub struct Outcome {
    pub batch: Option<Batch>,
    /// In the broker.
    pub dispatched: Vec<uuid::Uuid>,
    /// The heads of keys among them.
    pub heads: Vec<Head>,
    /// Back to pending after a backoff, or to the dead letter.
    pub failures: Vec<Failure>,
    /// Not delivered for the broker's reasons: back in line at once, no
    /// retry spent.
    pub released: Vec<(uuid::Uuid, Position)>,
}

impl Outcome {
    pub fn is_empty(&self) -> bool {
        self.dispatched.is_empty() && self.failures.is_empty() && self.released.is_empty()
    }
}

/// An event that failed for a reason of its own.
pub struct Failure {
    pub id: uuid::Uuid,
    pub position: Position,
    /// Dead-lettered (`failed`) rather than retried.
    pub dead: bool,
    pub error: String,
    pub delay: Duration,
}

/// A statement failed; its transaction was rolled back.
#[derive(Debug, Clone)]
pub enum StoreError {
    /// Another session holds a lock the statement needed for longer than
    /// the dispatcher's `lock_timeout`.
    Locked(String),
    /// Any other error PostgreSQL raised, or SPI refused.
    Failed(String),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Locked(e) => {
                write!(f, "waiting for a lock on outbox.log held by another session: {e}")
            }
            StoreError::Failed(e) => write!(f, "database error: {e}"),
        }
    }
}

impl From<SpiError> for StoreError {
    fn from(e: SpiError) -> StoreError {
        StoreError::Failed(e.to_string())
    }
}

/// A prepared statement and its text, which `pg_stat_activity` shows while
/// it runs.
struct Statement {
    plan: OwnedPreparedStatement,
    text: CString,
}

/// The plans, prepared the first time the table exists and kept for the
/// life of the dispatcher.
struct Plans {
    flush_batches: Statement,
    accumulating: Statement,
    fail_batch: Statement,
    claim: Statement,
    next_due: Statement,
    mark_dispatched: Statement,
    mark_failed: Statement,
    release: Statement,
    abandon: Statement,
    reline_abandoned: Statement,
    lock_cursor: Statement,
    restore_turn: Statement,
    came_due: Statement,
    settle_reported: Statement,
    sweep_strays: Statement,
    settle_unacked: Statement,
    sweep_unacked: Statement,
    rotate: Statement,
    forget_batches: Statement,
    apply_reports: Statement,
    home: Statement,
    lock_keys: Statement,
    pass_keys: Statement,
    sweep_keys: Statement,
    purge_inbox: Statement,
}

impl Plans {
    /// The two statements of [`keys::pass`].
    fn keys(&self) -> (&OwnedPreparedStatement, &OwnedPreparedStatement) {
        (&self.lock_keys.plan, &self.pass_keys.plan)
    }
}

pub struct Store {
    dispatcher: i32,
    plans: Option<Plans>,
    /// Accumulated subscriptions whose batch this dispatcher leaves alone
    /// for a while.
    flush_backoff: Backoff,
    /// The longest one transaction may run.
    statement_timeout: Duration,
    /// Reports or acknowledgements are awaited of what was sent: a copy
    /// of a database is adopted only once none are.
    awaited: bool,
    /// When a finished head lets its key go.
    key_policy: KeyPolicy,
    /// Finished heads whose key a producer held locked when this
    /// dispatcher would have passed it on: passed at its next transaction.
    deferred: Vec<Head>,
}

const UUID_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::UUIDARRAYOID);
const TEXT_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTARRAYOID);
const FLOAT8_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::FLOAT8ARRAYOID);
const INT4: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT4OID);
const INT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT8OID);
const INT8_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT8ARRAYOID);
const TEXT: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTOID);
const FLOAT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::FLOAT8OID);
const BOOL: PgOid = PgOid::BuiltIn(PgBuiltInOids::BOOLOID);
const OID: PgOid = PgOid::BuiltIn(PgBuiltInOids::OIDOID);

/// What a transaction with the plans came to.
enum Ran<R> {
    Done(R),
    NoExtension,
    /// The extension's SQL is of another version than this library (the
    /// library was installed, `ALTER EXTENSION … UPDATE` not yet run).
    Outdated(String),
}

const LIBRARY_VERSION: &str = env!("CARGO_PKG_VERSION");
const INSTALLED_VERSION: &str =
    "SELECT extversion FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'outbox_dispatch'";

/// Rows a sweeper touches per transaction.
pub const SWEEP_BATCH: usize = 1000;

/// Batches forgotten per transaction: each is looked for in the log first
/// (about 0.1 ms), so a thousand held the dispatcher 120 ms.
pub const FORGET_BATCH: usize = 100;

/// Batches a sweeper takes per transaction (with their events: up to
/// `outbox.batch_size` each).
pub const BATCHES_PER_SWEEP: usize = 10;

impl Plans {
    fn prepare(client: &SpiClient<'_>) -> Result<Plans, SpiError> {
        let prepare = |sql: &'static str, args: &[PgOid]| {
            let plan = client.prepare_mut(sql, args)?.keep();
            Ok::<_, SpiError>(Statement { plan, text: CString::new(sql).expect("no NUL in SQL files") })
        };
        Ok(Plans {
            flush_batches: prepare(
                include_str!("../../../sql/worker/flush_batches.sql"),
                &[INT8, INT8_ARRAY, INT8],
            )?,
            accumulating: prepare(include_str!("../../../sql/worker/accumulating.sql"), &[])?,
            fail_batch: prepare(include_str!("../../../sql/worker/fail_batch.sql"), &[INT8, TEXT, INT8])?,
            lock_cursor: prepare(include_str!("../../../sql/worker/lock_cursor.sql"), &[])?,
            restore_turn: prepare(include_str!("../../../sql/worker/restore_turn.sql"), &[])?,
            claim: prepare(include_str!("../../../sql/worker/claim.sql"), &[INT4, INT4])?,
            came_due: prepare(include_str!("../../../sql/worker/came_due.sql"), &[INT4])?,
            next_due: prepare(include_str!("../../../sql/worker/next_due.sql"), &[INT8_ARRAY])?,
            mark_dispatched: prepare(include_str!("../../../sql/worker/mark_dispatched.sql"), &[INT8, INT4])?,
            mark_failed: prepare(
                include_str!("../../../sql/worker/mark_failed.sql"),
                &[UUID_ARRAY, TEXT_ARRAY, TEXT_ARRAY, TEXT_ARRAY, FLOAT8_ARRAY],
            )?,
            release: prepare(include_str!("../../../sql/worker/release.sql"), &[UUID_ARRAY, TEXT_ARRAY])?,
            abandon: prepare(include_str!("../../../sql/worker/abandon.sql"), &[INT4, FLOAT8, INT4])?,
            reline_abandoned: prepare(
                include_str!("../../../sql/worker/reline_abandoned.sql"),
                &[INT8_ARRAY],
            )?,
            settle_reported: prepare(include_str!("../../../sql/worker/settle_reported.sql"), &[INT8_ARRAY])?,
            sweep_strays: prepare(include_str!("../../../sql/worker/sweep_strays.sql"), &[INT4])?,
            settle_unacked: prepare(include_str!("../../../sql/worker/settle_unacked.sql"), &[FLOAT8, INT4])?,
            sweep_unacked: prepare(
                include_str!("../../../sql/worker/sweep_unacked.sql"),
                &[INT8_ARRAY, INT4],
            )?,
            rotate: prepare(include_str!("../../../sql/worker/rotate.sql"), &[FLOAT8, INT4, BOOL])?,
            forget_batches: prepare(include_str!("../../../sql/worker/forget_batches.sql"), &[INT4])?,
            apply_reports: prepare(
                include_str!("../../../sql/worker/apply_reports.sql"),
                &[UUID_ARRAY, UUID_ARRAY, TEXT_ARRAY, TEXT_ARRAY],
            )?,
            home: prepare(include_str!("../../../sql/worker/home.sql"), &[OID, BOOL])?,
            lock_keys: prepare(keys::LOCK, &[TEXT_ARRAY, INT8_ARRAY, BOOL])?,
            pass_keys: prepare(keys::PASS, &[UUID_ARRAY, TEXT_ARRAY, INT8_ARRAY, BOOL, BOOL])?,
            sweep_keys: prepare(include_str!("../../../sql/worker/sweep_keys.sql"), &[BOOL, BOOL, INT4])?,
            purge_inbox: prepare(include_str!("../../../sql/worker/purge_inbox.sql"), &[FLOAT8, INT4])?,
        })
    }
}

/// Runs `statement`, shown as the dispatcher's activity while it runs.
fn update(client: &mut SpiClient<'_>, statement: &Statement, args: &[DatumWithOid]) -> Result<u64, SpiError> {
    report_running(&statement.text);
    Ok(client.update(&statement.plan, None, args)?.len() as u64)
}

/// Runs `statement`, which returns the ids of the batches it took (locked
/// until the transaction ends), for a statement of their own.
fn batches(
    client: &mut SpiClient<'_>,
    statement: &Statement,
    args: &[DatumWithOid],
) -> Result<Vec<i64>, SpiError> {
    report_running(&statement.text);
    let mut ids = Vec::new();
    for row in client.update(&statement.plan, None, args)? {
        ids.extend(row.get::<i64>(1)?);
    }
    Ok(ids)
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

fn to_pg(ids: impl IntoIterator<Item = uuid::Uuid>) -> Vec<pgrx::Uuid> {
    ids.into_iter().map(pg_uuid).collect()
}

fn pg_uuid(id: uuid::Uuid) -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(id.into_bytes())
}

fn uuid_of(id: pgrx::Uuid) -> uuid::Uuid {
    uuid::Uuid::from_bytes(*id.as_bytes())
}

/// Runs `body` in a transaction of its own and commits it; an error
/// PostgreSQL raises inside rolls it back and is returned. The transaction
/// is cancelled (an error like any other) once it has run `deadline`:
/// PostgreSQL arms `statement_timeout` for top-level statements only, never
/// under SPI. The table statistics are flushed as PostgreSQL's own workers
/// flush them, so that autovacuum sees the dispatcher's writes.
pub(super) fn transaction<R>(
    deadline: Duration,
    body: impl FnOnce() -> Result<R, SpiError>,
) -> Result<R, StoreError> {
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
            Err(StoreError::from(e))
        }
    }))
    .catch_others(|caught| {
        let error = match &caught {
            pg_sys::panic::CaughtError::PostgresError(report) => {
                let message = report.message().to_string();
                if report.sql_error_code() == PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE {
                    StoreError::Locked(message)
                } else {
                    StoreError::Failed(message)
                }
            }
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

/// Why a subtransaction failed.
#[derive(Debug)]
enum SubtransactionError {
    /// A reason that may pass: a lock, a deadlock, a serialization failure,
    /// resources, the deadline it was given (SQLSTATE classes 40 and 53,
    /// lock_not_available, query_canceled).
    Passing(String),
    /// One that would not: the same work would fail again.
    Lasting(String),
}

/// Runs `body` in a subtransaction of the current transaction, as a
/// PL/pgSQL exception block does: an error PostgreSQL raises inside rolls
/// back what `body` did, and the transaction goes on. An intervention other
/// than a cancel (a shutdown: the rest of SQLSTATE class 57) is raised
/// again, for the whole transaction.
fn subtransaction<R>(body: impl FnOnce() -> Result<R, SpiError>) -> Result<R, SubtransactionError> {
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
        result.map_err(|e| SubtransactionError::Lasting(e.to_string()))
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
        let code = report.sql_error_code();
        let class = sqlstate_class(code);
        let cancelled = code == PgSqlErrorCode::ERRCODE_QUERY_CANCELED;
        if class == *b"57" && !cancelled {
            caught.rethrow()
        }
        let message = report.message().to_string();
        if cancelled
            || class == *b"40"
            || class == *b"53"
            || code == PgSqlErrorCode::ERRCODE_LOCK_NOT_AVAILABLE
        {
            Err(SubtransactionError::Passing(message))
        } else {
            Err(SubtransactionError::Lasting(message))
        }
    })
    .execute()
}

/// The first two characters of a SQLSTATE, its class.
fn sqlstate_class(code: PgSqlErrorCode) -> [u8; 2] {
    // PostgreSQL packs the five characters six bits each, first lowest.
    let packed = code as isize;
    [(packed & 0x3f) as u8 + b'0', ((packed >> 6) & 0x3f) as u8 + b'0']
}

impl Store {
    pub fn new(
        dispatcher: usize,
        statement_timeout: Duration,
        awaited: bool,
        key_policy: KeyPolicy,
    ) -> Store {
        Store {
            dispatcher: dispatcher as i32,
            plans: None,
            flush_backoff: Backoff::default(),
            statement_timeout,
            awaited,
            key_policy,
            deferred: Vec::new(),
        }
    }

    pub fn set_key_policy(&mut self, policy: KeyPolicy) {
        self.key_policy = policy;
    }

    /// Whether reports or acknowledgements are awaited of what is sent.
    pub fn set_awaited(&mut self, awaited: bool) {
        self.awaited = awaited;
    }

    /// When a subscription whose batch failed may be tried again.
    pub fn flush_retry_due(&self) -> Option<std::time::Instant> {
        self.flush_backoff.next_due()
    }

    pub fn set_statement_timeout(&mut self, statement_timeout: Duration) {
        self.statement_timeout = statement_timeout;
    }

    /// Runs `body` in a transaction with the plans ready; `None` when the
    /// extension does not exist in this database.
    fn with_plans<R>(
        &mut self,
        body: impl FnOnce(&mut SpiClient<'_>, &Plans, i32) -> Result<R, SpiError>,
    ) -> Result<Option<R>, StoreError> {
        self.with_plans_within(self.statement_timeout, body)
    }

    /// [`Store::with_plans`] with a deadline of its own.
    fn with_plans_within<R>(
        &mut self,
        deadline: Duration,
        body: impl FnOnce(&mut SpiClient<'_>, &Plans, i32) -> Result<R, SpiError>,
    ) -> Result<Option<R>, StoreError> {
        let dispatcher = self.dispatcher;
        let plans = &mut self.plans;
        let ran = transaction(deadline, || {
            if !extension_exists() {
                *plans = None;
                return Ok(Ran::NoExtension);
            }
            if plans.is_none() {
                let installed = crate::read_one::<String>(INSTALLED_VERSION)?.unwrap_or_default();
                if installed != LIBRARY_VERSION {
                    return Ok(Ran::Outdated(installed));
                }
            }
            Spi::connect_mut(|client| {
                if plans.is_none() {
                    *plans = Some(Plans::prepare(client)?);
                }
                let plans = plans.as_ref().expect("prepared above");
                body(client, plans, dispatcher).map(Ran::Done)
            })
        })?;
        match ran {
            Ran::Done(result) => Ok(Some(result)),
            Ran::NoExtension => Ok(None),
            Ran::Outdated(installed) => Err(StoreError::Failed(format!(
                "outbox_dispatch {installed} is installed in this database and the library is \
                 {LIBRARY_VERSION}: run ALTER EXTENSION outbox_dispatch UPDATE"
            ))),
        }
    }

    /// [`Store::with_plans`], with [`Turns`] for `body` to tell the heads
    /// it finished and pass their keys on ([`Turns::pass`]: before a claim,
    /// which then sees the new heads, never after one), the heads deferred
    /// before among them. What it could not pass is deferred again.
    fn with_turns<R>(
        &mut self,
        body: impl FnOnce(&mut SpiClient<'_>, &Plans, i32, &mut Turns) -> Result<R, SpiError>,
    ) -> Result<Option<R>, StoreError> {
        let mut turns = Turns { policy: self.key_policy, heads: self.deferred.clone(), promoted: 0 };
        let result = self.with_plans(|client, plans, dispatcher| body(client, plans, dispatcher, &mut turns));
        if let Ok(Some(_)) = result {
            self.deferred = turns.heads;
            counters::add(Counter::KeyTurns, turns.promoted);
        }
        result
    }

    /// Is the extension created in this database?
    pub fn extension_exists(&mut self) -> Result<bool, StoreError> {
        self.with_plans(|_, _, _| Ok(())).map(|found| found.is_some())
    }

    /// Whether this database holds its own events or a copy's; `None`
    /// without the extension.
    pub fn home(&mut self, database: pg_sys::Oid) -> Result<Option<Home>, StoreError> {
        let awaited = self.awaited;
        self.with_plans(|client, plans, _| {
            let row = client.update(&plans.home.plan, None, &[database.into(), awaited.into()])?.first();
            let recorded = row.get::<pg_sys::Oid>(1)?.unwrap_or(database).to_u32();
            Ok(match (recorded == database.to_u32(), row.get::<bool>(2)?.unwrap_or(false)) {
                (true, _) => Home::Own,
                (false, true) => Home::Adopted(recorded),
                (false, false) => Home::CopyOf(recorded, row.get::<String>(3)?.unwrap_or_default()),
            })
        })
    }

    /// Puts back in line whatever this dispatcher held when it last died
    /// (its batches not marked).
    pub fn release_own(&mut self) -> Result<u64, StoreError> {
        self.abandon(Some(self.dispatcher), Duration::ZERO)
    }

    /// Puts back in line the events of up to [`BATCHES_PER_SWEEP`] batches not
    /// marked, of `dispatcher` or, with `None`, claimed longer than
    /// `timeout` ago (their dispatcher died or hung); returns how many.
    fn abandon(&mut self, dispatcher: Option<i32>, timeout: Duration) -> Result<u64, StoreError> {
        let released = self.with_plans(|client, plans, _| {
            let args: [DatumWithOid; 3] = [
                dispatcher.into(),
                (timeout.as_secs_f64() * 1000.0).into(),
                (BATCHES_PER_SWEEP as i32).into(),
            ];
            let batches = batches(client, &plans.abandon, &args)?;
            if batches.is_empty() {
                return Ok(0);
            }
            // A statement of its own: a snapshot taken once the batches are
            // locked (sql/worker/reline_abandoned.sql).
            update(client, &plans.reline_abandoned, &[batches.into()])
        })?;
        Ok(released.unwrap_or(0))
    }

    /// Records `settled` (the previous push's outcome; may be empty), makes
    /// the batches of accumulated subscriptions that are due (members cut
    /// at `batch_budget` bytes each), puts in line the events whose time
    /// has come, and claims up to `limit` events, in one transaction: a
    /// dispatcher under load spends one transaction per batch, not two.
    /// Nothing is written to outbox.log after the claim (claim.sql).
    pub fn settle_and_claim(
        &mut self,
        settled: &Outcome,
        limit: usize,
        batch_budget: i64,
    ) -> Result<Claim, StoreError> {
        let mut backoff = std::mem::take(&mut self.flush_backoff);
        let claimed = self.with_turns(|client, plans, dispatcher, turns| {
            let promoted = turns.promoted;
            mark(client, plans, dispatcher, settled, turns)?;
            // Before the claim, which may take the new heads.
            turns.pass(client, plans)?;
            let flushed = batches::flush(client, plans, batch_budget, &mut backoff)?;
            if flushed.batches > 0 {
                // The batches are pushed once this commits: it must outlive a
                // crash, or their members would be flushed again into a batch
                // with another id (task id), which consumers could not tell
                // from a new one.
                durable_commit(client)?;
            }
            let came_due = update(client, &plans.came_due, &[(SWEEP_BATCH as i32).into()])?;
            // Events this transaction put in line: its own snapshot may not
            // see them as ended, and the claim leaves them to the next one,
            // due at once.
            let lined = came_due > 0
                || turns.promoted > promoted
                || flushed.batches > 0
                || !settled.released.is_empty();
            let taken = claim::claim(client, plans, dispatcher, limit)?;
            let next_due = if taken.events.is_empty() && lined {
                Some(Duration::ZERO)
            } else if taken.events.is_empty() {
                report_running(&plans.next_due.text);
                let skipped: [DatumWithOid; 1] = [backoff.current().into()];
                let seconds: Option<f64> =
                    client.select(&plans.next_due.plan, None, &skipped)?.first().get_one()?;
                seconds.and_then(|s| Duration::try_from_secs_f64(s.max(0.0)).ok())
            } else {
                None
            };
            Ok((flushed, taken, next_due))
        });
        self.flush_backoff = backoff;
        let (flushed, taken, next_due) = match claimed? {
            Some(claimed) => claimed,
            None => return Ok(Claim::NoExtension),
        };
        Ok(Claim::Claimed { flushed, events: taken.events, batch: taken.batch, next_due })
    }

    /// Records `settled` on its own, when no claim is to follow.
    pub fn settle(&mut self, settled: &Outcome) -> Result<(), StoreError> {
        self.with_turns(|client, plans, dispatcher, turns| {
            mark(client, plans, dispatcher, settled, turns)?;
            turns.pass(client, plans)
        })?;
        Ok(())
    }

    /// Puts back in line the events of up to [`BATCHES_PER_SWEEP`] batches
    /// claimed longer than `timeout` ago and not marked.
    pub fn sweep_stuck(&mut self, timeout: Duration) -> Result<u64, StoreError> {
        self.abandon(None, timeout)
    }

    /// Puts in line up to [`SWEEP_BATCH`] pending events whose transaction
    /// id lies in this cluster's future, and as many before every window
    /// (a restore's, with its triggers off), where no claim would reach
    /// them soon or ever.
    pub fn sweep_strays(&mut self) -> Result<u64, StoreError> {
        let swept = self.with_plans(|client, plans, _| {
            update(client, &plans.sweep_strays, &[(SWEEP_BATCH as i32).into()])
        })?;
        Ok(swept.unwrap_or(0))
    }

    /// Up to [`SWEEP_BATCH`] events dispatched longer than `timeout` ago
    /// and never acknowledged: back to pending to be sent again, or failed
    /// when re-sent `max_redeliveries` times already. Returns how many of
    /// each: (resent, failed).
    pub fn sweep_unacked(
        &mut self,
        timeout: Duration,
        max_redeliveries: i32,
    ) -> Result<(u64, u64), StoreError> {
        let swept = self.with_turns(|client, plans, _, turns| {
            let args: [DatumWithOid; 2] =
                [(timeout.as_secs_f64() * 1000.0).into(), (BATCHES_PER_SWEEP as i32).into()];
            let batches = batches(client, &plans.settle_unacked, &args)?;
            let (mut resent, mut failed) = (0, 0);
            if batches.is_empty() {
                return Ok((resent, failed));
            }
            // A statement of its own: a snapshot taken once the batches are
            // locked (sql/worker/sweep_unacked.sql).
            let args: [DatumWithOid; 2] = [batches.into(), max_redeliveries.into()];
            report_running(&plans.sweep_unacked.text);
            for row in client.update(&plans.sweep_unacked.plan, None, &args)? {
                if row.get::<bool>(1)?.unwrap_or(false) {
                    failed += 1;
                    turns.failed(keys::head_of(&row, 2)?);
                } else {
                    resent += 1;
                }
            }
            turns.pass(client, plans)?;
            Ok((resent, failed))
        })?;
        Ok(swept.unwrap_or((0, 0)))
    }

    /// Passes on up to [`SWEEP_BATCH`] keys no statement passed on
    /// (`sql/worker/sweep_keys.sql`) and starts up to as many keys found
    /// with events waiting and no head. Returns how many events became
    /// their key's head.
    pub fn sweep_keys(&mut self) -> Result<u64, StoreError> {
        let policy = self.key_policy;
        let swept = self.with_plans(|client, plans, _| {
            let args: [DatumWithOid; 3] =
                [policy.failed.into(), policy.dispatched.into(), (SWEEP_BATCH as i32).into()];
            report_running(&plans.sweep_keys.text);
            let (mut heads, mut stranded) = (Vec::new(), Vec::new());
            for row in client.select(&plans.sweep_keys.plan, None, &args)? {
                let key = keys::Key {
                    ordering_key: row.get::<String>(2)?.unwrap_or_default(),
                    subscription: row.get::<i64>(3)?.unwrap_or(0),
                };
                match row.get::<pgrx::Uuid>(1)? {
                    Some(id) => heads.push(Head { id, key }),
                    None => stranded.push(key),
                }
            }
            let promoted = keys::pass(client, plans.keys(), heads, &stranded, policy, false)?.promoted;
            if promoted > 0 {
                // As in Turns::pass: the new heads may be sent right after.
                durable_commit(client)?;
            }
            Ok(promoted)
        })?;
        let promoted = swept.unwrap_or(0);
        counters::add(Counter::KeyTurns, promoted);
        Ok(promoted)
    }

    /// Records the outcomes Celery workers reported, in one statement;
    /// returns how many events took one of each kind: (processed, failed).
    /// The others were stale.
    pub fn apply_reports(&mut self, reports: &[Report]) -> Result<(u64, u64), StoreError> {
        let applied = self.with_turns(|client, plans, _, turns| {
            // The reports are trimmed off the broker's list once this
            // commits: it must outlive a crash, or they would be lost.
            durable_commit(client)?;
            let args: [DatumWithOid; 4] = [
                to_pg(reports.iter().map(|r| r.id)).into(),
                to_pg(reports.iter().map(|r| r.send)).into(),
                reports.iter().map(|r| r.outcome.status().to_string()).collect::<Vec<_>>().into(),
                reports.iter().map(|r| r.outcome.error().map(str::to_string)).collect::<Vec<_>>().into(),
            ];
            report_running(&plans.apply_reports.text);
            let (mut processed, mut failed) = (0, 0);
            let mut touched = Vec::new();
            for row in client.update(&plans.apply_reports.plan, None, &args)? {
                touched.extend(row.get::<i64>(5)?);
                let head = keys::head_of(&row, 2)?;
                match row.get::<String>(1)?.as_deref() {
                    Some("processed") => {
                        processed += 1;
                        turns.finished(head);
                    }
                    _ => {
                        failed += 1;
                        turns.failed(head);
                    }
                }
            }
            touched.sort_unstable();
            touched.dedup();
            update(client, &plans.settle_reported, &[touched.into()])?;
            turns.pass(client, plans)?;
            Ok((processed, failed))
        })?;
        Ok(applied.unwrap_or((0, 0)))
    }

    /// One step of the rotation (sql/rotation.sql) with generations of
    /// `retention`: what it did, and how many events it moved or
    /// truncated; `None` when nothing was due.
    pub fn rotate(&mut self, retention: Duration, acks: bool) -> Result<Option<(String, u64)>, StoreError> {
        let step = self.with_plans(|client, plans, _| {
            let args: [DatumWithOid; 3] =
                [(retention.as_secs_f64() * 1000.0).into(), (SWEEP_BATCH as i32).into(), acks.into()];
            report_running(&plans.rotate.text);
            let row = client.update(&plans.rotate.plan, None, &args)?.first();
            let step: Option<String> = row.get(1)?;
            let events: Option<i64> = row.get(2)?;
            Ok(step.map(|step| (step, events.unwrap_or(0) as u64)))
        })?;
        Ok(step.flatten())
    }

    /// Deletes up to [`FORGET_BATCH`] batches whose events are all gone.
    pub fn forget_batches(&mut self) -> Result<u64, StoreError> {
        let forgotten = self.with_plans(|client, plans, _| {
            let args: [DatumWithOid; 1] = [(FORGET_BATCH as i32).into()];
            report_running(&plans.forget_batches.text);
            let deleted: Option<i64> =
                client.update(&plans.forget_batches.plan, None, &args)?.first().get_one()?;
            Ok(deleted.unwrap_or(0) as u64)
        })?;
        Ok(forgotten.unwrap_or(0))
    }

    /// Deletes up to [`SWEEP_BATCH`] inbox rows claimed longer than
    /// `retention` ago.
    pub fn purge_inbox(&mut self, retention: Duration) -> Result<u64, StoreError> {
        self.sweep(|p| &p.purge_inbox, retention)
    }

    fn sweep(&mut self, statement: fn(&Plans) -> &Statement, age: Duration) -> Result<u64, StoreError> {
        let swept = self.with_plans(|client, plans, _| {
            let args: [DatumWithOid; 2] = [(age.as_secs_f64() * 1000.0).into(), (SWEEP_BATCH as i32).into()];
            update(client, statement(plans), &args)
        })?;
        Ok(swept.unwrap_or(0))
    }
}

/// This transaction commits synchronously (dispatchers otherwise commit
/// with `synchronous_commit = off`): for a commit that something done
/// outside PostgreSQL right after it relies on.
fn durable_commit(client: &mut SpiClient<'_>) -> Result<(), SpiError> {
    client.update("SET LOCAL synchronous_commit TO on", None, &[])?;
    Ok(())
}

/// Records one push's outcome while its batch is still this claim's: the
/// batch is marked, `failures` go out of line until their backoff or to
/// the dead letter, `released` back in line as they were. A batch a
/// sweeper took meanwhile records nothing: its events are back in line.
fn mark(
    client: &mut SpiClient<'_>,
    plans: &Plans,
    dispatcher: i32,
    outcome: &Outcome,
    turns: &mut Turns,
) -> Result<(), SpiError> {
    let Some(batch) = outcome.batch.filter(|_| !outcome.is_empty()) else {
        return Ok(());
    };
    report_running(&plans.mark_dispatched.text);
    let args: [DatumWithOid; 2] = [batch.id.into(), dispatcher.into()];
    if client.update(&plans.mark_dispatched.plan, None, &args)?.is_empty() {
        return Ok(());
    }
    for head in &outcome.heads {
        turns.dispatched(Some(head.clone()));
    }
    let failures = &outcome.failures;
    if !failures.is_empty() {
        let status = |f: &Failure| if f.dead { "failed" } else { "pending" }.to_string();
        let args: [DatumWithOid; 5] = [
            to_pg(failures.iter().map(|f| f.id)).into(),
            failures.iter().map(|f| f.position.clone()).collect::<Vec<_>>().into(),
            failures.iter().map(status).collect::<Vec<_>>().into(),
            failures.iter().map(|f| f.error.clone()).collect::<Vec<_>>().into(),
            failures.iter().map(|f| f.delay.as_secs_f64() * 1000.0).collect::<Vec<_>>().into(),
        ];
        report_running(&plans.mark_failed.text);
        for row in client.update(&plans.mark_failed.plan, None, &args)? {
            turns.failed(keys::head_of(&row, 1)?);
        }
    }
    if !outcome.released.is_empty() {
        let args: [DatumWithOid; 2] = [
            to_pg(outcome.released.iter().map(|(id, _)| *id)).into(),
            outcome.released.iter().map(|(_, position)| position.clone()).collect::<Vec<_>>().into(),
        ];
        update(client, &plans.release, &args)?;
    }
    Ok(())
}

/// The heads of keys a transaction finished, to pass on before it commits
/// (README, "Per-key order").
struct Turns {
    policy: KeyPolicy,
    /// Finished heads not passed on yet.
    heads: Vec<Head>,
    /// Events that became their key's head.
    promoted: u64,
}

impl Turns {
    /// `head` was processed.
    fn finished(&mut self, head: Option<Head>) {
        self.heads.extend(head);
    }

    /// `head` was sent: finished when nothing reports or acknowledges it.
    fn dispatched(&mut self, head: Option<Head>) {
        self.heads.extend(head.filter(|_| self.policy.dispatched));
    }

    /// `head` was dead-lettered: it holds its key unless
    /// `outbox.key_on_failure = continue`.
    fn failed(&mut self, head: Option<Head>) {
        self.heads.extend(head.filter(|_| self.policy.failed));
    }

    /// Passes the keys on; those a producer holds locked are kept for the
    /// next transaction.
    fn pass(&mut self, client: &mut SpiClient<'_>, plans: &Plans) -> Result<(), SpiError> {
        let heads = std::mem::take(&mut self.heads);
        if !heads.is_empty() {
            report_running(&plans.pass_keys.text);
        }
        let passed = keys::pass(client, plans.keys(), heads, &[], self.policy, false)?;
        if passed.promoted > 0 {
            // The new heads may be claimed and sent right after this
            // commits: it must outlive a crash, or the heads that let their
            // keys go would be sent again after them.
            durable_commit(client)?;
        }
        self.promoted += passed.promoted;
        self.heads = passed.deferred;
        Ok(())
    }
}
