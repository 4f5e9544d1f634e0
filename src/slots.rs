//! The dispatchers' slots in shared memory, one group per database served:
//! who each dispatcher is (its proc number, so that committing backends of
//! its database can set its latch), what it is doing, and its last error,
//! for `outbox.workers`; and per database, which dispatcher has each turn.
//!
//! Everything a committing backend touches is an atomic: waking the
//! dispatchers takes no lock. The error texts sit behind one LWLock; only
//! dispatchers write them, and only on failures.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU32, AtomicU64, AtomicU8, Ordering};

use pgrx::prelude::*;
use pgrx::shmem::AssertPGRXSharedMemory;
use pgrx::{pg_shmem_init, PgAtomic, PgLwLock};

use outbox_core::named;
use outbox_core::sink::Persistence;

use crate::config::{MAX_DATABASES, MAX_WORKERS};

/// Longest `last_error` kept, in bytes.
const ERROR_BYTES: usize = 512;

named! {
    /// What a dispatcher is doing, as `outbox.workers.state` shows it.
    pub enum State {
        Stopped = "stopped",
        Starting = "starting",
        WaitingForExtension = "waiting for extension",
        Idle = "idle",
        Draining = "draining",
        Reconnecting = "reconnecting",
        Paused = "paused",
        /// A statement failed (a lock not granted in time, say): retrying.
        Blocked = "blocked",
    }
}

named! {
    /// Work one dispatcher at a time does.
    pub enum Turn {
        /// The sweepers and the lifecycle purge.
        Housekeeping = "housekeeping",
        /// Collecting the outcomes Celery workers report: the report list
        /// is read and trimmed from its head, so two at once would trim
        /// each other's reports.
        Reports = "reports",
    }
}

named! {
    /// What ended a dispatcher's sleep.
    pub enum WakeSource {
        Commit = "commit",
        Poll = "poll",
        Manual = "manual",
    }
}

#[repr(C)]
pub struct Slot {
    /// `pgprocno` of the running dispatcher, -1 when none runs.
    procno: AtomicI32,
    pid: AtomicI32,
    state: AtomicU8,
    connected: AtomicBool,
    /// Timestamps are PostgreSQL `TimestampTz` (µs since 2000-01-01), 0 = never.
    started_at: AtomicI64,
    last_heartbeat: AtomicI64,
    dispatched: AtomicU64,
    /// Bits `1 << WakeSource` of the wakes since the dispatcher last looked.
    wake_sources: AtomicU8,
    /// How the broker persists data: 1 + index in `Persistence::ALL`, 0 = not known.
    persistence: AtomicU8,
}

/// The dispatchers of one database.
#[repr(C)]
pub struct Group {
    /// The database they serve (its OID); 0 while the group is free.
    database: AtomicU32,
    slots: [Slot; MAX_WORKERS],
    /// Index of the dispatcher that has each [`Turn`], -1 = none.
    turns: [AtomicI32; Turn::COUNT],
}

#[repr(C)]
pub struct Slots {
    groups: [Group; MAX_DATABASES],
}

static SLOTS: PgAtomic<AssertPGRXSharedMemory<Slots>> = unsafe { PgAtomic::new(c"outbox_dispatch_slots") };
static ERRORS: PgLwLock<[[[u8; ERROR_BYTES]; MAX_WORKERS]; MAX_DATABASES]> =
    unsafe { PgLwLock::new(c"outbox_dispatch_errors") };

/// Set in the postmaster when the library is preloaded; forked backends
/// inherit it. Without it there is no shared memory to touch.
static READY: AtomicBool = AtomicBool::new(false);

/// Requests the shared memory; `_PG_init` calls this only while preloading.
pub fn init() {
    pg_shmem_init!(
        SLOTS = unsafe {
            AssertPGRXSharedMemory::new(Slots {
                groups: std::array::from_fn(|_| Group {
                    database: AtomicU32::new(0),
                    slots: std::array::from_fn(|_| Slot {
                        procno: AtomicI32::new(-1),
                        pid: AtomicI32::new(0),
                        state: AtomicU8::new(State::Stopped as u8),
                        connected: AtomicBool::new(false),
                        started_at: AtomicI64::new(0),
                        last_heartbeat: AtomicI64::new(0),
                        dispatched: AtomicU64::new(0),
                        wake_sources: AtomicU8::new(0),
                        persistence: AtomicU8::new(0),
                    }),
                    turns: std::array::from_fn(|_| AtomicI32::new(-1)),
                }),
            })
        }
    );
    pg_shmem_init!(ERRORS = [[[0; ERROR_BYTES]; MAX_WORKERS]; MAX_DATABASES]);
    READY.store(true, Ordering::Relaxed);
}

fn slots() -> Option<&'static Slots> {
    READY.load(Ordering::Relaxed).then(|| &**SLOTS.get())
}

/// Sets the latch of every running dispatcher of this backend's database,
/// noting why. Commits leave paused dispatchers asleep (a reload wakes them
/// when `outbox.enabled` turns on). Cannot fail: safe inside a commit
/// callback.
pub fn wake_database(source: WakeSource) {
    let Some(slots) = slots() else { return };
    // SAFETY: ProcGlobal is set up before any backend runs; procno is
    // bounds-checked against allProcCount before indexing allProcs.
    unsafe {
        let global = pg_sys::ProcGlobal;
        if global.is_null() {
            return;
        }
        let database = pg_sys::MyDatabaseId.to_u32();
        let groups =
            slots.groups.iter().filter(|g| database != 0 && g.database.load(Ordering::Acquire) == database);
        for slot in groups.flat_map(|g| &g.slots) {
            let procno = slot.procno.load(Ordering::Acquire);
            let paused = slot.state.load(Ordering::Relaxed) == State::Paused as u8;
            if matches!(source, WakeSource::Commit) && paused {
                continue;
            }
            if procno >= 0 && (procno as u32) < (*global).allProcCount {
                slot.wake_sources.fetch_or(1 << source as u8, Ordering::AcqRel);
                pg_sys::SetLatch(&raw mut (*(*global).allProcs.add(procno as usize)).procLatch);
            }
        }
    }
}

/// This process's index in `ProcGlobal->allProcs`: `MyProc->pgprocno`
/// until PostgreSQL 16, `MyProcNumber` since 17.
#[cfg(any(feature = "pg15", feature = "pg16"))]
unsafe fn my_procno() -> i32 {
    (*pg_sys::MyProc).pgprocno
}

#[cfg(any(feature = "pg17", feature = "pg18"))]
unsafe fn my_procno() -> i32 {
    pg_sys::MyProcNumber
}

/// The running dispatcher's handle on its slot: its group and index.
pub struct Own(usize, usize);

impl Own {
    /// Publishes this process as dispatcher `index` of `group`; the slot
    /// is cleared again when the process exits, however it exits.
    pub fn take(group: usize, index: usize) -> Own {
        let slot = &slots().expect("dispatchers run only when preloaded").groups[group].slots[index];
        // SAFETY: process globals, set before a background worker runs.
        let (pid, now) = unsafe { (pg_sys::MyProcPid, pg_sys::GetCurrentTimestamp()) };
        slot.pid.store(pid, Ordering::Relaxed);
        slot.started_at.store(now, Ordering::Relaxed);
        slot.connected.store(false, Ordering::Relaxed);
        slot.persistence.store(0, Ordering::Relaxed);
        slot.state.store(State::Starting as u8, Ordering::Relaxed);
        unsafe { pg_sys::before_shmem_exit(Some(release), pg_sys::Datum::from(group << 16 | index)) };
        Own(group, index)
    }

    /// Records the database this dispatcher's group serves, once connected.
    pub fn serve(&self, database: pg_sys::Oid) {
        self.group().database.store(database.to_u32(), Ordering::Release);
    }

    fn group(&self) -> &'static Group {
        &slots().expect("owned slots exist").groups[self.0]
    }

    /// Lets committing backends set this process's latch; called once the
    /// dispatcher is connected to its database, before it first looks for
    /// work: a commit before that is found by that first look, a commit
    /// after it sets the latch.
    pub fn listen(&self) {
        // SAFETY: a background worker has a PGPROC by the time it runs.
        let procno = unsafe { my_procno() };
        self.slot().procno.store(procno, Ordering::Release);
    }

    fn slot(&self) -> &'static Slot {
        &self.group().slots[self.1]
    }

    pub fn set_state(&self, state: State) {
        self.slot().state.store(state as u8, Ordering::Relaxed);
    }

    /// Ends `paused` (commits wake the dispatcher again), before it first
    /// looks for work: a commit after that look must find it awake.
    pub fn resume(&self) {
        let _ = self.slot().state.compare_exchange(
            State::Paused as u8,
            State::Idle as u8,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    pub fn set_connected(&self, connected: bool) {
        let slot = self.slot();
        slot.connected.store(connected, Ordering::Relaxed);
        if connected {
            slot.last_heartbeat.store(unsafe { pg_sys::GetCurrentTimestamp() }, Ordering::Relaxed);
        }
    }

    /// The sources of the wakes since the last call, as `1 << WakeSource` bits.
    pub fn take_wake_sources(&self) -> u8 {
        self.slot().wake_sources.swap(0, Ordering::AcqRel)
    }

    /// Whether a wake came since [`Own::take_wake_sources`] last looked.
    /// The record a wake leaves here, unlike the latch it sets, survives
    /// the waits inside PostgreSQL (a lock, a buffer pin) that reset the
    /// latch while a step runs.
    pub fn wake_pending(&self) -> bool {
        self.slot().wake_sources.load(Ordering::Acquire) != 0
    }

    /// Records that the broker answered.
    pub fn heartbeat(&self) {
        self.slot().last_heartbeat.store(unsafe { pg_sys::GetCurrentTimestamp() }, Ordering::Relaxed);
    }

    pub fn add_dispatched(&self, n: u64) {
        self.slot().dispatched.fetch_add(n, Ordering::Relaxed);
    }

    /// Records how the broker persists what it is sent.
    pub fn set_persistence(&self, persistence: Persistence) {
        let code = persistence.index() as u8 + 1;
        self.slot().persistence.store(code, Ordering::Relaxed);
    }

    /// Takes `turn` if no other dispatcher has it; the turn ends when the
    /// returned value is dropped, or when this process exits.
    pub fn take_turn(&self, turn: Turn) -> Option<Held> {
        let me = self.1 as i32;
        self.group().turns[turn.index()]
            .compare_exchange(-1, me, Ordering::AcqRel, Ordering::Relaxed)
            .ok()?;
        Some(Held(self.group(), turn, me))
    }

    /// Records the last error (already free of credentials); `None` clears it.
    pub fn set_error(&self, error: Option<&str>) {
        let mut errors = ERRORS.exclusive();
        let buf = &mut errors[self.0][self.1];
        let text = error.unwrap_or("").as_bytes();
        let mut len = text.len().min(ERROR_BYTES - 1);
        while len > 0 && std::str::from_utf8(&text[..len]).is_err() {
            len -= 1;
        }
        buf[..len].copy_from_slice(&text[..len]);
        buf[len] = 0;
    }
}

/// A turn this dispatcher has.
pub struct Held(&'static Group, Turn, i32);

impl Drop for Held {
    fn drop(&mut self) {
        let _ =
            self.0.turns[self.1.index()].compare_exchange(self.2, -1, Ordering::AcqRel, Ordering::Relaxed);
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn release(_code: i32, arg: pg_sys::Datum) {
    if let Some(slots) = slots() {
        let (group, index) = (arg.value() >> 16, arg.value() & 0xffff);
        let group = &slots.groups[group];
        for turn in &group.turns {
            let _ = turn.compare_exchange(index as i32, -1, Ordering::AcqRel, Ordering::Relaxed);
        }
        let slot = &group.slots[index];
        slot.procno.store(-1, Ordering::Release);
        slot.pid.store(0, Ordering::Relaxed);
        slot.connected.store(false, Ordering::Relaxed);
        slot.state.store(State::Stopped as u8, Ordering::Relaxed);
    }
}

/// One row of `outbox.workers`.
pub struct WorkerRow {
    /// The database served (its OID; invalid until connected).
    pub database: pg_sys::Oid,
    pub index: i32,
    pub pid: Option<i32>,
    pub state: &'static str,
    pub connected: bool,
    pub started_at: Option<i64>,
    pub last_heartbeat: Option<i64>,
    pub last_error: Option<String>,
    pub dispatched: i64,
    pub broker_persistence: Option<&'static str>,
}

/// The first `count` slots of every group serving a database, as they are
/// now; with `only`, of that database's group.
pub fn rows(count: usize, only: Option<pg_sys::Oid>) -> Vec<WorkerRow> {
    let Some(slots) = slots() else {
        return Vec::new();
    };
    let errors = ERRORS.share();
    let mut rows = Vec::new();
    for (g, group) in slots.groups.iter().enumerate() {
        // A group in use: serving a database, or where a dispatcher started
        // and has not connected to one (its error says why).
        let database = pg_sys::Oid::from(group.database.load(Ordering::Acquire));
        let started = group.slots.iter().any(|slot| slot.started_at.load(Ordering::Relaxed) != 0);
        if (database == pg_sys::Oid::INVALID && !started) || only.is_some_and(|o| o != database) {
            continue;
        }
        for (index, slot) in group.slots[..count.min(MAX_WORKERS)].iter().enumerate() {
            let error = &errors[g][index];
            let len = error.iter().position(|b| *b == 0).unwrap_or(ERROR_BYTES);
            let state = slot.state.load(Ordering::Relaxed);
            let nonzero = |t: i64| (t != 0).then_some(t);
            rows.push(WorkerRow {
                database,
                index: index as i32,
                pid: Some(slot.pid.load(Ordering::Relaxed)).filter(|p| *p != 0),
                state: State::ALL.get(state as usize).copied().unwrap_or(State::Stopped).name(),
                connected: slot.connected.load(Ordering::Relaxed),
                started_at: nonzero(slot.started_at.load(Ordering::Relaxed)),
                last_heartbeat: nonzero(slot.last_heartbeat.load(Ordering::Relaxed)),
                last_error: (len > 0).then(|| String::from_utf8_lossy(&error[..len]).into_owned()),
                dispatched: slot.dispatched.load(Ordering::Relaxed) as i64,
                broker_persistence: (slot.persistence.load(Ordering::Relaxed) as usize)
                    .checked_sub(1)
                    .and_then(|i| Persistence::ALL.get(i))
                    .map(|p| p.name()),
            });
        }
    }
    rows
}
