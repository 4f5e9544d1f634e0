//! The dispatcher's statements against `outbox.events` (the SQL is in
//! sql/worker/). Each public function is one short transaction: no
//! transaction is ever held open across broker I/O.

use std::time::Duration;

use pgrx::bgworkers::BackgroundWorker;
use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::{PgBuiltInOids, PgOid};
use pgrx::prelude::*;
use pgrx::spi::{OwnedPreparedStatement, SpiClient, SpiError};

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
}

/// What a claim found.
pub enum Claim {
    /// The extension is not created in this database (yet, or any more).
    NoExtension,
    Claimed {
        events: Vec<ClaimedEvent>,
        /// Set when the claim found nothing: how long until the earliest
        /// delayed event falls due, if any waits.
        next_due: Option<Duration>,
    },
}

/// What one push did to each event of its batch, to be recorded.
#[derive(Default)]
pub struct Outcome {
    /// In Redis.
    pub dispatched: Vec<uuid::Uuid>,
    /// Back to pending after a backoff, or to the dead letter.
    pub failures: Vec<Failure>,
}

/// An event that failed for a reason of its own.
pub struct Failure {
    pub id: uuid::Uuid,
    /// Dead-lettered (`failed`) rather than retried.
    pub dead: bool,
    pub error: String,
    pub delay: Duration,
}

/// The plans, prepared the first time the table exists and kept for the
/// life of the dispatcher.
struct Plans {
    claim: OwnedPreparedStatement,
    next_due: OwnedPreparedStatement,
    mark_dispatched: OwnedPreparedStatement,
    mark_failed: OwnedPreparedStatement,
    release: OwnedPreparedStatement,
    sweep_stuck: OwnedPreparedStatement,
    sweep_unacked: OwnedPreparedStatement,
    purge: OwnedPreparedStatement,
}

pub struct Store {
    dispatcher: i32,
    plans: Option<Plans>,
}

const UUID_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::UUIDARRAYOID);
const TEXT_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::TEXTARRAYOID);
const FLOAT8_ARRAY: PgOid = PgOid::BuiltIn(PgBuiltInOids::FLOAT8ARRAYOID);
const INT4: PgOid = PgOid::BuiltIn(PgBuiltInOids::INT4OID);
const FLOAT8: PgOid = PgOid::BuiltIn(PgBuiltInOids::FLOAT8OID);
const BOOL: PgOid = PgOid::BuiltIn(PgBuiltInOids::BOOLOID);

/// Rows a sweeper touches per transaction.
pub const SWEEP_BATCH: usize = 1000;

impl Plans {
    fn prepare(client: &SpiClient<'_>) -> Result<Plans, SpiError> {
        let prepare = |sql: &str, args: &[PgOid]| client.prepare_mut(sql, args).map(|p| p.keep());
        Ok(Plans {
            claim: prepare(include_str!("../../sql/worker/claim.sql"), &[INT4, INT4])?,
            next_due: prepare(include_str!("../../sql/worker/next_due.sql"), &[])?,
            mark_dispatched: prepare(include_str!("../../sql/worker/mark_dispatched.sql"), &[UUID_ARRAY])?,
            mark_failed: prepare(
                include_str!("../../sql/worker/mark_failed.sql"),
                &[UUID_ARRAY, TEXT_ARRAY, TEXT_ARRAY, FLOAT8_ARRAY],
            )?,
            release: prepare(include_str!("../../sql/worker/release.sql"), &[UUID_ARRAY, INT4])?,
            sweep_stuck: prepare(include_str!("../../sql/worker/sweep_stuck.sql"), &[FLOAT8, INT4])?,
            sweep_unacked: prepare(include_str!("../../sql/worker/sweep_unacked.sql"), &[FLOAT8, INT4])?,
            purge: prepare(include_str!("../../sql/worker/purge.sql"), &[FLOAT8, INT4, BOOL])?,
        })
    }
}

fn extension_exists() -> bool {
    // SAFETY: a catalog lookup inside a transaction.
    unsafe { pg_sys::get_extension_oid(c"outbox_dispatch".as_ptr(), true) != pg_sys::InvalidOid }
}

fn to_pg(ids: impl IntoIterator<Item = uuid::Uuid>) -> Vec<pgrx::Uuid> {
    ids.into_iter().map(|id| pgrx::Uuid::from_bytes(*id.as_bytes())).collect()
}

impl Store {
    pub fn new(dispatcher: usize) -> Store {
        Store { dispatcher: dispatcher as i32, plans: None }
    }

    /// Runs `body` in a transaction with the plans ready; `None` when the
    /// extension does not exist in this database.
    fn with_plans<R>(
        &mut self,
        body: impl FnOnce(&mut SpiClient<'_>, &Plans, i32) -> Result<R, SpiError>,
    ) -> Result<Option<R>, SpiError> {
        let dispatcher = self.dispatcher;
        let plans = &mut self.plans;
        BackgroundWorker::transaction(std::panic::AssertUnwindSafe(|| {
            if !extension_exists() {
                *plans = None;
                return Ok(None);
            }
            Spi::connect_mut(|client| {
                if plans.is_none() {
                    *plans = Some(Plans::prepare(client)?);
                }
                let plans = plans.as_ref().expect("prepared above");
                body(client, plans, dispatcher).map(Some)
            })
        }))
    }

    /// Is the extension created in this database?
    pub fn extension_exists(&mut self) -> Result<bool, SpiError> {
        self.with_plans(|_, _, _| Ok(())).map(|found| found.is_some())
    }

    /// Returns to pending whatever this dispatcher held when it last died.
    pub fn release_own(&mut self) -> Result<u64, SpiError> {
        self.release_where(None)
    }

    /// Returns `ids` to pending without spending a retry.
    pub fn release(&mut self, ids: impl IntoIterator<Item = uuid::Uuid>) -> Result<u64, SpiError> {
        self.release_where(Some(to_pg(ids)))
    }

    fn release_where(&mut self, ids: Option<Vec<pgrx::Uuid>>) -> Result<u64, SpiError> {
        let released = self.with_plans(|client, plans, dispatcher| {
            let args: [DatumWithOid; 2] = [ids.into(), dispatcher.into()];
            Ok(client.update(&plans.release, None, &args)?.len() as u64)
        })?;
        Ok(released.unwrap_or(0))
    }

    /// Records `settled` (the previous push's outcome; may be empty) and
    /// claims up to `limit` due events, in one transaction: a dispatcher
    /// under load spends one transaction per batch, not two.
    pub fn settle_and_claim(&mut self, settled: &Outcome, limit: usize) -> Result<Claim, SpiError> {
        let claimed = self.with_plans(|client, plans, dispatcher| {
            mark(client, plans, settled)?;
            let args: [DatumWithOid; 2] = [(limit as i32).into(), dispatcher.into()];
            let table = client.update(&plans.claim, None, &args)?;
            let mut events = Vec::with_capacity(table.len());
            for row in table {
                let Some(id) = row.get::<pgrx::Uuid>(1)? else {
                    continue;
                };
                events.push(ClaimedEvent {
                    id: uuid::Uuid::from_bytes(*id.as_bytes()),
                    event_type: row.get(2)?.unwrap_or_default(),
                    payload: row.get(3)?.unwrap_or_default(),
                    queue: row.get(4)?.unwrap_or_default(),
                    task: row.get(5)?.unwrap_or_default(),
                    headers: row.get(6)?,
                    priority: row.get::<i16>(7)?.unwrap_or(0).clamp(0, 9) as u8,
                    retry_count: row.get(8)?.unwrap_or(0),
                    created_at: row.get(9)?.unwrap_or_default(),
                    created_epoch: row.get(10)?.unwrap_or(0.0),
                });
            }
            let next_due = if events.is_empty() {
                let seconds: Option<f64> = client.select(&plans.next_due, None, &[])?.first().get_one()?;
                seconds.map(|s| Duration::from_secs_f64(s.max(0.0)))
            } else {
                None
            };
            Ok(Claim::Claimed { events, next_due })
        })?;
        Ok(claimed.unwrap_or(Claim::NoExtension))
    }

    /// Records `settled` on its own, when no claim is to follow.
    pub fn settle(&mut self, settled: &Outcome) -> Result<(), SpiError> {
        self.with_plans(|client, plans, _| mark(client, plans, settled))?;
        Ok(())
    }

    /// Returns to pending up to [`SWEEP_BATCH`] events claimed longer than
    /// `timeout` ago.
    pub fn sweep_stuck(&mut self, timeout: Duration) -> Result<u64, SpiError> {
        self.sweep(|p| &p.sweep_stuck, timeout, None)
    }

    /// Returns to pending up to [`SWEEP_BATCH`] events dispatched longer
    /// than `timeout` ago and never acknowledged.
    pub fn sweep_unacked(&mut self, timeout: Duration) -> Result<u64, SpiError> {
        self.sweep(|p| &p.sweep_unacked, timeout, None)
    }

    /// Deletes up to [`SWEEP_BATCH`] finished events older than `retention`;
    /// with `acks_off`, dispatched ones count as finished.
    pub fn purge(&mut self, retention: Duration, acks_off: bool) -> Result<u64, SpiError> {
        self.sweep(|p| &p.purge, retention, Some(acks_off))
    }

    fn sweep(
        &mut self,
        plan: fn(&Plans) -> &OwnedPreparedStatement,
        age: Duration,
        acks_off: Option<bool>,
    ) -> Result<u64, SpiError> {
        let swept = self.with_plans(|client, plans, _| {
            let mut args: Vec<DatumWithOid> =
                vec![(age.as_secs_f64() * 1000.0).into(), (SWEEP_BATCH as i32).into()];
            args.extend(acks_off.map(DatumWithOid::from));
            Ok(client.update(plan(plans), None, &args)?.len() as u64)
        })?;
        Ok(swept.unwrap_or(0))
    }
}

/// Records one push's outcome: `dispatched` are in Redis, `failures` go back
/// to pending or to the dead letter.
fn mark(client: &mut SpiClient<'_>, plans: &Plans, outcome: &Outcome) -> Result<(), SpiError> {
    if !outcome.dispatched.is_empty() {
        let args: [DatumWithOid; 1] = [to_pg(outcome.dispatched.iter().copied()).into()];
        client.update(&plans.mark_dispatched, None, &args)?;
    }
    let failures = &outcome.failures;
    if !failures.is_empty() {
        let status = |f: &Failure| if f.dead { "failed" } else { "pending" }.to_string();
        let args: [DatumWithOid; 4] = [
            to_pg(failures.iter().map(|f| f.id)).into(),
            failures.iter().map(status).collect::<Vec<_>>().into(),
            failures.iter().map(|f| f.error.clone()).collect::<Vec<_>>().into(),
            failures.iter().map(|f| f.delay.as_secs_f64() * 1000.0).collect::<Vec<_>>().into(),
        ];
        client.update(&plans.mark_failed, None, &args)?;
    }
    Ok(())
}
