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
    families.push((
        gauge(
            "outbox_purge_lag_seconds",
            "How long past its truncation the oldest generation of outbox.log is (0: the rotation keeps up).",
        ),
        vec![Sample::new("outbox_purge_lag_seconds", purge_lag())],
    ));

    families.push((
        gauge(
            "outbox_oldest_transaction_seconds",
            "How long the oldest transaction open in this database (a session's or a prepared one) has been open: \
             vacuum removes no row version that died after it began.",
        ),
        vec![Sample::new("outbox_oldest_transaction_seconds", oldest_transaction())],
    ));
    families.push((
        gauge(
            "outbox_events_dead_tuples",
            "Dead row versions in outbox.log, as the statistics last counted them.",
        ),
        vec![Sample::new("outbox_events_dead_tuples", dead_tuples())],
    ));

    let (counts, estimated, lag) = status_samples();
    families.push((
        gauge(
            "outbox_events",
            "Events in outbox.events by status: counted, except dispatched and processed beyond 1000 (estimated).",
        ),
        counts,
    ));
    families.push((
        gauge(
            "outbox_events_estimated",
            "1 where outbox_events of that status is an estimate from statistics, 0 where it is counted.",
        ),
        estimated,
    ));
    families.push((
        gauge("outbox_lag_seconds", "How long the oldest due pending event has waited."),
        vec![Sample::new("outbox_lag_seconds", lag)],
    ));
    let keys = key_gauges();
    families.push((
        gauge(
            "outbox_events_waiting",
            "Events waiting for their key's turn (per-key order): in no claim until then.",
        ),
        vec![Sample::new("outbox_events_waiting", keys.waiting)],
    ));
    families.push((
        gauge("outbox_keys_waiting", "Keys with events waiting behind their head."),
        vec![Sample::new("outbox_keys_waiting", keys.keys_waiting)],
    ));
    families.push((
        gauge(
            "outbox_keys_dead_lettered",
            "Keys whose head is dead-lettered and holds them (outbox.key_on_failure = block): \
             outbox_retry() or outbox_skip() releases them.",
        ),
        vec![Sample::new("outbox_keys_dead_lettered", keys.dead_lettered)],
    ));
    families.push((
        gauge(
            "outbox_key_head_seconds",
            "How long the oldest head of a key has been due without finishing (since it became the head, \
             or its last retry fell due).",
        ),
        vec![Sample::new("outbox_key_head_seconds", keys.oldest_head)],
    ));
    families.push((
        gauge(
            "outbox_events_unreported",
            "Dispatched events no worker reported within outbox.report_timeout (counted up to 10001).",
        ),
        vec![Sample::new("outbox_events_unreported", unreported() as f64)],
    ));
    families
}

/// The gauges of per-key order.
struct KeyGauges {
    waiting: f64,
    keys_waiting: f64,
    dead_lettered: f64,
    oldest_head: f64,
}

/// Reads [`KeyGauges`] through `events_key_state_idx`: a count of the
/// waiting events and of the heads, which a healthy outbox keeps small.
fn key_gauges() -> KeyGauges {
    const QUERY: &str = "SELECT
            (SELECT pg_catalog.count(*) FROM outbox.log WHERE key_state = 'waiting')::float8,
            (SELECT pg_catalog.count(*) FROM (SELECT DISTINCT ordering_key, coalesce(subscription_id, 0)
                                                FROM outbox.log WHERE key_state = 'waiting') AS k)::float8,
            (SELECT pg_catalog.count(*) FROM outbox.log WHERE key_state = 'head' AND status = 'failed')::float8,
            coalesce((SELECT pg_catalog.date_part('epoch', pg_catalog.now() - pg_catalog.min(available_at))
                        FROM outbox.log WHERE key_state = 'head' AND available_at <= pg_catalog.now()), 0)";
    Spi::connect(|client| {
        let row = client.select(QUERY, Some(1), &[])?.first();
        Ok::<_, pgrx::spi::SpiError>(KeyGauges {
            waiting: row.get::<f64>(1)?.unwrap_or(0.0),
            keys_waiting: row.get::<f64>(2)?.unwrap_or(0.0),
            dead_lettered: row.get::<f64>(3)?.unwrap_or(0.0),
            oldest_head: row.get::<f64>(4)?.unwrap_or(0.0).max(0.0),
        })
    })
    .unwrap_or_else(|e| error!("outbox metrics: cannot read the keys: {e}"))
}

/// How long past its due time the oldest generation is still there: due
/// once it ended `outbox.retention` ago (sql/rotation.sql). 0 while the
/// rotation keeps up; growing while a transaction holds it (`waiting`) or
/// its steps fail.
fn purge_lag() -> f64 {
    let retention = config::RETENTION_S.get().max(0);
    let query = format!(
        "SELECT pg_catalog.date_part('epoch', pg_catalog.now() - pg_catalog.min(g.ended_at)
                                              - interval '{retention} seconds')
           FROM outbox.generations AS g"
    );
    let age = crate::read_one::<f64>(&query)
        .unwrap_or_else(|e| error!("outbox metrics: cannot read the oldest generation: {e}"))
        .unwrap_or(0.0);
    age.max(0.0)
}

/// How long the oldest transaction that holds back vacuum in this database
/// has been open: client sessions with a snapshot or a transaction id (not
/// this one), and prepared transactions. Other roles' sessions are read as
/// the function's owner (a superuser, or a member of pg_read_all_stats).
fn oldest_transaction() -> f64 {
    const QUERY: &str = "SELECT pg_catalog.date_part('epoch', pg_catalog.now() - LEAST(
            (SELECT pg_catalog.min(a.xact_start) FROM pg_catalog.pg_stat_activity AS a
              WHERE a.datname = pg_catalog.current_database()
                AND a.backend_type = 'client backend'
                AND a.pid <> pg_catalog.pg_backend_pid()
                AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)),
            (SELECT pg_catalog.min(p.prepared) FROM pg_catalog.pg_prepared_xacts AS p
              WHERE p.database = pg_catalog.current_database())))";
    crate::read_one::<f64>(QUERY)
        .unwrap_or_else(|e| error!("outbox metrics: cannot read the oldest transaction: {e}"))
        .unwrap_or(0.0)
        .max(0.0)
}

/// `n_dead_tup` of `outbox.log`'s partitions: what vacuum found it could
/// not remove yet, and what was deleted or updated since.
fn dead_tuples() -> f64 {
    const QUERY: &str = "SELECT pg_catalog.sum(pg_catalog.pg_stat_get_dead_tuples(p.relid))::bigint
                           FROM pg_catalog.pg_partition_tree('outbox.log'::pg_catalog.regclass) AS p
                          WHERE p.isleaf";
    crate::read_one::<i64>(QUERY)
        .unwrap_or_else(|e| error!("outbox metrics: cannot read the dead tuples of outbox.log: {e}"))
        .unwrap_or(0) as f64
}

/// The rows of `outbox.unreported`, counted up to [`UNREPORTED_CAP`] + 1:
/// a scrape costs the same however many there are.
fn unreported() -> i64 {
    let query = format!(
        "SELECT pg_catalog.count(*) FROM (SELECT FROM outbox.unreported LIMIT {}) AS u",
        UNREPORTED_CAP + 1
    );
    crate::read_one::<i64>(&query)
        .unwrap_or_else(|e| error!("outbox metrics: cannot read outbox.unreported: {e}"))
        .unwrap_or(0)
}

/// The most unreported events counted one by one.
const UNREPORTED_CAP: i64 = 10_000;

/// From `outbox.status`: the count of each status, whether it is an
/// estimate, and the lag. Costs the same whatever the number of finished
/// events.
fn status_samples() -> (Vec<Sample>, Vec<Sample>, f64) {
    let query = "SELECT status::pg_catalog.text, count, pg_catalog.date_part('epoch', lag), estimated \
                 FROM outbox.status";
    let mut lag = 0.0;
    let (mut counts, mut estimated) = (Vec::new(), Vec::new());
    Spi::connect(|client| {
        for row in client.select(query, None, &[])? {
            let status: String = row.get(1)?.unwrap_or_default();
            let count: i64 = row.get(2)?.unwrap_or(0);
            if let Some(seconds) = row.get::<f64>(3)? {
                lag = seconds;
            }
            let is_estimate = row.get::<bool>(4)?.unwrap_or(false);
            counts.push(Sample::new("outbox_events", count as f64).label("status", status.clone()));
            estimated.push(
                Sample::new("outbox_events_estimated", f64::from(u8::from(is_estimate)))
                    .label("status", status),
            );
        }
        Ok::<_, pgrx::spi::SpiError>(())
    })
    .unwrap_or_else(|e| error!("outbox metrics: cannot read outbox.status: {e}"));
    (counts, estimated, lag)
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
