//! Counters and histograms in shared memory, and the functions behind
//! `outbox.metrics` and `outbox_metrics_prometheus()`.
//!
//! Every update is one relaxed atomic add: no lock on the hot path. Shared
//! memory outlives a dispatcher, so the numbers survive its restarts; a
//! server restart resets them, as it resets PostgreSQL's own statistics.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use pgrx::prelude::*;
use pgrx::shmem::AssertPGRXSharedMemory;
use pgrx::{pg_shmem_init, PgAtomic};

use outbox_core::exposition::{
    self, bucket_index, histogram_samples, Family, Kind, Sample, BATCH_SIZE_BOUNDS, LATENCY_BOUNDS_SECONDS,
};
use outbox_core::sink::{SinkError, SERVER_CONDITIONS};

use crate::{config, slots};

/// Plain counters, one per variant.
#[derive(Debug, Clone, Copy)]
pub enum Counter {
    Dispatched,
    Retries,
    DeadLetters,
    StuckRescued,
    UnackedResent,
    Acked,
    Purged,
    Batches,
}

/// Why events of a batch were not delivered.
#[derive(Debug, Clone, Copy)]
pub enum PushFailure {
    Connection,
    Timeout,
    RedisError,
    Unencodable,
    Refused,
}

impl PushFailure {
    const NAMES: [&'static str; 5] = ["connection", "timeout", "redis_error", "unencodable", "refused"];

    pub fn of(error: &SinkError) -> PushFailure {
        match error {
            SinkError::Timeout => PushFailure::Timeout,
            _ => PushFailure::Connection,
        }
    }
}

/// What ended a dispatcher's sleep.
#[derive(Debug, Clone, Copy)]
pub enum WakeSource {
    Commit,
    Poll,
    Manual,
}

impl WakeSource {
    const NAMES: [&'static str; 3] = ["commit", "poll", "manual"];
}

#[repr(C)]
struct Histogram<const N: usize> {
    buckets: [AtomicU64; N],
    /// Sum of the observations in millionths of the unit.
    sum_micros: AtomicU64,
}

impl<const N: usize> Histogram<N> {
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
pub struct Metrics {
    counters: [AtomicU64; 8],
    push_failures: [AtomicU64; PushFailure::NAMES.len()],
    reconnects: [AtomicU64; SinkError::REASONS.len()],
    refusals: [AtomicU64; SERVER_CONDITIONS.len()],
    wakeups: [AtomicU64; WakeSource::NAMES.len()],
    latency: Histogram<LATENCY_BUCKETS>,
    batch_size: Histogram<BATCH_BUCKETS>,
}

static METRICS: PgAtomic<AssertPGRXSharedMemory<Metrics>> =
    unsafe { PgAtomic::new(c"outbox_dispatch_metrics") };
static READY: AtomicBool = AtomicBool::new(false);

/// Requests the shared memory; `_PG_init` calls this only while preloading.
pub fn init() {
    pg_shmem_init!(
        METRICS = unsafe {
            AssertPGRXSharedMemory::new(Metrics {
                counters: Default::default(),
                push_failures: Default::default(),
                reconnects: Default::default(),
                refusals: Default::default(),
                wakeups: Default::default(),
                latency: Histogram { buckets: Default::default(), sum_micros: AtomicU64::new(0) },
                batch_size: Histogram { buckets: Default::default(), sum_micros: AtomicU64::new(0) },
            })
        }
    );
    READY.store(true, Ordering::Relaxed);
}

fn metrics() -> Option<&'static Metrics> {
    READY.load(Ordering::Relaxed).then(|| &**METRICS.get())
}

pub fn add(counter: Counter, n: u64) {
    if let Some(m) = metrics() {
        m.counters[counter as usize].fetch_add(n, Ordering::Relaxed);
    }
}

pub fn push_failed(reason: PushFailure, events: u64) {
    if let Some(m) = metrics() {
        m.push_failures[reason as usize].fetch_add(events, Ordering::Relaxed);
    }
}

/// A broker failure that made a dispatcher reconnect; a refusal is also
/// counted by the server's condition.
pub fn reconnect(error: &SinkError) {
    let Some(m) = metrics() else { return };
    let reason =
        SinkError::REASONS.iter().position(|r| *r == error.reason()).expect("every reason is listed");
    m.reconnects[reason].fetch_add(1, Ordering::Relaxed);
    if let SinkError::Refused(condition, _) = error {
        let index = SERVER_CONDITIONS.iter().position(|(_, c)| c == condition).expect("a listed condition");
        m.refusals[index].fetch_add(1, Ordering::Relaxed);
    }
}

pub fn woke(source: WakeSource) {
    if let Some(m) = metrics() {
        m.wakeups[source as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// One pushed batch: the events dispatched, the batch size, and each
/// event's creation-to-push latency.
pub fn observe_batch(latencies_seconds: &[f64]) {
    if let Some(m) = metrics() {
        m.counters[Counter::Batches as usize].fetch_add(1, Ordering::Relaxed);
        m.counters[Counter::Dispatched as usize].fetch_add(latencies_seconds.len() as u64, Ordering::Relaxed);
        m.batch_size.observe(&BATCH_SIZE_BOUNDS, latencies_seconds.len() as f64);
        for latency in latencies_seconds {
            m.latency.observe(&LATENCY_BOUNDS_SECONDS, *latency);
        }
    }
}

const fn family(name: &'static str, help: &'static str, kind: Kind) -> Family {
    Family { name, help, kind }
}

fn counter_family(counter: Counter) -> Family {
    use Counter::*;
    match counter {
        Dispatched => family("outbox_dispatched", "Events pushed to Redis.", Kind::Counter),
        Retries => family("outbox_retries", "Retries scheduled after an event's push failed.", Kind::Counter),
        DeadLetters => {
            family("outbox_dead_letters", "Events moved to failed (the dead letter).", Kind::Counter)
        }
        StuckRescued => family(
            "outbox_stuck_rescued",
            "Events in processing longer than outbox.processing_timeout returned to pending.",
            Kind::Counter,
        ),
        UnackedResent => family(
            "outbox_unacked_resent",
            "Dispatched events not acknowledged within outbox.ack_timeout, returned to pending.",
            Kind::Counter,
        ),
        Acked => family("outbox_acked", "Events acknowledged with outbox_ack().", Kind::Counter),
        Purged => family("outbox_purged", "Finished events deleted after outbox.retention.", Kind::Counter),
        Batches => family("outbox_batches", "Batches pushed to Redis.", Kind::Counter),
    }
}

const COUNTERS: [Counter; 8] = [
    Counter::Dispatched,
    Counter::Retries,
    Counter::DeadLetters,
    Counter::StuckRescued,
    Counter::UnackedResent,
    Counter::Acked,
    Counter::Purged,
    Counter::Batches,
];

fn labelled(name: &str, label: &'static str, names: &[&'static str], values: &[AtomicU64]) -> Vec<Sample> {
    names
        .iter()
        .zip(values)
        .map(|(value_name, v)| {
            Sample::new(format!("{name}_total"), v.load(Ordering::Relaxed) as f64).label(label, *value_name)
        })
        .collect()
}

/// The shared-memory metrics, then gauges read from `outbox.status` and the
/// dispatcher slots.
fn families() -> Vec<(Family, Vec<Sample>)> {
    let mut families = Vec::new();
    if let Some(m) = metrics() {
        for counter in COUNTERS {
            let f = counter_family(counter);
            let value = m.counters[counter as usize].load(Ordering::Relaxed) as f64;
            families.push((f, vec![Sample::new(format!("{}_total", f.name), value)]));
        }
        let push = family("outbox_push_failures", "Events whose push failed, by reason.", Kind::Counter);
        families.push((push, labelled(push.name, "reason", &PushFailure::NAMES, &m.push_failures)));
        let reconnects = family(
            "outbox_reconnects",
            "Broker failures that made a dispatcher reconnect, by reason.",
            Kind::Counter,
        );
        families.push((reconnects, labelled(reconnects.name, "reason", &SinkError::REASONS, &m.reconnects)));
        let refusals = family(
            "outbox_broker_refusals",
            "Pushes Redis refused for a condition of the server (OOM, READONLY, ...), by condition.",
            Kind::Counter,
        );
        let conditions: Vec<&'static str> = SERVER_CONDITIONS.iter().map(|(_, c)| *c).collect();
        families.push((refusals, labelled(refusals.name, "condition", &conditions, &m.refusals)));
        let wakeups = family("outbox_wakeups", "Dispatcher wake-ups, by source.", Kind::Counter);
        families.push((wakeups, labelled(wakeups.name, "source", &WakeSource::NAMES, &m.wakeups)));
        let latency = family(
            "outbox_dispatch_latency_seconds",
            "Time from an event's created_at to its push to Redis.",
            Kind::Histogram,
        );
        families.push((latency, m.latency.samples(latency.name, &LATENCY_BOUNDS_SECONDS)));
        let batch = family("outbox_batch_size", "Events per pushed batch.", Kind::Histogram);
        families.push((batch, m.batch_size.samples(batch.name, &BATCH_SIZE_BOUNDS)));
    }

    let workers = slots::report(config::workers());
    let running = family("outbox_workers_running", "Dispatchers running.", Kind::Gauge);
    let connected = family("outbox_workers_connected", "Dispatchers connected to Redis.", Kind::Gauge);
    families.push((
        running,
        vec![Sample::new(running.name, workers.iter().filter(|w| w.pid.is_some()).count() as f64)],
    ));
    families.push((
        connected,
        vec![Sample::new(connected.name, workers.iter().filter(|w| w.connected).count() as f64)],
    ));

    let (events, lag) = status_samples();
    families.push((family("outbox_events", "Events in outbox.events, by status.", Kind::Gauge), events));
    families.push((
        family("outbox_lag_seconds", "How long the oldest due pending event has waited.", Kind::Gauge),
        vec![Sample::new("outbox_lag_seconds", lag)],
    ));
    families
}

fn status_samples() -> (Vec<Sample>, f64) {
    let query =
        "SELECT status::pg_catalog.text, count, pg_catalog.date_part('epoch', lag) FROM outbox.status";
    let mut lag = 0.0;
    let events = Spi::connect(|client| {
        let mut samples = Vec::new();
        for row in client.select(query, None, &[])? {
            let status: String = row.get(1)?.unwrap_or_default();
            let count: i64 = row.get(2)?.unwrap_or(0);
            if let Some(seconds) = row.get::<f64>(3)? {
                lag = seconds;
            }
            samples.push(Sample::new("outbox_events", count as f64).label("status", status));
        }
        Ok::<_, pgrx::spi::SpiError>(samples)
    })
    .unwrap_or_else(|e| error!("outbox metrics: cannot read outbox.status: {e}"));
    (events, lag)
}

/// One row per sample: the source of the view `outbox.metrics`. The
/// search_path is pinned: a superuser's scrape must not resolve names
/// through a path the database owner chose.
#[pg_extern(volatile, parallel_safe)]
#[search_path(pg_catalog, pg_temp)]
fn outbox_metrics(
) -> TableIterator<'static, (name!(name, String), name!(labels, pgrx::JsonB), name!(value, f64))> {
    let rows: Vec<_> = families()
        .into_iter()
        .flat_map(|(_, samples)| samples)
        .map(|s| (s.name.clone(), pgrx::JsonB(s.labels_object()), s.value))
        .collect();
    TableIterator::new(rows)
}

/// The same samples as Prometheus text exposition, for a scrape through any
/// SQL-to-metrics exporter.
#[pg_extern(volatile, parallel_safe)]
#[search_path(pg_catalog, pg_temp)]
fn outbox_metrics_prometheus() -> String {
    exposition::render(&families())
}
