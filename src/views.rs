//! What SQL sees of the dispatchers: the functions behind `outbox.workers`,
//! `outbox.metrics` and `outbox_metrics_prometheus()`. The counters come
//! from shared memory (`counters.rs`), the gauges from the dispatcher
//! slots and `outbox.status`. `outbox.workers` shows the dispatchers of
//! every database; the metrics are this database's (its counters, its
//! dispatchers), so that an exporter labelling each database's samples
//! with it (`python -m outbox_dispatch.exporter`) counts nothing twice.

use pgrx::prelude::*;

use outbox_core::exposition::{self, Family, Kind, Sample};

use crate::slots::State;
use crate::{config, counters, launcher, slots};

/// A row of `outbox.workers`.
type Row = (
    Option<i32>,
    Option<i32>,
    String,
    bool,
    Option<TimestampWithTimeZone>,
    Option<TimestampWithTimeZone>,
    Option<String>,
    i64,
    Option<String>,
    Option<String>,
);

/// `outbox.workers`: one row per dispatcher of every database served (the
/// first `outbox.workers` slots of each group), then one per database
/// `outbox.database` names that is not served, with why (no worker, state
/// `not served`).
// pgrx reads the column names from the signature, so the row type stays here.
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_safe)]
fn outbox_dispatchers() -> TableIterator<
    'static,
    (
        name!(worker, Option<i32>),
        name!(pid, Option<i32>),
        name!(state, String),
        name!(connected, bool),
        name!(started_at, Option<TimestampWithTimeZone>),
        name!(last_heartbeat, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(events_dispatched, i64),
        name!(broker_persistence, Option<String>),
        name!(database, Option<String>),
    ),
> {
    let unserved = launcher::notes().into_iter().map(|(database, why)| {
        (
            None,
            None,
            NOT_SERVED.to_string(),
            false,
            None,
            None,
            Some(why.name().to_string()),
            0,
            None,
            Some(database),
        )
    });
    TableIterator::new(dispatchers().chain(unserved).collect::<Vec<Row>>())
}

/// The `outbox.workers` of versions before 0.6.0, whose SQL the library
/// serves until `ALTER EXTENSION outbox_dispatch UPDATE` (their dispatchers
/// then say that they wait for it): the dispatchers' rows without their
/// database.
#[allow(clippy::type_complexity)]
#[pg_extern(volatile, parallel_safe)]
fn outbox_workers() -> TableIterator<
    'static,
    (
        name!(worker, i32),
        name!(pid, Option<i32>),
        name!(state, String),
        name!(connected, bool),
        name!(started_at, Option<TimestampWithTimeZone>),
        name!(last_heartbeat, Option<TimestampWithTimeZone>),
        name!(last_error, Option<String>),
        name!(events_dispatched, i64),
        name!(broker_persistence, Option<String>),
    ),
> {
    let rows =
        dispatchers().map(|(worker, pid, state, connected, started, heartbeat, error, sent, persists, _)| {
            (worker.unwrap_or_default(), pid, state, connected, started, heartbeat, error, sent, persists)
        });
    TableIterator::new(rows.collect::<Vec<_>>())
}

/// The rows of the dispatchers of every database served.
fn dispatchers() -> impl Iterator<Item = Row> {
    let timestamp = |t: Option<i64>| t.and_then(|t| TimestampWithTimeZone::try_from(t).ok());
    slots::rows(config::workers(), None).into_iter().map(move |r| {
        (
            Some(r.index),
            r.pid,
            r.state.to_string(),
            r.connected,
            timestamp(r.started_at),
            timestamp(r.last_heartbeat),
            r.last_error,
            r.dispatched,
            r.broker_persistence.map(str::to_string),
            database_name(r.database),
        )
    })
}

/// The state of a database `outbox.database` names that has no dispatchers.
const NOT_SERVED: &str = "not served";

/// A database's name (`None` once it is dropped).
fn database_name(database: pg_sys::Oid) -> Option<String> {
    // SAFETY: a syscache lookup of a shared catalog, inside a transaction.
    let name = unsafe { pg_sys::get_database_name(database) };
    // SAFETY: a palloc'd C string when not null.
    (!name.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned())
}

/// The counters, then gauges read from the dispatcher slots and `outbox.status`.
fn families() -> Vec<(Family, Vec<Sample>)> {
    let mut families = counters::families();
    let gauge = |name, help| Family { name, help, kind: Kind::Gauge };

    // SAFETY: a process global.
    let workers = slots::rows(config::workers(), Some(unsafe { pg_sys::MyDatabaseId }));
    let running = workers.iter().filter(|w| w.pid.is_some()).count() as f64;
    let connected = workers.iter().filter(|w| w.connected).count() as f64;
    families.push((
        gauge("outbox_workers_running", "Dispatchers running."),
        vec![Sample::new("outbox_workers_running", running)],
    ));
    families.push((
        gauge("outbox_workers_connected", "Dispatchers connected to the broker."),
        vec![Sample::new("outbox_workers_connected", connected)],
    ));
    let blocked = workers.iter().filter(|w| w.state == State::Blocked.name()).count() as f64;
    families.push((
        gauge("outbox_workers_blocked", "Dispatchers whose last statement failed (state blocked)."),
        vec![Sample::new("outbox_workers_blocked", blocked)],
    ));
    families.extend(database_gauges());
    families
}

/// The gauges read from the database (sql/metrics/gauges.sql), in this
/// order, with their help.
const DATABASE_GAUGES: [(&str, &str); 11] = [
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
    (
        "outbox_events_waiting",
        "Events waiting for their key's turn (per-key order): in no claim until then.",
    ),
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

/// The families of [`DATABASE_GAUGES`], their samples read in one
/// statement (the one the server runs without the library too).
fn database_gauges() -> Vec<(Family, Vec<Sample>)> {
    let mut families: Vec<(Family, Vec<Sample>)> = DATABASE_GAUGES
        .iter()
        .map(|&(name, help)| (Family { name, help, kind: Kind::Gauge }, Vec::new()))
        .collect();
    Spi::connect(|client| {
        let retention = config::RETENTION_S.get().max(0);
        for row in client.select(include_str!("../sql/metrics/gauges.sql"), None, &[retention.into()])? {
            let name: String = row.get(1)?.unwrap_or_default();
            let value: f64 = row.get(3)?.unwrap_or(0.0);
            let Some((_, samples)) = families.iter_mut().find(|(f, _)| f.name == name) else {
                error!("outbox metrics: sql/metrics/gauges.sql returned {name}, which has no help")
            };
            let sample = Sample::new(name, value);
            samples.push(match row.get::<String>(2)? {
                Some(status) => sample.label("status", status),
                None => sample,
            });
        }
        Ok::<_, pgrx::spi::SpiError>(())
    })
    .unwrap_or_else(|e| error!("outbox metrics: cannot read the gauges: {e}"));
    families
}

/// One row per sample: the source of the view `outbox.metrics`. SECURITY
/// DEFINER, so that a role with nothing but `pg_monitor` reads what the
/// gauges need of `outbox.log` (no payload reaches it); the search_path
/// is pinned: a scrape must not resolve names through a path the database
/// owner chose.
#[pg_extern(volatile, parallel_safe, security_definer)]
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

/// The same samples as Prometheus text exposition, which
/// `python -m outbox_dispatch.exporter` serves. SECURITY DEFINER, as
/// `outbox_metrics()`.
#[pg_extern(volatile, parallel_safe, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn outbox_metrics_prometheus() -> String {
    exposition::render(&families())
}
