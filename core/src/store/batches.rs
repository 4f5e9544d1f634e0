//! The batches of accumulated subscriptions, made at the start of each
//! claim's transaction (sql/worker/flush_batches.sql) so that the claim
//! that follows sends them.
//!
//! A batch that cannot be made costs a bounded effort and holds up nothing
//! but its own subscription. The flush runs in a subtransaction, within a
//! quarter of the transaction's deadline: when it fails, each subscription
//! is flushed alone, in a subtransaction of its own, within another
//! quarter. One that fails for a reason that passes (a lock, a deadlock,
//! memory, running out of its time) is left alone by this dispatcher for a
//! while, longer each time; the claim that follows has half the deadline. One that
//! fails for a reason that would not pass (a batch over a limit, a
//! constraint) has its members dead-lettered, each as a failed batch of
//! one carrying the error (sql/worker/fail_batch.sql), which
//! `outbox.dead_letters` and `outbox.subscriptions.last_error` show and
//! `outbox_retry()` sends again, alone.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::sql::{get, subtransaction, Arg, DbError, Stmt, Tx};
use crate::backoff;

/// How long a subscription whose flush failed for a passing reason is left
/// alone: at first, and at most.
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// What a flush did.
#[derive(Debug, Default)]
pub struct Flushed {
    /// Batches made, and the members they carry.
    pub batches: u64,
    pub events: u64,
    /// Members dead-lettered because their batch could not be made.
    pub dead_lettered: u64,
    /// Why subscriptions failed, for `outbox.workers.last_error`.
    pub errors: Vec<String>,
}

/// Subscriptions this dispatcher leaves alone until a time, after a flush
/// that failed for a passing reason.
#[derive(Default)]
pub struct Backoff {
    until: HashMap<i64, (Instant, u32)>,
}

impl Backoff {
    /// The subscriptions still backed off; forgets the others.
    pub(super) fn current(&mut self) -> Vec<i64> {
        let now = Instant::now();
        self.until.retain(|_, (until, _)| *until > now);
        self.until.keys().copied().collect()
    }

    fn failed(&mut self, subscription: i64) {
        let attempts = self.until.get(&subscription).map_or(0, |(_, attempts)| *attempts);
        let delay = backoff::reconnect_delay(BACKOFF_MIN, BACKOFF_MAX, attempts, backoff::random_unit());
        self.until.insert(subscription, (Instant::now() + delay, attempts.saturating_add(1)));
    }

    /// When the first backed-off subscription may be tried again.
    pub fn next_due(&self) -> Option<Instant> {
        self.until.values().map(|(until, _)| *until).min()
    }
}

/// Makes the due batches, members cut at `budget` bytes of JSON each.
pub(super) fn flush(tx: &mut dyn Tx, budget: i64, backoff: &mut Backoff) -> Result<Flushed, DbError> {
    let skipped = backoff.current();
    let quarter = tx.time_left() / 4;
    let mut flushed = Flushed::default();
    let until = Instant::now() + quarter;
    match subtransaction(tx, until, |tx| flush_some(tx, budget, &skipped, None)) {
        Ok(subscriptions) => flushed.count(subscriptions),
        Err(_) => {
            // Which subscription failed is not known: each alone, while
            // time is left; the others are tried again by the next claim.
            let mut accumulated = Vec::new();
            for row in tx.run(Stmt::Accumulating, &[])?.rows {
                accumulated.extend(get::<i64>(&row, 0)?.filter(|id| !skipped.contains(id)));
            }
            let until = Instant::now() + quarter;
            for subscription in accumulated {
                if Instant::now() >= until {
                    break;
                }
                flushed.one(tx, until, budget, backoff, &skipped, subscription);
            }
        }
    }
    Ok(flushed)
}

impl Flushed {
    /// Counts the members batched, by subscription.
    fn count(&mut self, subscriptions: Vec<i64>) {
        self.events += subscriptions.len() as u64;
        self.batches += subscriptions.into_iter().collect::<HashSet<_>>().len() as u64;
    }

    /// Flushes `subscription` alone, by `until`; when that fails, backs it
    /// off or dead-letters its next batch's members.
    fn one(
        &mut self,
        tx: &mut dyn Tx,
        until: Instant,
        budget: i64,
        backoff: &mut Backoff,
        skipped: &[i64],
        subscription: i64,
    ) {
        let error = match subtransaction(tx, until, |tx| flush_some(tx, budget, skipped, Some(subscription)))
        {
            Ok(subscriptions) => {
                self.count(subscriptions);
                return;
            }
            Err(error) if error.passes() => error,
            Err(error) => {
                let reason = format!("its batch could not be made: {error}");
                match subtransaction(tx, until, |tx| fail_batch(tx, budget, subscription, &reason)) {
                    Ok(failed) => {
                        self.dead_lettered += failed;
                        self.errors.push(format!(
                            "subscription {subscription}: {reason}; {failed} events dead-lettered"
                        ));
                        return;
                    }
                    Err(e) => e,
                }
            }
        };
        backoff.failed(subscription);
        self.errors.push(format!(
            "subscription {subscription}: its batch could not be made: {error}; trying again later"
        ));
    }
}

fn flush_some(tx: &mut dyn Tx, budget: i64, skipped: &[i64], only: Option<i64>) -> Result<Vec<i64>, DbError> {
    let args = [Arg::Int8(Some(budget)), Arg::Int8Array(skipped.to_vec()), Arg::Int8(only)];
    tx.run(Stmt::FlushBatches, &args)?
        .rows
        .iter()
        .map(|row| get::<i64>(row, 0).map(Option::unwrap_or_default))
        .collect()
}

fn fail_batch(tx: &mut dyn Tx, budget: i64, subscription: i64, reason: &str) -> Result<u64, DbError> {
    let args = [Arg::Int8(Some(subscription)), Arg::Text(reason.to_string()), Arg::Int8(Some(budget))];
    Ok(tx.run(Stmt::FailBatch, &args)?.touched)
}
