//! The dispatchers' rows of `outbox.sidecar_workers` (what `outbox.workers`
//! shows), written by a thread of their own on a connection of their own: a
//! dispatcher posts its row and never waits for the database. A writer
//! that has not answered for [`STUCK`] (its backend stopped, a lock it
//! waits on, a socket gone half-open) is left behind, and another takes
//! over on a new connection; rows meanwhile wait on the board, the latest
//! of each dispatcher only. What a writer left behind writes once it
//! answers at last is written again, as it is now, by the writer of the
//! moment.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use postgres::Client;

use crate::connect::{chain, pin_session, Connector};
use crate::log;

/// A writer busy this long is left behind for a new one.
const STUCK: Duration = Duration::from_secs(10);
/// Writers left behind and still blocked, at most; beyond, none is added.
const MOST_LEFT_BEHIND: usize = 4;
/// How long a connect of the writer may take, and a write.
const TIMEOUT: Duration = Duration::from_secs(10);
/// How soon a failed write is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// A dispatcher's row, as it is to be written.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerRow {
    /// Its connection's backend.
    pub pid: i32,
    pub state: &'static str,
    pub connected: bool,
    pub last_error: Option<String>,
    pub dispatched: i64,
    pub persistence: Option<&'static str>,
    /// The broker answered since the row was last posted: `last_heartbeat`
    /// is now.
    pub heartbeat: bool,
}

/// The writer of the moment.
#[derive(Default)]
struct Writer {
    /// Which writer it is (each one started counts one).
    generation: u64,
    /// Since when it has been writing; `None` while it waits for rows.
    busy_since: Option<Instant>,
}

/// Each dispatcher's row: as last posted, and those waiting to be written.
#[derive(Default)]
struct Rows {
    latest: BTreeMap<i32, WorkerRow>,
    pending: BTreeMap<i32, WorkerRow>,
}

/// The rows waiting to be written, and who writes them.
pub struct Board {
    /// `host:pid` of this process, in every row.
    host: String,
    connector: Connector,
    rows: Mutex<Rows>,
    posted: Condvar,
    writer: Mutex<Writer>,
    /// Writers running, those left behind included.
    running: AtomicUsize,
    stopping: AtomicBool,
}

impl Board {
    /// The board of this process, its first writer started.
    pub fn start(connector: Connector, host: String) -> Arc<Board> {
        let board = Arc::new(Board {
            host,
            connector,
            rows: Mutex::default(),
            posted: Condvar::new(),
            writer: Mutex::default(),
            running: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
        });
        board.spawn_writer(0);
        board
    }

    /// Posts dispatcher `worker`'s row, in place of one not written yet (a
    /// heartbeat it carried is kept).
    pub fn post(&self, worker: i32, mut row: WorkerRow) {
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(waiting) = rows.pending.get(&worker) {
            row.heartbeat |= waiting.heartbeat;
        }
        rows.latest.insert(worker, WorkerRow { heartbeat: false, ..row.clone() });
        rows.pending.insert(worker, row);
        self.posted.notify_all();
    }

    /// Leaves a writer busy for [`STUCK`] behind, with a warning, and starts
    /// another: called every second or so by the main thread.
    pub fn watch(self: &Arc<Board>) {
        let generation = {
            let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
            if writer.busy_since.is_none_or(|since| since.elapsed() < STUCK) {
                return;
            }
            if self.running.load(Ordering::SeqCst) > MOST_LEFT_BEHIND {
                return;
            }
            writer.generation += 1;
            writer.busy_since = None;
            writer.generation
        };
        log::warning(&format!(
            "the status rows' connection has not answered for {}s: outbox.workers is written from a new one \
             (delivery does not wait on it)",
            STUCK.as_secs()
        ));
        self.spawn_writer(generation);
    }

    /// Writes what is posted until `deadline` at the latest, then stops
    /// the writers.
    pub fn flush(&self, deadline: Instant) {
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        while !rows.pending.is_empty() && Instant::now() < deadline {
            rows = self
                .posted
                .wait_timeout(rows, Duration::from_millis(20))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        self.stopping.store(true, Ordering::SeqCst);
        self.posted.notify_all();
    }

    fn spawn_writer(self: &Arc<Board>, generation: u64) {
        let board = Arc::clone(self);
        board.running.fetch_add(1, Ordering::SeqCst);
        let spawned = std::thread::Builder::new().name("status".into()).spawn(move || {
            board.write(generation);
            board.running.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(e) = spawned {
            self.running.fetch_sub(1, Ordering::SeqCst);
            log::warning(&format!("a thread for the status rows: {e}"));
        }
    }

    /// Whether writer `generation` is the writer of the moment.
    fn current(&self, generation: u64) -> bool {
        self.writer.lock().unwrap_or_else(|e| e.into_inner()).generation == generation
    }

    fn set_busy(&self, generation: u64, busy: bool) {
        let mut writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if writer.generation == generation {
            writer.busy_since = busy.then(Instant::now);
        }
    }

    /// Writer `generation`'s life: the rows as they are posted, until the
    /// process stops or another writer takes over.
    fn write(&self, generation: u64) {
        let mut client: Option<Client> = None;
        let mut told = false;
        loop {
            let taken = {
                let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
                while rows.pending.is_empty()
                    && !self.stopping.load(Ordering::SeqCst)
                    && self.current(generation)
                {
                    rows = self.posted.wait_timeout(rows, RETRY).unwrap_or_else(|e| e.into_inner()).0;
                }
                if !self.current(generation) || rows.pending.is_empty() {
                    return;
                }
                std::mem::take(&mut rows.pending)
            };
            self.set_busy(generation, true);
            let written = self.write_rows(&mut client, &taken);
            self.set_busy(generation, false);
            let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
            match written {
                Ok(()) if self.current(generation) => told = false,
                // Left behind, it wrote late: the rows as they are now go again.
                Ok(()) => {
                    for worker in taken.into_keys() {
                        if let Some(row) = rows.latest.get(&worker).cloned() {
                            rows.pending.entry(worker).or_insert(row);
                        }
                    }
                }
                Err(why) => {
                    client = None;
                    if !told {
                        log::warning(&format!(
                            "the status rows: {why}; trying again every {}s",
                            RETRY.as_secs()
                        ));
                        told = true;
                    }
                    for (worker, row) in taken {
                        let waiting = rows.pending.entry(worker).or_insert_with(|| row.clone());
                        waiting.heartbeat |= row.heartbeat;
                    }
                }
            }
            // Those written are what a flush waits for.
            self.posted.notify_all();
            drop(rows);
            if !self.current(generation) {
                return;
            }
            if told {
                std::thread::sleep(RETRY);
            }
        }
    }

    fn write_rows(&self, client: &mut Option<Client>, rows: &BTreeMap<i32, WorkerRow>) -> Result<(), String> {
        if client.as_ref().is_none_or(Client::is_closed) {
            let mut c = self.connector.connect(TIMEOUT)?;
            pin_session(&mut c)?;
            c.batch_execute(&format!("SET statement_timeout = {}", TIMEOUT.as_millis()))
                .map_err(|e| chain(&e))?;
            *client = Some(c);
        }
        let c = client.as_mut().expect("connected above");
        let workers: Vec<i32> = rows.keys().copied().collect();
        let pids = column(rows, |r| r.pid);
        let states = column(rows, |r| r.state);
        let connected = column(rows, |r| r.connected);
        let heartbeats = column(rows, |r| r.heartbeat);
        let errors = column(rows, |r| r.last_error.as_deref());
        let dispatched = column(rows, |r| r.dispatched);
        let persistence = column(rows, |r| r.persistence);
        c.execute(
            "INSERT INTO outbox.sidecar_workers AS w \
                    (worker, pid, host, state, connected, started_at, last_heartbeat, last_error, \
                     events_dispatched, broker_persistence) \
             SELECT r.worker, r.pid, $1, r.state, r.connected, pg_catalog.now(), \
                    CASE WHEN r.heartbeat THEN pg_catalog.now() END, r.last_error, r.dispatched, r.persistence \
               FROM ROWS FROM (pg_catalog.unnest($2::pg_catalog.int4[]), pg_catalog.unnest($3::pg_catalog.int4[]), \
                               pg_catalog.unnest($4::pg_catalog.text[]), pg_catalog.unnest($5::pg_catalog.bool[]), \
                               pg_catalog.unnest($6::pg_catalog.bool[]), pg_catalog.unnest($7::pg_catalog.text[]), \
                               pg_catalog.unnest($8::pg_catalog.int8[]), pg_catalog.unnest($9::pg_catalog.text[])) \
                    AS r(worker, pid, state, connected, heartbeat, last_error, dispatched, persistence) \
             ON CONFLICT (worker) DO UPDATE \
                SET pid = excluded.pid, host = excluded.host, state = excluded.state, \
                    connected = excluded.connected, \
                    started_at = CASE WHEN w.pid OPERATOR(pg_catalog.=) excluded.pid \
                                      THEN w.started_at ELSE excluded.started_at END, \
                    last_heartbeat = coalesce(excluded.last_heartbeat, \
                                              CASE WHEN w.pid OPERATOR(pg_catalog.=) excluded.pid \
                                                   THEN w.last_heartbeat END), \
                    last_error = excluded.last_error, events_dispatched = excluded.events_dispatched, \
                    broker_persistence = excluded.broker_persistence",
            &[&self.host, &workers, &pids, &states, &connected, &heartbeats, &errors, &dispatched, &persistence],
        )
        .map(drop)
        .map_err(|e| chain(&e))
    }
}

/// One column of `rows`, as an array parameter.
fn column<'a, T>(rows: &'a BTreeMap<i32, WorkerRow>, value: impl Fn(&'a WorkerRow) -> T) -> Vec<T> {
    rows.values().map(value).collect()
}
