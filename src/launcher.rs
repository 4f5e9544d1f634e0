//! The launcher: one background worker per server that keeps a group of
//! dispatchers running in every database `outbox.database` covers and
//! that has the extension.
//!
//! It is connected to no database (it never stands in the way of a `DROP
//! DATABASE`) and reads `pg_database`, a shared catalog, by a heap scan.
//! Each turn it plans with [`outbox_core::launch::turn`] and carries the
//! plan out: gives a free group to each new database and starts its
//! dispatcher 0, which looks for the extension (absent: it exits, and the
//! group is let go until a commit there asks again, `CREATE EXTENSION`'s
//! among them); starts the others once the extension is found; restarts a
//! dispatcher [`RESTART_DELAY`] after it exited; stops those beyond
//! `outbox.workers` and every one of a database no longer served, dropped,
//! or held by a command (`hold.rs`). The dispatchers are dynamic
//! background workers that report to the launcher, never restarted by the
//! postmaster on their own.
//!
//! What it cannot serve it says: a `WARNING` in the log when that changes,
//! and a row in `outbox.workers` (no worker slot for a dispatcher; a
//! database named in `outbox.database` that is missing, closed or without
//! the extension; more databases than groups).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime};
use pgrx::prelude::*;
use pgrx::{pg_shmem_init, PgLwLock};

use outbox_core::databases::{Served, NAME_BYTES};
use outbox_core::launch::{self, Database, Known};
use outbox_core::{backoff, named};

use crate::config::{self, MAX_DATABASES, MAX_WORKERS};
use crate::counters;
use crate::slots::{self, launcher as groups, Extension};
use crate::worker::{signals, wait};

/// How soon a dispatcher that exited is started again (and the launcher,
/// by the postmaster).
pub const RESTART_DELAY: Duration = Duration::from_secs(5);

/// How often `pg_database` is read without a wake: the delay before a
/// database created from a template that has the extension is served.
const SCAN_INTERVAL: Duration = Duration::from_secs(5);

/// The shortest time between two turns, however often the launcher is woken.
const MIN_TURN: Duration = Duration::from_millis(100);

/// How long a database found without the extension is left alone unless
/// it asks (`CREATE EXTENSION`): then its dispatcher 0 looks again (within
/// a minute more, spread).
const ABSENT_RECHECK: Duration = Duration::from_secs(300);

/// The most dispatchers looking for the extension at once.
const MAX_PROBES: usize = 4;

named! {
    /// Why a database `outbox.database` names is not served.
    pub enum Unserved {
        Missing = "no such database",
        Template = "a template database",
        /// `datallowconn` is false, or an interrupted `DROP DATABASE` left
        /// it invalid.
        Closed = "it does not allow connections",
        NoExtension = "extension outbox_dispatch is not created there",
        Held = "a command holds it (DROP DATABASE, a rename or a copy)",
        NoGroup = "every group of dispatchers is taken",
    }
}

/// One database not served: its name, and `1 +` its [`Unserved`] (0: none).
#[derive(Clone, Copy)]
pub struct Note {
    name: [u8; NAME_BYTES],
    reason: u8,
}

const NO_NOTE: Note = Note { name: [0; NAME_BYTES], reason: 0 };

// SAFETY: plain bytes, no pointers.
unsafe impl pgrx::shmem::PGRXSharedMemory for Note {}

/// The databases not served, as the launcher last saw them.
static NOTES: PgLwLock<[Note; MAX_DATABASES]> = unsafe { PgLwLock::new(c"outbox_dispatch_launcher_notes") };

/// Requests the shared memory; `_PG_init` calls this only while preloading.
pub fn init() {
    pg_shmem_init!(NOTES = [NO_NOTE; MAX_DATABASES]);
}

/// Registers the launcher; `_PG_init` calls this while preloading.
pub fn register() {
    BackgroundWorkerBuilder::new("outbox launcher")
        .set_type("outbox launcher")
        .set_library("outbox_dispatch")
        .set_function("outbox_launcher_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(RESTART_DELAY))
        .load();
}

/// The databases not served, with why, for `outbox.workers`.
pub fn notes() -> Vec<(String, Unserved)> {
    if !slots::preloaded() {
        return Vec::new();
    }
    NOTES
        .share()
        .iter()
        .filter_map(|n| {
            let reason = Unserved::ALL.get((n.reason as usize).checked_sub(1)?)?;
            let len = n.name.iter().position(|b| *b == 0).unwrap_or(NAME_BYTES);
            Some((String::from_utf8_lossy(&n.name[..len]).into_owned(), *reason))
        })
        .collect()
}

#[pg_guard]
#[unsafe(no_mangle)]
pub extern "C-unwind" fn outbox_launcher_main(_arg: pg_sys::Datum) {
    signals::install();
    signals::read_on_start();
    BackgroundWorker::connect_worker_to_spi(None, None);
    groups::listen();
    let mut launcher = Launcher::default();
    launcher.adopt();
    log!("outbox launcher started");
    loop {
        if signals::reload_if_requested() {
            groups::count_reload();
        }
        let nap = launcher.turn();
        // A SIGHUP during the turn whose latch a wait inside it reset is
        // performed now, not after the nap.
        if !signals::reload_requested() {
            wait::for_wake(nap);
        }
    }
}

/// A dispatcher the launcher started, until it has stopped.
struct Started {
    handle: *mut pg_sys::BackgroundWorkerHandle,
    /// Asked to stop (its database no longer served, beyond `outbox.workers`).
    stopping: bool,
}

impl Started {
    /// Has the postmaster send it SIGTERM, once.
    fn stop(&mut self) {
        if !self.stopping {
            // SAFETY: a handle of ours, not yet freed (reap frees it).
            unsafe { pg_sys::TerminateBackgroundWorker(self.handle) };
            self.stopping = true;
        }
    }
}

#[derive(Default)]
struct Launcher {
    started: HashMap<(usize, usize), Started>,
    /// Not before then is a dispatcher that exited started again.
    restart_at: HashMap<(usize, usize), Instant>,
    /// Databases whose dispatchers found no extension, and until when
    /// that is believed.
    absent: HashMap<u32, Instant>,
    /// The count of asks ([`slots::asked`]) this launcher has read.
    asked: u64,
    /// The count as each database last asked.
    last_ask: HashMap<u32, u64>,
    /// The count when asks were too many to tell apart: every database
    /// asked then.
    all_asked: u64,
    /// When the last turn began.
    turned_at: Option<Instant>,
    /// The last value of `outbox.database` that parsed.
    served: Option<Served>,
    /// What was last logged of what cannot be served.
    logged: Vec<String>,
}

impl Launcher {
    /// Dispatchers running when this launcher starts were started by one
    /// that exited (dynamic workers outlive the launcher that started them,
    /// and this one has no handle on them): they are stopped by pid. Their
    /// slots count as taken until they are gone ([`groups::occupied`]), so
    /// that no dispatcher is started beside one.
    fn adopt(&mut self) {
        for database in groups::groups().into_iter().flatten() {
            for pid in slots::running_in(pg_sys::Oid::from(database)) {
                // SAFETY: a signal to a dispatcher the last launcher started.
                unsafe { libc::kill(pid, libc::SIGTERM) };
            }
        }
    }

    /// Reads the asks since the last turn: the databases that asked are
    /// looked at again, at once.
    fn read_asks(&mut self) {
        let (now, asks) = groups::asks_since(self.asked);
        self.asked = now;
        match asks {
            Some(databases) => {
                for database in databases {
                    self.absent.remove(&database);
                    self.last_ask.insert(database, now);
                }
            }
            None => {
                self.absent.clear();
                self.all_asked = now;
            }
        }
        // A prepared CREATE EXTENSION commits without asking: absence is
        // looked at again after a while anyway.
        let now = Instant::now();
        self.absent.retain(|_, until| *until > now);
        for (g, database) in groups::groups().into_iter().enumerate() {
            let (Some(database), (Extension::Absent, as_of)) = (database, groups::extension(g)) else {
                continue;
            };
            let asked = self.last_ask.get(&database).copied().unwrap_or(0).max(self.all_asked);
            if asked > as_of {
                // Asked after dispatcher 0 looked: it looks again, at once.
                groups::look_again(g);
                self.restart_at.remove(&(g, 0));
            } else {
                // Spread over a minute: databases found absent together
                // are not all looked at again together.
                let spread = Duration::from_secs_f64(60.0 * backoff::random_unit());
                self.absent.entry(database).or_insert_with(|| Instant::now() + ABSENT_RECHECK + spread);
            }
        }
    }

    /// One turn; returns how long to sleep unless woken.
    fn turn(&mut self) -> Duration {
        // Wakes come with commits (outbox_wake()) and worker exits: one
        // turn per MIN_TURN at most.
        if let Some(at) = self.turned_at {
            loop {
                let left = MIN_TURN.saturating_sub(at.elapsed());
                if left.is_zero() {
                    break;
                }
                wait::for_wake(left);
            }
        }
        self.turned_at = Some(Instant::now());
        groups::free_stale_holds();
        self.reap();
        self.read_asks();
        let current = groups::groups();
        match Served::parse(&config::database()) {
            Ok(served) => self.served = Some(served),
            // The setting's check refuses such a value; one from before a
            // reload that failed keeps the last good one.
            Err(e) => warning!("outbox launcher: outbox.database: {e}; keeping the databases served"),
        }
        let Some(served) = self.served.clone() else { return SCAN_INTERVAL };
        let databases = scan();
        // What is known of dropped databases goes with them.
        self.absent.retain(|oid, _| databases.iter().any(|d| d.oid == *oid));
        self.last_ask.retain(|oid, _| databases.iter().any(|d| d.oid == *oid));
        let known = |oid: u32| {
            if slots::held(pg_sys::Oid::from(oid)) {
                Some(Known::Held)
            } else if self.absent.contains_key(&oid) {
                Some(Known::Absent)
            } else {
                None
            }
        };
        let plan = launch::turn(&served, &databases, &current, known);
        for g in &plan.release {
            self.release(*g);
        }
        for (g, database) in &plan.assign {
            // Its counters from zero before any dispatcher of it counts.
            counters::reset(*g);
            groups::assign(*g, *database);
            self.restart_at.retain(|(group, _), _| group != g);
        }
        let now = Instant::now();
        let mut next = SCAN_INTERVAL;
        let mut no_slot = Vec::new();
        let probe = |g: usize| groups::extension(g).0 == Extension::Unknown;
        let mut probing = self.started.keys().filter(|(g, index)| *index == 0 && probe(*g)).count();
        for (g, database) in groups::groups().into_iter().enumerate() {
            if database.is_none() || plan.release.contains(&g) {
                continue;
            }
            let (extension, _) = groups::extension(g);
            for index in 0..MAX_WORKERS {
                let wanted = index < config::workers() && (index == 0 || extension == Extension::Present);
                match (wanted, self.started.get_mut(&(g, index))) {
                    (true, None) if groups::occupied(g, index) => next = next.min(Duration::from_millis(100)),
                    // A few lookups for the extension at a time, however
                    // many databases are new.
                    (true, None) if probe(g) && probing >= MAX_PROBES => {
                        next = next.min(Duration::from_millis(100))
                    }
                    (true, None) => match self.restart_at.get(&(g, index)) {
                        Some(at) if *at > now => next = next.min(*at - now),
                        _ => {
                            if !self.start(g, index) {
                                no_slot.push((g, index));
                                next = next.min(RESTART_DELAY);
                            } else if probe(g) {
                                probing += 1;
                            }
                        }
                    },
                    (false, Some(started)) => started.stop(),
                    _ => {}
                }
            }
        }
        if self.started.values().any(|s| s.stopping) {
            next = next.min(Duration::from_millis(100));
        }
        self.tell(&served, &databases, &plan.unplaced, &no_slot);
        next
    }

    /// Forgets the dispatchers that stopped, setting when each that was
    /// not asked to stop may start again.
    fn reap(&mut self) {
        let now = Instant::now();
        let mut stopped = Vec::new();
        for (key, started) in &self.started {
            let mut pid = 0;
            // SAFETY: a handle of ours, not yet freed.
            let status = unsafe { pg_sys::GetBackgroundWorkerPid(started.handle, &mut pid) };
            if status == pg_sys::BgwHandleStatus::BGWH_STOPPED {
                stopped.push(*key);
            }
        }
        for key in stopped {
            let started = self.started.remove(&key).expect("listed above");
            // SAFETY: the handle RegisterDynamicBackgroundWorker allocated.
            unsafe { pg_sys::pfree(started.handle.cast()) };
            if !started.stopping {
                self.restart_at.insert(key, now + RESTART_DELAY);
            }
        }
    }

    /// Stops group `g`'s dispatchers; frees it once none is left.
    fn release(&mut self, g: usize) {
        let mut left = (0..MAX_WORKERS).any(|index| groups::occupied(g, index));
        for (_, started) in self.started.iter_mut().filter(|((group, _), _)| *group == g) {
            left = true;
            started.stop();
        }
        if !left {
            groups::free(g);
        }
    }

    /// Starts dispatcher `index` of group `g`; false when no background
    /// worker slot is free.
    fn start(&mut self, g: usize, index: usize) -> bool {
        let builder = BackgroundWorkerBuilder::new(&format!("outbox dispatcher {index}"))
            .set_type("outbox dispatcher")
            .set_library("outbox_dispatch")
            .set_function("outbox_dispatcher_main")
            .set_argument(Some(slots::argument(g, index)))
            .enable_spi_access()
            .set_start_time(BgWorkerStartTime::RecoveryFinished)
            .set_restart_time(None)
            // SAFETY: a process global.
            .set_notify_pid(unsafe { pg_sys::MyProcPid });
        let mut worker: pg_sys::BackgroundWorker = (&builder).into();
        let mut handle = std::ptr::null_mut();
        groups::starting(g, index);
        // SAFETY: a filled-in registration; the handle is allocated in the
        // launcher's long-lived memory context.
        let registered = unsafe { pg_sys::RegisterDynamicBackgroundWorker(&mut worker, &mut handle) };
        if registered {
            groups::launched(g, index, None);
            self.started.insert((g, index), Started { handle, stopping: false });
        } else {
            groups::launched(
                g,
                index,
                Some(&format!(
                    "no background worker slot free: raise max_worker_processes (now {}) to at least {}",
                    max_worker_processes(),
                    self.needed()
                )),
            );
            self.restart_at.insert((g, index), Instant::now() + RESTART_DELAY);
        }
        registered
    }

    /// Background worker slots outbox_dispatch needs: the launcher's and
    /// `outbox.workers` for each database given a group.
    fn needed(&self) -> usize {
        let databases = groups::groups().iter().flatten().count();
        1 + config::workers() * databases
    }

    /// Records in shared memory, for `outbox.workers`, what is not served
    /// and why; logs it when that changed.
    fn tell(
        &mut self,
        served: &Served,
        databases: &[Database],
        unplaced: &[u32],
        no_slot: &[(usize, usize)],
    ) {
        let mut notes: Vec<(String, Unserved)> = Vec::new();
        if let Served::Named(names) = served {
            for name in names {
                let found = databases.iter().find(|d| d.name == *name);
                let reason = match found {
                    None => Some(Unserved::Missing),
                    Some(d) if d.is_template => Some(Unserved::Template),
                    Some(d) if !d.allows_connections => Some(Unserved::Closed),
                    Some(d) if slots::held(pg_sys::Oid::from(d.oid)) => Some(Unserved::Held),
                    Some(d) if self.absent.contains_key(&d.oid) => Some(Unserved::NoExtension),
                    Some(_) => None,
                };
                notes.extend(reason.map(|r| (name.clone(), r)));
            }
        }
        for oid in unplaced {
            if let Some(d) = databases.iter().find(|d| d.oid == *oid) {
                notes.push((d.name.clone(), Unserved::NoGroup));
            }
        }
        {
            let mut shared = NOTES.exclusive();
            *shared = [NO_NOTE; MAX_DATABASES];
            for (note, (name, reason)) in shared.iter_mut().zip(&notes) {
                // A name read from a database in another encoding may have
                // grown past the limit as it was made valid UTF-8.
                let mut len = name.len().min(NAME_BYTES);
                while !name.is_char_boundary(len) {
                    len -= 1;
                }
                note.name[..len].copy_from_slice(&name.as_bytes()[..len]);
                note.reason = reason.index() as u8 + 1;
            }
        }
        let mut lines: Vec<(bool, String)> = notes
            .iter()
            .map(|(name, reason)| {
                // A database waiting for CREATE EXTENSION is no fault.
                (
                    *reason != Unserved::NoExtension,
                    format!("database \"{name}\" is not served: {}", reason.name()),
                )
            })
            .collect();
        if !no_slot.is_empty() {
            lines.push((true, format!(
                "{} dispatchers could not start: no background worker slot is free; max_worker_processes is {} \
                 and outbox_dispatch alone needs {} (1 launcher + outbox.workers = {} per database served), \
                 besides the other background workers and parallel queries",
                no_slot.len(),
                max_worker_processes(),
                self.needed(),
                config::workers()
            )));
        }
        let text: Vec<String> = lines.iter().map(|(_, line)| line.clone()).collect();
        if text != self.logged {
            for (fault, line) in lines.iter().filter(|(_, line)| !self.logged.contains(line)) {
                if *fault {
                    warning!("outbox launcher: {line}");
                } else {
                    log!("outbox launcher: {line}");
                }
            }
            self.logged = text;
        }
    }
}

fn max_worker_processes() -> i32 {
    // SAFETY: a plain GUC variable.
    unsafe { pg_sys::max_worker_processes }
}

/// Every database, from a heap scan of `pg_database` in a transaction of
/// its own (as autovacuum's launcher reads it).
fn scan() -> Vec<Database> {
    BackgroundWorker::transaction(|| {
        // SAFETY: a catalog scan inside a transaction, with a snapshot; the
        // tuples' fixed part is FormData_pg_database.
        unsafe {
            pg_sys::GetTransactionSnapshot();
            let relation = pg_sys::table_open(pg_sys::DatabaseRelationId, pg_sys::AccessShareLock as i32);
            let scan = pg_sys::table_beginscan_catalog(relation, 0, std::ptr::null_mut());
            let mut databases = Vec::new();
            loop {
                let tuple = pg_sys::heap_getnext(scan, pg_sys::ScanDirection::ForwardScanDirection);
                if tuple.is_null() {
                    break;
                }
                let form = &*pg_sys::heap_tuple_get_struct::<pg_sys::FormData_pg_database>(tuple);
                let name = std::ffi::CStr::from_ptr(form.datname.data.as_ptr());
                databases.push(Database {
                    oid: form.oid.to_u32(),
                    name: name.to_string_lossy().into_owned(),
                    // -2: an interrupted DROP DATABASE left it invalid.
                    allows_connections: form.datallowconn && form.datconnlimit != -2,
                    is_template: form.datistemplate,
                });
            }
            pg_sys::heap_endscan(scan);
            pg_sys::table_close(relation, pg_sys::AccessShareLock as i32);
            databases
        }
    })
}
