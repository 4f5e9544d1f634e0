//! The counters and histograms in shared memory, and their samples.
//!
//! One set per group of dispatchers, that is per database served: a
//! process counts into its database's set, and `outbox.metrics` shows the
//! set of the database it is read in. Every update is one relaxed atomic
//! add: no lock on the hot path. Shared memory outlives a dispatcher, so
//! the numbers survive its restarts; a server restart resets them, as it
//! resets PostgreSQL's own statistics, and so does the launcher giving
//! the group to a database anew.
//! Each labelled family is one `named!` table, so a new counter, reason or
//! source is one line.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pgrx::prelude::*;
use pgrx::shmem::AssertPGRXSharedMemory;
use pgrx::{pg_shmem_init, PgAtomic};

use outbox_core::exposition::{
    bucket_index, histogram_samples, Family, Kind, Sample, BATCH_SIZE_BOUNDS, LATENCY_BOUNDS_SECONDS,
};
use outbox_core::named;
use outbox_core::sink::{Condition, Reason, SinkError};

use crate::config::MAX_DATABASES;
use crate::slots::{self, WakeSource};

named! {
    /// Plain counters: the metric's name (without `_total`) and its help.
    pub enum Counter {
        Dispatched = "outbox_dispatched" => "Events pushed to the broker.",
        Retries = "outbox_retries" => "Retries scheduled after an event's push failed.",
        DeadLetters = "outbox_dead_letters" => "Events moved to failed (the dead letter).",
        StuckRescued = "outbox_stuck_rescued"
            => "Events in processing longer than outbox.processing_timeout returned to pending.",
        UnackedResent = "outbox_unacked_resent"
            => "Dispatched events not acknowledged within outbox.ack_timeout, returned to pending.",
        UnackedFailed = "outbox_unacked_failed"
            => "Dispatched events never acknowledged after outbox.max_redeliveries re-sends, moved to failed.",
        TaskFailures = "outbox_task_failures"
            => "Events whose Celery task failed, or that a worker refused, as reported by outbox_dispatch.celery.",
        Expired = "outbox_expired" => "Events not sent because they expired first.",
        MasterChanges = "outbox_broker_master_changes"
            => "Reconnects that found the Redis master at another address than before (a failover).",
        Purged = "outbox_purged" => "Finished events truncated with their generation, outbox.retention after it ended.",
        Batches = "outbox_batches" => "Batches pushed to the broker.",
        InboxDuplicates = "outbox_inbox_duplicates"
            => "Messages outbox_inbox_claim() found claimed already: runs whose effects were skipped.",
        KeyTurns = "outbox_key_turns"
            => "Events that became their key's head, the event before them finished (per-key order).",
        AccumulatedBatches = "outbox_accumulated_batches"
            => "Deliveries made of the waiting events of an accumulated subscription.",
        AccumulatedEvents = "outbox_accumulated_events"
            => "Events delivered inside the batches of accumulated subscriptions.",
    }
}

named! {
    /// Why events of a batch were not delivered.
    pub enum PushFailure {
        Connection = "connection",
        Timeout = "timeout",
        RedisError = "redis_error",
        Unencodable = "unencodable",
        Refused = "refused",
    }
}

named! {
    /// Who confirmed that an event was processed.
    pub enum AckSource {
        /// `outbox_ack()`.
        Sql = "sql",
        /// A report from a Celery worker running `outbox_dispatch.celery`.
        Celery = "celery",
    }
}

named! {
    /// Why a report from a Celery worker changed nothing.
    pub enum ReportIgnored {
        /// Its event is gone (purged) or already final.
        Stale = "stale",
        /// Not a report this version understands.
        Malformed = "malformed",
    }
}

impl PushFailure {
    pub fn of(error: &SinkError) -> PushFailure {
        match error {
            SinkError::Timeout => PushFailure::Timeout,
            SinkError::Refused(..) => PushFailure::Refused,
            _ => PushFailure::Connection,
        }
    }
}

#[repr(C)]
struct Histogram<const N: usize> {
    buckets: [AtomicU64; N],
    /// Sum of the observations in millionths of the unit.
    sum_micros: AtomicU64,
}

impl<const N: usize> Histogram<N> {
    fn new() -> Self {
        Histogram { buckets: std::array::from_fn(|_| AtomicU64::new(0)), sum_micros: AtomicU64::new(0) }
    }

    fn observe(&self, bounds: &[f64], value: f64) {
        self.buckets[bucket_index(bounds, value)].fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add((value.max(0.0) * 1e6) as u64, Ordering::Relaxed);
    }

    fn samples(&self, name: &str, bounds: &[f64]) -> Vec<Sample> {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        histogram_samples(name, bounds, &counts, self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6)
    }
}

const LATENCY_BUCKETS: usize = LATENCY_BOUNDS_SECONDS.len() + 1;
const BATCH_BUCKETS: usize = BATCH_SIZE_BOUNDS.len() + 1;

#[repr(C)]
pub struct Counters {
    counters: [AtomicU64; Counter::COUNT],
    push_failures: [AtomicU64; PushFailure::COUNT],
    reconnects: [AtomicU64; Reason::COUNT],
    refusals: [AtomicU64; Condition::COUNT],
    wakeups: [AtomicU64; WakeSource::COUNT],
    acks: [AtomicU64; AckSource::COUNT],
    reports_ignored: [AtomicU64; ReportIgnored::COUNT],
    /// Microseconds dispatchers spent without a working broker connection.
    unavailable_micros: AtomicU64,
    latency: Histogram<LATENCY_BUCKETS>,
    batch_size: Histogram<BATCH_BUCKETS>,
}

static COUNTERS: PgAtomic<AssertPGRXSharedMemory<[Counters; MAX_DATABASES]>> =
    unsafe { PgAtomic::new(c"outbox_dispatch_metrics") };
static READY: AtomicBool = AtomicBool::new(false);

fn zeros<const N: usize>() -> [AtomicU64; N] {
    std::array::from_fn(|_| AtomicU64::new(0))
}

/// Requests the shared memory; `_PG_init` calls this only while preloading.
pub fn init() {
    pg_shmem_init!(
        COUNTERS = unsafe {
            AssertPGRXSharedMemory::new(std::array::from_fn(|_| Counters {
                counters: zeros(),
                push_failures: zeros(),
                reconnects: zeros(),
                refusals: zeros(),
                wakeups: zeros(),
                acks: zeros(),
                reports_ignored: zeros(),
                unavailable_micros: AtomicU64::new(0),
                latency: Histogram::new(),
                batch_size: Histogram::new(),
            }))
        }
    );
    READY.store(true, Ordering::Relaxed);
}

/// The counters of this process's database, when a group serves it.
fn counters() -> Option<&'static Counters> {
    if !READY.load(Ordering::Relaxed) {
        return None;
    }
    // SAFETY: a process global.
    let group = slots::group_of(unsafe { pg_sys::MyDatabaseId })?;
    Some(&COUNTERS.get()[group])
}

/// Sets group `g`'s counters to zero, as the launcher gives it to a database.
pub fn reset(g: usize) {
    if !READY.load(Ordering::Relaxed) {
        return;
    }
    let c = &COUNTERS.get()[g];
    let histograms = [&c.latency.buckets[..], &c.batch_size.buckets[..]];
    let tables = [
        &c.counters[..],
        &c.push_failures[..],
        &c.reconnects[..],
        &c.refusals[..],
        &c.wakeups[..],
        &c.acks[..],
        &c.reports_ignored[..],
    ];
    let sums = [&c.unavailable_micros, &c.latency.sum_micros, &c.batch_size.sum_micros];
    for value in tables.into_iter().chain(histograms).flatten().chain(sums) {
        value.store(0, Ordering::Relaxed);
    }
}

/// Adds `n` to the counter `pick` chooses, once the shared memory exists.
fn bump(pick: impl FnOnce(&Counters) -> &AtomicU64, n: u64) {
    if let Some(c) = counters() {
        pick(c).fetch_add(n, Ordering::Relaxed);
    }
}

pub fn add(counter: Counter, n: u64) {
    bump(|c| &c.counters[counter.index()], n);
}

pub fn push_failed(reason: PushFailure, events: u64) {
    bump(|c| &c.push_failures[reason.index()], events);
}

/// A broker failure that made a dispatcher reconnect; a refusal is also
/// counted by the server's condition.
pub fn reconnect(error: &SinkError) {
    bump(|c| &c.reconnects[error.reason().index()], 1);
    if let SinkError::Refused(condition, _) = error {
        refused(*condition);
    }
}

/// The broker refused the dispatcher for a condition of its own.
pub fn refused(condition: Condition) {
    bump(|c| &c.refusals[condition.index()], 1);
}

pub fn woke(source: WakeSource) {
    bump(|c| &c.wakeups[source.index()], 1);
}

pub fn acked(source: AckSource, n: u64) {
    bump(|c| &c.acks[source.index()], n);
}

/// A dispatcher had no working broker connection for `pause`.
pub fn broker_unavailable(pause: std::time::Duration) {
    bump(|c| &c.unavailable_micros, pause.as_micros() as u64);
}

pub fn reports_ignored(reason: ReportIgnored, n: u64) {
    bump(|c| &c.reports_ignored[reason.index()], n);
}

/// One pushed batch: the events dispatched, the batch size, and each
/// event's creation-to-push latency.
pub fn observe_batch(latencies_seconds: &[f64]) {
    if let Some(c) = counters() {
        c.counters[Counter::Batches.index()].fetch_add(1, Ordering::Relaxed);
        c.counters[Counter::Dispatched.index()].fetch_add(latencies_seconds.len() as u64, Ordering::Relaxed);
        c.batch_size.observe(&BATCH_SIZE_BOUNDS, latencies_seconds.len() as f64);
        for latency in latencies_seconds {
            c.latency.observe(&LATENCY_BOUNDS_SECONDS, *latency);
        }
    }
}

/// `name_total{label=…}` for every entry of a table.
fn labelled(
    name: &str,
    label: &'static str,
    names: impl Iterator<Item = &'static str>,
    values: &[AtomicU64],
) -> Vec<Sample> {
    names
        .zip(values)
        .map(|(value_name, v)| {
            Sample::new(format!("{name}_total"), v.load(Ordering::Relaxed) as f64).label(label, value_name)
        })
        .collect()
}

/// The samples of every counter and histogram.
pub fn families() -> Vec<(Family, Vec<Sample>)> {
    let Some(c) = counters() else { return Vec::new() };
    let mut families = Vec::new();
    for counter in Counter::ALL {
        let f = Family { name: counter.name(), help: counter.help(), kind: Kind::Counter };
        let value = c.counters[counter.index()].load(Ordering::Relaxed) as f64;
        families.push((f, vec![Sample::new(format!("{}_total", f.name), value)]));
    }
    let labelled_families = [
        (
            "outbox_push_failures",
            "Events whose push failed, by reason.",
            "reason",
            PushFailure::ALL.map(PushFailure::name).to_vec(),
            &c.push_failures[..],
        ),
        (
            "outbox_reconnects",
            "Broker failures that made a dispatcher reconnect, by reason.",
            "reason",
            Reason::ALL.map(Reason::name).to_vec(),
            &c.reconnects[..],
        ),
        (
            "outbox_broker_refusals",
            "Pushes the broker refused for a condition of its own (OOM, READONLY, blocked, nacked, ...), by condition.",
            "condition",
            Condition::ALL.map(Condition::name).to_vec(),
            &c.refusals[..],
        ),
        (
            "outbox_wakeups",
            "Dispatcher wake-ups, by source.",
            "source",
            WakeSource::ALL.map(WakeSource::name).to_vec(),
            &c.wakeups[..],
        ),
        (
            "outbox_acked",
            "Events confirmed processed, by source: outbox_ack() or a Celery worker's report.",
            "source",
            AckSource::ALL.map(AckSource::name).to_vec(),
            &c.acks[..],
        ),
        (
            "outbox_reports_ignored",
            "Reports from Celery workers that changed nothing, by reason.",
            "reason",
            ReportIgnored::ALL.map(ReportIgnored::name).to_vec(),
            &c.reports_ignored[..],
        ),
    ];
    for (name, help, label, names, values) in labelled_families {
        let f = Family { name, help, kind: Kind::Counter };
        families.push((f, labelled(name, label, names.into_iter(), values)));
    }
    let unavailable = Family {
        name: "outbox_broker_unavailable_seconds",
        help: "Seconds dispatchers spent without a working broker connection, from a failure to the next connect.",
        kind: Kind::Counter,
    };
    let seconds = c.unavailable_micros.load(Ordering::Relaxed) as f64 / 1e6;
    families.push((unavailable, vec![Sample::new(format!("{}_total", unavailable.name), seconds)]));
    let latency = Family {
        name: "outbox_dispatch_latency_seconds",
        help: "Time from an event's created_at to its push to the broker.",
        kind: Kind::Histogram,
    };
    families.push((latency, c.latency.samples(latency.name, &LATENCY_BOUNDS_SECONDS)));
    let batch = Family { name: "outbox_batch_size", help: "Events per pushed batch.", kind: Kind::Histogram };
    families.push((batch, c.batch_size.samples(batch.name, &BATCH_SIZE_BOUNDS)));
    families
}
