//! What SQL sees of the dispatchers: the functions behind `outbox.workers`,
//! `outbox.metrics` and `outbox_metrics_prometheus()`. The counters come
//! from shared memory (`counters.rs`), the gauges from the dispatcher
//! slots and `outbox.status`. `outbox.workers` shows the dispatchers of
//! every database; the metrics are this database's (its counters, its
//! dispatchers), so that an exporter labelling each database's samples
//! with it (`python -m outbox_dispatch.exporter`) counts nothing twice.

use pgrx::prelude::*;

use outbox_core::exposition::{self, Family, Sample};
use outbox_core::metrics::{self, Shown};

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
    // SAFETY: a process global.
    let workers = slots::rows(config::workers(), Some(unsafe { pg_sys::MyDatabaseId }));
    families.extend(metrics::dispatcher_families(workers.iter().map(|w| Shown {
        running: w.pid.is_some(),
        connected: w.connected,
        blocked: w.state == State::Blocked.name(),
    })));
    families.extend(database_gauges());
    families
}

/// The families of the database's gauges (sql/metrics/gauges.sql), read
/// in one statement (the one the server runs without the library too).
fn database_gauges() -> Vec<(Family, Vec<Sample>)> {
    let rows = Spi::connect(|client| {
        let retention = config::RETENTION_S.get().max(0);
        let mut rows = Vec::new();
        for row in client.select(metrics::GAUGES_SQL, None, &[retention.into()])? {
            rows.push((row.get(1)?.unwrap_or_default(), row.get(2)?, row.get(3)?.unwrap_or(0.0)));
        }
        Ok::<_, pgrx::spi::SpiError>(rows)
    })
    .unwrap_or_else(|e| error!("outbox metrics: cannot read the gauges: {e}"));
    metrics::database_families(rows).unwrap_or_else(|e| error!("outbox metrics: {e}"))
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
