//! The dispatcher's transactions against `outbox.log`, written once for
//! both hosts (the SQL is in sql/worker/ and sql/keys/; the host runs it,
//! [`sql::Db`]). Each public method is one short transaction: none is ever
//! held open across broker I/O. A statement's error (a lock not granted
//! within `lock_timeout`, say) rolls the transaction back and comes back as
//! a [`StoreError`]; the dispatcher shows it and tries again, it does not
//! die of it.

use std::time::Duration;

use uuid::Uuid;

use crate::report::Report;

mod batches;
mod claim;
mod due;
mod ids;
pub mod keys;
pub mod sql;

pub use batches::{Backoff, Flushed};
pub use claim::Bounds;
use due::DueFloor;
pub use keys::{Head, Key, KeyPolicy};
use sql::{get, Arg, Db, DbError, Stmt, Tx};

/// One claimed event.
#[derive(Debug, Clone)]
pub struct ClaimedEvent {
    pub id: Uuid,
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
    pub send: Uuid,
    /// Where the claim read it: what proves it is still in the batch.
    pub position: Position,
    /// Its key, when it is its key's head.
    pub head: Option<Key>,
    /// The subscription whose delivery or batch it is (0: none).
    pub subscription: i64,
    /// On a subscription's delivery: the event it delivers. A batch has
    /// none (its members are in `args`).
    pub event_id: Option<Uuid>,
    /// The partition of outbox.log it is in.
    pub generation: i16,
    /// Why it must not be sent, if it must not (core/src/store/ids.rs):
    /// it is dead-lettered unsent.
    pub refused: Option<String>,
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
    /// The outbox is not installed in this database (yet, or any more).
    NoExtension,
    Claimed {
        /// Batches of accumulated subscriptions made just before the claim.
        flushed: Flushed,
        events: Vec<ClaimedEvent>,
        /// The claim's batch; `None` when nothing was claimed.
        batch: Option<Batch>,
        /// The claim took every event in line.
        drained: bool,
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
    pub dispatched: Vec<Uuid>,
    /// The heads of keys among them.
    pub heads: Vec<Head>,
    /// Back to pending after a backoff, or to the dead letter.
    pub failures: Vec<Failure>,
    /// Not delivered for the broker's reasons: back in line at once, no
    /// retry spent.
    pub released: Vec<(Uuid, Position)>,
}

impl Outcome {
    pub fn is_empty(&self) -> bool {
        self.dispatched.is_empty() && self.failures.is_empty() && self.released.is_empty()
    }
}

/// A partition of `outbox.log` whose triggers a restore or a copy left off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TriggersOff {
    pub generation: i32,
    /// Still disabled: the restore is under way.
    pub disabled: bool,
    /// Its size in pages.
    pub pages: i64,
}

/// An event that failed for a reason of its own.
pub struct Failure {
    pub id: Uuid,
    pub position: Position,
    /// Dead-lettered (`failed`) rather than retried.
    pub dead: bool,
    pub error: String,
    pub delay: Duration,
    /// A retry spent: the event's fault, or its destination's. Not: the
    /// broker refused part of a push for a condition of its own (see
    /// [`crate::sink::Delivery::Deferred`]).
    pub spent: bool,
}

/// A statement failed; its transaction was rolled back.
#[derive(Debug, Clone)]
pub enum StoreError {
    /// Another session holds a lock the statement needed for longer than
    /// the dispatcher's `lock_timeout`.
    Locked(String),
    /// Any other error PostgreSQL raised, or the host refused.
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

impl From<DbError> for StoreError {
    fn from(e: DbError) -> StoreError {
        if e.is_lock_timeout() {
            StoreError::Locked(e.message)
        } else {
            StoreError::Failed(e.message)
        }
    }
}

/// Rows a sweeper touches per transaction.
pub const SWEEP_BATCH: usize = 1000;

/// Batches forgotten per transaction: each is looked for in the log first
/// (about 0.1 ms), so a thousand held the dispatcher 120 ms.
pub const FORGET_BATCH: usize = 100;

/// Batches a sweeper takes per transaction (with their events: up to
/// `outbox.batch_size` each).
pub const BATCHES_PER_SWEEP: usize = 10;

/// Milliseconds, as the statements take a duration.
fn ms(d: Duration) -> Arg {
    Arg::Float8(d.as_secs_f64() * 1000.0)
}

fn count(n: usize) -> Arg {
    Arg::Int4(Some(n.min(i32::MAX as usize) as i32))
}

/// The dispatcher's store: its transactions on host `D`.
pub struct Store<D> {
    db: D,
    dispatcher: i32,
    /// Accumulated subscriptions whose batch this dispatcher leaves alone
    /// for a while.
    flush_backoff: Backoff,
    /// The longest one transaction may run.
    statement_timeout: Duration,
    /// Reports or acknowledgements are awaited of what was sent: a copy
    /// of a database is adopted only once none are.
    awaited: bool,
    /// Whether what is marked awaits acknowledgements (`outbox.ack_timeout`
    /// above 0 as it is marked); a batch keeps what it was marked with.
    acks: bool,
    /// When a finished head lets its key go.
    key_policy: KeyPolicy,
    /// Finished heads whose key a producer held locked when this
    /// dispatcher would have passed it on: passed at its next transaction.
    deferred: Vec<Head>,
    /// Events that became their key's head since [`Store::take_key_turns`].
    key_turns: u64,
    /// Where the scans of events out of line until due start.
    due: DueFloor,
}

impl<D: Db> Store<D> {
    pub fn new(
        db: D,
        dispatcher: usize,
        statement_timeout: Duration,
        (awaited, acks): (bool, bool),
        key_policy: KeyPolicy,
    ) -> Self {
        Store {
            db,
            dispatcher: dispatcher as i32,
            flush_backoff: Backoff::default(),
            statement_timeout,
            awaited,
            acks,
            key_policy,
            deferred: Vec::new(),
            key_turns: 0,
            due: DueFloor::default(),
        }
    }

    /// The host.
    pub fn db(&mut self) -> &mut D {
        &mut self.db
    }

    pub fn set_key_policy(&mut self, policy: KeyPolicy) {
        self.key_policy = policy;
    }

    /// Whether reports or acknowledgements are awaited of what is sent, and
    /// whether acknowledgements are, of what is marked from now on.
    pub fn set_awaited(&mut self, (awaited, acks): (bool, bool)) {
        self.awaited = awaited;
        self.acks = acks;
    }

    /// When a subscription whose batch failed may be tried again.
    pub fn flush_retry_due(&self) -> Option<std::time::Instant> {
        self.flush_backoff.next_due()
    }

    pub fn set_statement_timeout(&mut self, statement_timeout: Duration) {
        self.statement_timeout = statement_timeout;
    }

    /// Events that became their key's head since the last call.
    pub fn take_key_turns(&mut self) -> u64 {
        std::mem::take(&mut self.key_turns)
    }

    /// Runs `body` in a transaction; `None` when the outbox is not
    /// installed in this database.
    fn transaction<R>(
        &mut self,
        body: impl FnOnce(&mut dyn Tx, i32) -> Result<R, DbError>,
    ) -> Result<Option<R>, StoreError> {
        let dispatcher = self.dispatcher;
        let mut body = Some(body);
        let mut result = None;
        let installed = self.db.transaction(self.statement_timeout, &mut |tx| {
            let body = body.take().expect("a transaction runs its body once");
            result = Some(body(tx, dispatcher)?);
            Ok(())
        })?;
        Ok(if installed { result } else { None })
    }

    /// [`Store::transaction`], with [`keys::Turns`] for `body` to tell the
    /// heads it finished and pass their keys on ([`keys::Turns::pass`]:
    /// before a claim, which then sees the new heads, never after one), the
    /// heads deferred before among them. What it could not pass is
    /// deferred again.
    fn with_turns<R>(
        &mut self,
        body: impl FnOnce(&mut dyn Tx, i32, &mut keys::Turns) -> Result<R, DbError>,
    ) -> Result<Option<R>, StoreError> {
        let mut turns = keys::Turns::new(self.key_policy, self.deferred.clone());
        let result = self.transaction(|tx, dispatcher| body(tx, dispatcher, &mut turns));
        if let Ok(Some(_)) = result {
            self.deferred = turns.heads;
            self.key_turns += turns.promoted;
        }
        result
    }

    /// Whether a drain would find work now (sql/worker/in_line.sql), or
    /// key passes wait from before; read only. `true` without the outbox:
    /// the claim finds that out.
    pub fn in_line(&mut self) -> Result<bool, StoreError> {
        if !self.deferred.is_empty() {
            return Ok(true);
        }
        let mut due = self.due;
        let found = self.transaction(|tx, _| {
            due.raise(tx)?;
            get::<bool>(&tx.run(Stmt::InLine, &[due.arg()])?.rows[0], 0)
        })?;
        self.due = due;
        Ok(found.flatten().unwrap_or(true))
    }

    /// Is the outbox installed in this database?
    pub fn extension_exists(&mut self) -> Result<bool, StoreError> {
        self.transaction(|_, _| Ok(())).map(|found| found.is_some())
    }

    /// Whether this database (of OID `database`) holds its own events or a
    /// copy's; `None` without the outbox.
    pub fn home(&mut self, database: u32) -> Result<Option<Home>, StoreError> {
        let awaited = self.awaited;
        self.transaction(|tx, _| {
            let rows = tx.run(Stmt::Home, &[Arg::Oid(database), Arg::Bool(awaited)])?;
            let row = rows.rows.first().map(Vec::as_slice).unwrap_or_default();
            let recorded = get::<i64>(row, 0)?.map_or(database, |oid| oid as u32);
            Ok(match (recorded == database, get::<bool>(row, 1)?.unwrap_or(false)) {
                (true, _) => Home::Own,
                (false, true) => Home::Adopted(recorded),
                (false, false) => Home::CopyOf(recorded, get::<String>(row, 2)?.unwrap_or_default()),
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
        let released = self.transaction(|tx, _| {
            let args = [Arg::Int4(dispatcher), ms(timeout), count(BATCHES_PER_SWEEP)];
            let batches = batch_ids(tx, Stmt::Abandon, &args)?;
            if batches.is_empty() {
                return Ok(0);
            }
            // A statement of its own: a snapshot taken once the batches are
            // locked (sql/worker/reline_abandoned.sql).
            Ok(tx.run(Stmt::RelineAbandoned, &[Arg::Int8Array(batches)])?.touched)
        })?;
        Ok(released.unwrap_or(0))
    }

    /// Records `settled` (the previous push's outcome; may be empty), makes
    /// the batches of accumulated subscriptions that are due (members cut
    /// at `batch_budget` bytes each), puts in line the events whose time
    /// has come, and claims what `bounds` allow, in one transaction: a
    /// dispatcher under load spends one transaction per batch, not two.
    /// Nothing is written to outbox.log after the claim (claim.sql).
    pub fn settle_and_claim(
        &mut self,
        settled: &Outcome,
        bounds: Bounds,
        batch_budget: i64,
    ) -> Result<Claim, StoreError> {
        let mut backoff = std::mem::take(&mut self.flush_backoff);
        let mut due = self.due;
        let acks = self.acks;
        let claimed = self.with_turns(|tx, dispatcher, turns| {
            let promoted = turns.promoted;
            mark(tx, dispatcher, settled, acks, turns)?;
            // Before the claim, which may take the new heads.
            turns.pass(tx)?;
            let flushed = batches::flush(tx, batch_budget, &mut backoff)?;
            if flushed.batches > 0 {
                // The batches are pushed once this commits: it must outlive a
                // crash, or their members would be flushed again into a batch
                // with another id (task id), which consumers could not tell
                // from a new one.
                tx.durable_commit()?;
            }
            due.raise(tx)?;
            let came_due = tx.run(Stmt::CameDue, &[count(SWEEP_BATCH), due.arg()])?.touched;
            // Events this transaction put in line: its own snapshot may not
            // see them as ended, and the claim leaves them to the next one,
            // due at once.
            let lined = came_due > 0
                || turns.promoted > promoted
                || flushed.batches > 0
                || !settled.released.is_empty();
            let mut taken = claim::claim(tx, dispatcher, bounds)?;
            ids::refuse_copies(tx, &mut taken.events)?;
            let next_due = if taken.events.is_empty() && lined {
                Some(Duration::ZERO)
            } else if taken.events.is_empty() {
                let rows = tx.run(Stmt::NextDue, &[Arg::Int8Array(backoff.current()), due.arg()])?;
                let seconds = match rows.rows.first() {
                    Some(row) => get::<f64>(row, 0)?,
                    None => None,
                };
                seconds.and_then(|s| Duration::try_from_secs_f64(s.max(0.0)).ok())
            } else {
                None
            };
            Ok((flushed, taken, next_due))
        });
        self.flush_backoff = backoff;
        self.due = due;
        let (flushed, taken, next_due) = match claimed? {
            Some(claimed) => claimed,
            None => return Ok(Claim::NoExtension),
        };
        Ok(Claim::Claimed {
            flushed,
            events: taken.events,
            batch: taken.batch,
            drained: taken.drained,
            next_due,
        })
    }

    /// Records `settled` on its own, when no claim is to follow.
    pub fn settle(&mut self, settled: &Outcome) -> Result<(), StoreError> {
        let acks = self.acks;
        self.with_turns(|tx, dispatcher, turns| {
            mark(tx, dispatcher, settled, acks, turns)?;
            turns.pass(tx)
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
        let swept =
            self.transaction(|tx, _| Ok(tx.run(Stmt::SweepStrays, &[count(SWEEP_BATCH)])?.touched))?;
        Ok(swept.unwrap_or(0))
    }

    /// The partitions whose triggers a restore or a copy left off
    /// (`outbox.triggers_off()`).
    pub fn triggers_off(&mut self) -> Result<Vec<TriggersOff>, StoreError> {
        let found = self.transaction(|tx, _| {
            let mut off = Vec::new();
            for row in tx.run(Stmt::TriggersOff, &[])?.rows {
                off.push(TriggersOff {
                    generation: get::<i64>(&row, 0)?.unwrap_or(0) as i32,
                    disabled: get::<bool>(&row, 1)?.unwrap_or(false),
                    pages: get::<i64>(&row, 2)?.unwrap_or(0),
                });
            }
            Ok(off)
        })?;
        Ok(found.unwrap_or_default())
    }

    /// Puts in line the rows of generation `generation`'s pages `pages`
    /// that a restore wrote with the triggers off inside windows the claims
    /// had read (sql/worker/reline_restored.sql); returns how many.
    pub fn reline_restored(
        &mut self,
        generation: i32,
        pages: std::ops::Range<i64>,
    ) -> Result<u64, StoreError> {
        let args = [
            Arg::Int4(Some(generation)),
            Arg::Int8(Some(pages.start)),
            Arg::Int8(Some(pages.end - pages.start)),
        ];
        let relined = self.transaction(|tx, _| Ok(tx.run(Stmt::RelineRestored, &args)?.touched))?;
        Ok(relined.unwrap_or(0))
    }

    /// Generation `generation`'s triggers fire always again.
    pub fn fire_always(&mut self, generation: i32) -> Result<(), StoreError> {
        self.transaction(|tx, _| tx.run(Stmt::FireAlways, &[Arg::Int4(Some(generation))]).map(drop))?;
        Ok(())
    }

    /// Up to [`SWEEP_BATCH`] events dispatched longer than `timeout` ago,
    /// in batches marked while acknowledgements were on, and never
    /// acknowledged: back to pending to be sent again, or failed when
    /// re-sent `max_redeliveries` times already. Returns how many of each:
    /// (resent, failed).
    pub fn sweep_unacked(
        &mut self,
        timeout: Duration,
        max_redeliveries: i32,
    ) -> Result<(u64, u64), StoreError> {
        let swept = self.with_turns(|tx, _, turns| {
            let batches = batch_ids(tx, Stmt::SettleUnacked, &[ms(timeout), count(BATCHES_PER_SWEEP)])?;
            let (mut resent, mut failed) = (0, 0);
            if batches.is_empty() {
                return Ok((resent, failed));
            }
            // A statement of its own: a snapshot taken once the batches are
            // locked (sql/worker/sweep_unacked.sql).
            let args = [Arg::Int8Array(batches), Arg::Int4(Some(max_redeliveries))];
            for row in tx.run(Stmt::SweepUnacked, &args)?.rows {
                if get::<bool>(&row, 0)?.unwrap_or(false) {
                    failed += 1;
                    turns.failed(keys::head_of(&row, 1)?);
                } else {
                    resent += 1;
                }
            }
            turns.pass(tx)?;
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
        let swept = self.transaction(|tx, _| {
            let args = [Arg::Bool(policy.failed), Arg::Bool(policy.dispatched), count(SWEEP_BATCH)];
            let (mut heads, mut stranded) = (Vec::new(), Vec::new());
            for row in tx.run(Stmt::SweepKeys, &args)?.rows {
                let key = Key {
                    ordering_key: get::<String>(&row, 1)?.unwrap_or_default(),
                    subscription: get::<i64>(&row, 2)?.unwrap_or(0),
                };
                match get::<Uuid>(&row, 0)? {
                    Some(id) => heads.push(Head { id, key }),
                    None => stranded.push(key),
                }
            }
            let promoted = keys::pass(tx, heads, &stranded, policy, false)?.promoted;
            if promoted > 0 {
                // As in Turns::pass: the new heads may be sent right after.
                tx.durable_commit()?;
            }
            Ok(promoted)
        })?;
        let promoted = swept.unwrap_or(0);
        self.key_turns += promoted;
        Ok(promoted)
    }

    /// Records the outcomes Celery workers reported, in one statement;
    /// returns how many events took one of each kind: (processed, failed).
    /// The others were stale.
    pub fn apply_reports(&mut self, reports: &[Report]) -> Result<(u64, u64), StoreError> {
        let applied = self.with_turns(|tx, _, turns| {
            // The reports are trimmed off the broker's list once this
            // commits: it must outlive a crash, or they would be lost.
            tx.durable_commit()?;
            let args = [
                Arg::UuidArray(reports.iter().map(|r| r.id).collect()),
                Arg::UuidArray(reports.iter().map(|r| r.send).collect()),
                Arg::texts(reports.iter().map(|r| r.outcome.status().to_string())),
                Arg::TextArray(reports.iter().map(|r| r.outcome.error().map(str::to_string)).collect()),
            ];
            let (mut processed, mut failed) = (0, 0);
            let mut touched = Vec::new();
            for row in tx.run(Stmt::ApplyReports, &args)?.rows {
                touched.extend(get::<i64>(&row, 4)?);
                let head = keys::head_of(&row, 1)?;
                match get::<String>(&row, 0)?.as_deref() {
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
            tx.run(Stmt::SettleReported, &[Arg::Int8Array(touched)])?;
            turns.pass(tx)?;
            Ok((processed, failed))
        })?;
        Ok(applied.unwrap_or((0, 0)))
    }

    /// One step of the rotation (sql/rotation.sql) with generations of
    /// `retention`: what it did, and how many events it moved or
    /// truncated; `None` when nothing was due.
    pub fn rotate(&mut self, retention: Duration, acks: bool) -> Result<Option<(String, u64)>, StoreError> {
        let step = self.transaction(|tx, _| {
            let rows = tx.run(Stmt::Rotate, &[ms(retention), count(SWEEP_BATCH), Arg::Bool(acks)])?;
            let row = rows.rows.first().map(Vec::as_slice).unwrap_or_default();
            let step: Option<String> = get(row, 0)?;
            let events: Option<i64> = get(row, 1)?;
            Ok(step.map(|step| (step, events.unwrap_or(0) as u64)))
        })?;
        Ok(step.flatten())
    }

    /// Deletes up to [`FORGET_BATCH`] batches whose events are all gone.
    pub fn forget_batches(&mut self) -> Result<u64, StoreError> {
        let forgotten = self.transaction(|tx, _| {
            let rows = tx.run(Stmt::ForgetBatches, &[count(FORGET_BATCH)])?;
            let deleted = match rows.rows.first() {
                Some(row) => get::<i64>(row, 0)?,
                None => None,
            };
            Ok(deleted.unwrap_or(0) as u64)
        })?;
        Ok(forgotten.unwrap_or(0))
    }

    /// Deletes up to [`SWEEP_BATCH`] inbox rows claimed longer than
    /// `retention` ago.
    pub fn purge_inbox(&mut self, retention: Duration) -> Result<u64, StoreError> {
        let purged = self.transaction(|tx, _| {
            Ok(tx.run(Stmt::PurgeInbox, &[ms(retention), count(SWEEP_BATCH)])?.touched)
        })?;
        Ok(purged.unwrap_or(0))
    }
}

/// Runs `stmt`, which returns the ids of the batches it took (locked until
/// the transaction ends), for a statement of their own.
fn batch_ids(tx: &mut dyn Tx, stmt: Stmt, args: &[Arg]) -> Result<Vec<i64>, DbError> {
    let mut ids = Vec::new();
    for row in tx.run(stmt, args)?.rows {
        ids.extend(get::<i64>(&row, 0)?);
    }
    Ok(ids)
}

/// Records one push's outcome while its batch is still this claim's: the
/// batch is marked (as awaiting acknowledgements, with `acks`), `failures`
/// go out of line until their backoff or to the dead letter, `released` back in line as they were. A batch a
/// sweeper took meanwhile records nothing: its events are back in line.
fn mark(
    tx: &mut dyn Tx,
    dispatcher: i32,
    outcome: &Outcome,
    acks: bool,
    turns: &mut keys::Turns,
) -> Result<(), DbError> {
    let Some(batch) = outcome.batch.filter(|_| !outcome.is_empty()) else {
        return Ok(());
    };
    let args = [Arg::Int8(Some(batch.id)), Arg::Int4(Some(dispatcher)), Arg::Bool(acks)];
    let marked = tx.run(Stmt::MarkDispatched, &args)?;
    if marked.touched == 0 {
        return Ok(());
    }
    for head in &outcome.heads {
        turns.dispatched(Some(head.clone()));
    }
    let failures = &outcome.failures;
    let leaving: Vec<_> =
        failures.iter().map(|f| f.id).chain(outcome.released.iter().map(|(id, _)| *id)).collect();
    if !leaving.is_empty() {
        tx.run(Stmt::LockEvents, &[Arg::UuidArray(leaving)])?;
    }
    if !failures.is_empty() {
        let status = |f: &Failure| if f.dead { "failed" } else { "pending" }.to_string();
        let args = [
            Arg::UuidArray(failures.iter().map(|f| f.id).collect()),
            Arg::texts(failures.iter().map(|f| f.position.clone())),
            Arg::texts(failures.iter().map(status)),
            Arg::texts(failures.iter().map(|f| f.error.clone())),
            Arg::Float8Array(failures.iter().map(|f| f.delay.as_secs_f64() * 1000.0).collect()),
            Arg::BoolArray(failures.iter().map(|f| f.spent).collect()),
        ];
        for row in tx.run(Stmt::MarkFailed, &args)?.rows {
            turns.failed(keys::head_of(&row, 0)?);
        }
    }
    if !outcome.released.is_empty() {
        let args = [
            Arg::UuidArray(outcome.released.iter().map(|(id, _)| *id).collect()),
            Arg::texts(outcome.released.iter().map(|(_, position)| position.clone())),
        ];
        tx.run(Stmt::Release, &args)?;
    }
    Ok(())
}
