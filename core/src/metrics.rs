//! The dispatchers' counters and histograms, and their samples: one set
//! per database served, whatever memory holds it (the server's shared
//! memory, the sidecar's own). Every update is one relaxed atomic add: no
//! lock on the hot path. Each labelled family is one `named!` table, so a
//! new counter, reason or source is one line.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::exposition::{
    bucket_index, histogram_samples, Family, Kind, Sample, BATCH_SIZE_BOUNDS, LATENCY_BOUNDS_SECONDS,
};
use crate::named;
use crate::sink::{Condition, Reason, SinkError};

named! {
    /// What ended a dispatcher's sleep.
    pub enum WakeSource {
        Commit = "commit",
        Poll = "poll",
        Manual = "manual",
    }
}

named! {
    /// Plain counters: the metric's name (without `_total`) and its help.
    pub enum Counter {
        Dispatched = "outbox_dispatched" => "Events pushed to the broker.",
        Retries = "outbox_retries" => "Retries scheduled after an event's push failed.",
        DeadLetters = "outbox_dead_letters" => "Events moved to failed (the dead letter).",
        StuckRescued = "outbox_stuck_rescued"
            => "Events in processing longer than outbox.processing_timeout returned to pending.",
        StraysRelined = "outbox_strays_relined"
            => "Pending events found where no claim would read them (rows a restore wrote with the triggers off), put in line.",
        UnackedResent = "outbox_unacked_resent"
            => "Dispatched events not acknowledged within outbox.ack_timeout, returned to pending.",
        UnackedFailed = "outbox_unacked_failed"
            => "Dispatched events never acknowledged after outbox.max_redeliveries re-sends, moved to failed.",
        TaskFailures = "outbox_task_failures"
            => "Events whose Celery task failed, or that a worker refused, as reported by outbox_dispatch.celery.",
        Expired = "outbox_expired" => "Events not sent because they expired first.",
        Refused = "outbox_refused"
            => "Events not sent because their id copies an earlier event's (a writer's reuse of another's task id).",
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

/// One database's counters.
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

fn zeros<const N: usize>() -> [AtomicU64; N] {
    std::array::from_fn(|_| AtomicU64::new(0))
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
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
        }
    }
}

impl Counters {
    /// Sets every counter to zero.
    pub fn reset(&self) {
        let histograms = [&self.latency.buckets[..], &self.batch_size.buckets[..]];
        let tables = [
            &self.counters[..],
            &self.push_failures[..],
            &self.reconnects[..],
            &self.refusals[..],
            &self.wakeups[..],
            &self.acks[..],
            &self.reports_ignored[..],
        ];
        let sums = [&self.unavailable_micros, &self.latency.sum_micros, &self.batch_size.sum_micros];
        for value in tables.into_iter().chain(histograms).flatten().chain(sums) {
            value.store(0, Ordering::Relaxed);
        }
    }

    pub fn add(&self, counter: Counter, n: u64) {
        self.counters[counter.index()].fetch_add(n, Ordering::Relaxed);
    }

    pub fn push_failed(&self, reason: PushFailure, events: u64) {
        self.push_failures[reason.index()].fetch_add(events, Ordering::Relaxed);
    }

    /// A broker failure that made a dispatcher reconnect; a refusal is also
    /// counted by the server's condition.
    pub fn reconnect(&self, error: &SinkError) {
        self.reconnects[error.reason().index()].fetch_add(1, Ordering::Relaxed);
        if let SinkError::Refused(condition, _) = error {
            self.refused(*condition);
        }
    }

    /// The broker refused the dispatcher for a condition of its own.
    pub fn refused(&self, condition: Condition) {
        self.refusals[condition.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn woke(&self, source: WakeSource) {
        self.wakeups[source.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub fn acked(&self, source: AckSource, n: u64) {
        self.acks[source.index()].fetch_add(n, Ordering::Relaxed);
    }

    /// A dispatcher had no working broker connection for `pause`.
    pub fn broker_unavailable(&self, pause: std::time::Duration) {
        self.unavailable_micros.fetch_add(pause.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn reports_ignored(&self, reason: ReportIgnored, n: u64) {
        self.reports_ignored[reason.index()].fetch_add(n, Ordering::Relaxed);
    }

    /// One pushed batch: the events dispatched, the batch size, and each
    /// event's creation-to-push latency.
    pub fn observe_batch(&self, latencies_seconds: &[f64]) {
        self.add(Counter::Batches, 1);
        self.add(Counter::Dispatched, latencies_seconds.len() as u64);
        self.batch_size.observe(&BATCH_SIZE_BOUNDS, latencies_seconds.len() as f64);
        for latency in latencies_seconds {
            self.latency.observe(&LATENCY_BOUNDS_SECONDS, *latency);
        }
    }

    /// The samples of every counter and histogram.
    pub fn families(&self) -> Vec<(Family, Vec<Sample>)> {
        let c = self;
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
        let batch =
            Family { name: "outbox_batch_size", help: "Events per pushed batch.", kind: Kind::Histogram };
        families.push((batch, c.batch_size.samples(batch.name, &BATCH_SIZE_BOUNDS)));
        families
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

/// Whether only the library's SQL functions count `sample`:
/// `outbox_ack()`'s acknowledgements and `outbox_inbox_claim()`'s
/// duplicates, counted in the server's shared memory. A host without the
/// library cannot count them, and shows no sample rather than a zero.
pub fn counted_in_sql(sample: &Sample) -> bool {
    let acked_in_sql = sample.name == "outbox_acked_total"
        && sample.labels.iter().any(|(k, v)| *k == "source" && v == AckSource::Sql.name());
    acked_in_sql || sample.name == format!("{}_total", Counter::InboxDuplicates.name())
}

/// A dispatcher as the gauges count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shown {
    pub running: bool,
    pub connected: bool,
    /// Its last statement failed (state `blocked`).
    pub blocked: bool,
}

/// The dispatchers' gauges.
pub fn dispatcher_families(dispatchers: impl Iterator<Item = Shown>) -> Vec<(Family, Vec<Sample>)> {
    let (mut running, mut connected, mut blocked) = (0, 0, 0);
    for d in dispatchers {
        running += usize::from(d.running);
        connected += usize::from(d.connected);
        blocked += usize::from(d.blocked);
    }
    [
        ("outbox_workers_running", "Dispatchers running.", running),
        ("outbox_workers_connected", "Dispatchers connected to the broker.", connected),
        ("outbox_workers_blocked", "Dispatchers whose last statement failed (state blocked).", blocked),
    ]
    .into_iter()
    .map(|(name, help, n)| (Family { name, help, kind: Kind::Gauge }, vec![Sample::new(name, n as f64)]))
    .collect()
}

/// The gauges read from the database, one row per sample: (name, status,
/// value); `$1` is `outbox.retention` in seconds. Both hosts run it.
pub const GAUGES_SQL: &str = include_str!("../../sql/metrics/gauges.sql");

/// The gauges [`GAUGES_SQL`] returns, in this order, with their help.
pub const DATABASE_GAUGES: [(&str, &str); 11] = [
    (
        "outbox_purge_lag_seconds",
        "How long past its truncation the oldest generation of outbox.log is (0: the rotation keeps up).",
    ),
    (
        "outbox_oldest_transaction_seconds",
        "How long the oldest transaction open in this database (a session's or a prepared one) has been open: \
         vacuum removes no row version that died after it began.",
    ),
    ("outbox_events_dead_tuples", "Dead row versions in outbox.log, as the statistics last counted them."),
    (
        "outbox_events",
        "Events in outbox.events by status: counted, except dispatched and processed beyond 1000 (estimated).",
    ),
    (
        "outbox_events_estimated",
        "1 where outbox_events of that status is an estimate from statistics, 0 where it is counted.",
    ),
    ("outbox_lag_seconds", "How long the oldest due pending event has waited."),
    ("outbox_events_waiting", "Events waiting for their key's turn (per-key order): in no claim until then."),
    ("outbox_keys_waiting", "Keys with events waiting behind their head."),
    (
        "outbox_keys_dead_lettered",
        "Keys whose head is dead-lettered and holds them (outbox.key_on_failure = block): \
         outbox_retry() or outbox_skip() releases them.",
    ),
    (
        "outbox_key_head_seconds",
        "How long the oldest head of a key has been due without finishing (since it became the head, \
         or its last retry fell due).",
    ),
    (
        "outbox_events_unreported",
        "Dispatched events no worker reported within outbox.report_timeout (counted up to 10001).",
    ),
];

/// The families of [`DATABASE_GAUGES`] from the rows of [`GAUGES_SQL`]; an
/// error names a gauge the table does not know.
pub fn database_families(
    rows: impl IntoIterator<Item = (String, Option<String>, f64)>,
) -> Result<Vec<(Family, Vec<Sample>)>, String> {
    let mut families: Vec<(Family, Vec<Sample>)> = DATABASE_GAUGES
        .iter()
        .map(|&(name, help)| (Family { name, help, kind: Kind::Gauge }, Vec::new()))
        .collect();
    for (name, status, value) in rows {
        let Some((_, samples)) = families.iter_mut().find(|(f, _)| f.name == name) else {
            return Err(format!("sql/metrics/gauges.sql returned {name}, which has no help"));
        };
        let sample = Sample::new(name, value);
        samples.push(match status {
            Some(status) => sample.label("status", status),
            None => sample,
        });
    }
    Ok(families)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_gauge_the_statement_returns_has_its_help() {
        for (name, _) in DATABASE_GAUGES {
            assert!(GAUGES_SQL.contains(&format!("'{name}'")), "{name} is not in gauges.sql");
        }
        let rows = vec![("outbox_events".to_string(), Some("pending".to_string()), 3.0)];
        let families = database_families(rows).unwrap();
        assert_eq!(families.len(), DATABASE_GAUGES.len());
        assert!(database_families(vec![("outbox_nonsense".to_string(), None, 1.0)]).is_err());
    }

    #[test]
    fn only_the_sql_functions_counts_are_counted_in_sql() {
        let in_sql: Vec<(String, Vec<(&str, String)>)> = Counters::default()
            .families()
            .into_iter()
            .flat_map(|(_, samples)| samples)
            .filter(counted_in_sql)
            .map(|s| (s.name, s.labels))
            .collect();
        assert_eq!(
            in_sql,
            [
                ("outbox_inbox_duplicates_total".to_string(), vec![]),
                ("outbox_acked_total".to_string(), vec![("source", "sql".to_string())]),
            ]
        );
    }
}
