//! The dispatchers' slots in shared memory, one group per database served:
//! who each dispatcher is (its proc number, so that committing backends of
//! its database can set its latch), what it is doing, and its last error,
//! for `outbox.workers`; per database, which dispatcher has each turn and
//! whether the extension was found there. Besides: the launcher's latch,
//! and the databases a command holds for itself (`commands.rs`).
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

pub use outbox_core::engine::{State, Turn};

named! {
    /// What the dispatchers of a group found of the extension.
    pub enum Extension {
        /// Not looked yet: only dispatcher 0 runs, and looks.
        Unknown = "unknown",
        Present = "present",
        /// Not created: the dispatchers exit; the launcher lets the group go.
        Absent = "absent",
    }
}

pub use outbox_core::metrics::WakeSource;

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
    /// [`Slots::reloads`] when the launcher registered the dispatcher: the
    /// process the postmaster forks for it holds the configuration as of
    /// at least these (`worker/signals.rs`).
    reloads_at_start: AtomicU64,
}

/// The dispatchers of one database.
#[repr(C)]
pub struct Group {
    /// The database they serve (its OID); 0 while the group is free.
    database: AtomicU32,
    slots: [Slot; MAX_WORKERS],
    /// Index of the dispatcher that has each [`Turn`], -1 = none.
    turns: [AtomicI32; Turn::COUNT],
    /// An [`Extension`].
    extension: AtomicU8,
    /// The [`Slots::asked`] count seen before the lookup that found the
    /// extension absent: a later ask makes that finding stale.
    absent_as_of: AtomicU64,
}

/// A database a command (`DROP DATABASE`, a rename, a copy) holds: no
/// dispatcher may connect to it until the command ends.
#[repr(C)]
pub struct Hold {
    /// The holding backend; 0 while the entry is free.
    pid: AtomicI32,
    database: AtomicU32,
    /// The session's user (not changed by `SET ROLE`) that ran the command.
    role: AtomicU32,
}

/// The most databases held at once; a command finding none free waits
/// for the dispatchers without holding the database (and may have to try
/// again, as it would without this extension).
const MAX_HOLDS: usize = 16;

/// The most of them one login may hold at once (a copy of a large
/// database holds it as long as the copy runs): no login can take every
/// entry from the others' commands.
const HOLDS_PER_ROLE: usize = 4;

/// The asks remembered by database; more between two launcher turns have
/// it look at every database again.
const ASKS: usize = 16;

#[repr(C)]
pub struct Slots {
    groups: [Group; MAX_DATABASES],
    /// `pgprocno` of the launcher, -1 while none runs.
    launcher: AtomicI32,
    /// Commits that asked for dispatchers in a database none serves, or
    /// whose dispatchers have not found the extension (`outbox_wake()`,
    /// which `CREATE EXTENSION` calls): a count, and the last [`ASKS`] of
    /// them, each `seq << 32 | database` at `seq % ASKS`.
    asked: AtomicU64,
    asks: [AtomicU64; ASKS],
    holds: [Hold; MAX_HOLDS],
    /// The reloads of the configuration the launcher has done.
    reloads: AtomicU64,
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
                        reloads_at_start: AtomicU64::new(0),
                    }),
                    turns: std::array::from_fn(|_| AtomicI32::new(-1)),
                    extension: AtomicU8::new(Extension::Unknown as u8),
                    absent_as_of: AtomicU64::new(0),
                }),
                launcher: AtomicI32::new(-1),
                asked: AtomicU64::new(0),
                asks: std::array::from_fn(|_| AtomicU64::new(0)),
                holds: std::array::from_fn(|_| Hold {
                    pid: AtomicI32::new(0),
                    database: AtomicU32::new(0),
                    role: AtomicU32::new(0),
                }),
                reloads: AtomicU64::new(0),
            })
        }
    );
    pg_shmem_init!(ERRORS = [[[0; ERROR_BYTES]; MAX_WORKERS]; MAX_DATABASES]);
    READY.store(true, Ordering::Relaxed);
}

/// Whether the library was preloaded: shared memory exists.
pub fn preloaded() -> bool {
    READY.load(Ordering::Relaxed)
}

fn slots() -> Option<&'static Slots> {
    READY.load(Ordering::Relaxed).then(|| &**SLOTS.get())
}

/// The group serving this backend's database.
fn my_group(slots: &'static Slots) -> Option<&'static Group> {
    // SAFETY: a process global, set once connected.
    group_of(unsafe { pg_sys::MyDatabaseId }).map(|g| &slots.groups[g])
}

/// Dispatcher `index` of group `group` as one background worker argument
/// (and the argument of its exit callback).
pub fn argument(group: usize, index: usize) -> pg_sys::Datum {
    pg_sys::Datum::from(group << 16 | index)
}

/// The group and index [`argument`] made.
pub fn of_argument(argument: pg_sys::Datum) -> (usize, usize) {
    (argument.value() >> 16, argument.value() & 0xffff)
}

/// Sets the latch of every running dispatcher of this backend's database,
/// noting why. Commits leave paused dispatchers asleep (a reload wakes them
/// when `outbox.enabled` turns on). A dispatcher whose note of the same
/// wake is still there has had its latch set and not yet looked: it is
/// left alone (it reads the notes, not the latch, before it sleeps), so a
/// stream of commits costs each one an atomic operation, not a signal to a
/// lingering dispatcher. Cannot fail: safe inside a commit callback.
pub fn wake_database(source: WakeSource) {
    let Some(group) = slots().and_then(my_group) else { return };
    let bit = 1 << source as u8;
    for slot in &group.slots {
        let paused = slot.state.load(Ordering::Relaxed) == State::Paused as u8;
        if matches!(source, WakeSource::Commit) && paused {
            continue;
        }
        if let Some(latch) = latch(slot.procno.load(Ordering::Acquire)) {
            if slot.wake_sources.fetch_or(bit, Ordering::AcqRel) & bit == 0 {
                // SAFETY: the latch of a PGPROC, which lives as long as the server.
                unsafe { pg_sys::SetLatch(latch) };
            }
        }
    }
}

/// The latch of the process at `procno` in `ProcGlobal->allProcs`; none
/// for -1 or out of range.
fn latch(procno: i32) -> Option<*mut pg_sys::Latch> {
    // SAFETY: ProcGlobal is set up before any backend runs; procno is
    // bounds-checked against allProcCount before indexing allProcs.
    unsafe {
        let global = pg_sys::ProcGlobal;
        if global.is_null() || procno < 0 || procno as u32 >= (*global).allProcCount {
            return None;
        }
        Some(&raw mut (*(*global).allProcs.add(procno as usize)).procLatch)
    }
}

/// The reloads of the configuration the launcher has done (0 when the
/// library is not preloaded).
pub fn reloads() -> u64 {
    slots().map_or(0, |s| s.reloads.load(Ordering::SeqCst))
}

/// Sets the launcher's latch: something it acts on changed.
pub fn wake_launcher() {
    if let Some(latch) = slots().and_then(|s| latch(s.launcher.load(Ordering::Acquire))) {
        // SAFETY: as in wake_database.
        unsafe { pg_sys::SetLatch(latch) };
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
        unsafe { pg_sys::before_shmem_exit(Some(release), argument(group, index)) };
        let own = Own(group, index);
        own.set_error(None);
        own
    }

    /// The database the launcher gave this dispatcher's group (invalid
    /// when the group was let go before the dispatcher started).
    pub fn database(&self) -> pg_sys::Oid {
        pg_sys::Oid::from(self.group().database.load(Ordering::Acquire))
    }

    /// Records whether the extension exists in the group's database, as a
    /// lookup that started after `asked` ([`asked`]) found; the launcher
    /// starts the other dispatchers once it is present, and lets the group
    /// go when it is absent.
    pub fn found_extension(&self, present: bool, asked: u64) {
        let group = self.group();
        let (found, as_of) = if present { (Extension::Present, 0) } else { (Extension::Absent, asked) };
        group.absent_as_of.store(as_of, Ordering::Release);
        if group.extension.swap(found as u8, Ordering::SeqCst) != found as u8 {
            wake_launcher();
        }
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

    /// The launcher's count of reloads when it registered this dispatcher.
    pub fn reloads_at_start(&self) -> u64 {
        self.slot().reloads_at_start.load(Ordering::SeqCst)
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
        set_slot_error(self.0, self.1, error);
    }
}

fn set_slot_error(group: usize, index: usize, error: Option<&str>) {
    let mut errors = ERRORS.exclusive();
    let buf = &mut errors[group][index];
    let text = error.unwrap_or("").as_bytes();
    let mut len = text.len().min(ERROR_BYTES - 1);
    while len > 0 && std::str::from_utf8(&text[..len]).is_err() {
        len -= 1;
    }
    buf[..len].copy_from_slice(&text[..len]);
    buf[len] = 0;
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
        let (group, index) = of_argument(arg);
        let group = &slots.groups[group];
        for turn in &group.turns {
            let _ = turn.compare_exchange(index as i32, -1, Ordering::AcqRel, Ordering::Relaxed);
        }
        let slot = &group.slots[index];
        slot.procno.store(-1, Ordering::Release);
        slot.pid.store(0, Ordering::Release);
        slot.connected.store(false, Ordering::Relaxed);
        slot.state.store(State::Stopped as u8, Ordering::Relaxed);
    }
}

/// The group serving `database`.
pub fn group_of(database: pg_sys::Oid) -> Option<usize> {
    let slots = slots()?;
    let database = database.to_u32();
    if database == 0 {
        return None;
    }
    slots.groups.iter().position(|g| g.database.load(Ordering::Acquire) == database)
}

/// How many commits have asked the launcher to look again (see
/// [`Slots::asked`]).
pub fn asked() -> u64 {
    slots().map_or(0, |s| s.asked.load(Ordering::Acquire))
}

/// Asks the launcher for dispatchers in this backend's database, unless
/// they run there and found the extension: the commit of `outbox_wake()`
/// (`CREATE EXTENSION` calls it). Plain commits of events never ask, so a
/// database left out of `outbox.database` costs the launcher nothing.
/// Cannot fail: safe inside a commit callback.
pub fn ask_for_dispatchers() {
    let Some(slots) = slots() else { return };
    // SAFETY: a process global, set once connected.
    let database = unsafe { pg_sys::MyDatabaseId }.to_u32();
    // After the commit, before reading the group: see leave_for_extension in worker/mod.rs.
    std::sync::atomic::fence(Ordering::SeqCst);
    let present =
        my_group(slots).is_some_and(|g| g.extension.load(Ordering::SeqCst) == Extension::Present as u8);
    if database == 0 || present {
        return;
    }
    let seq = slots.asked.fetch_add(1, Ordering::AcqRel) + 1;
    slots.asks[seq as usize % ASKS].store((seq << 32) | u64::from(database), Ordering::Release);
    wake_launcher();
}

/// The launcher's view of the groups, and its hands on them. Only the
/// launcher calls these.
pub mod launcher {
    use super::*;

    /// Publishes the launcher's latch, cleared again when it exits.
    pub fn listen() {
        let slots = slots().expect("the launcher runs only when preloaded");
        // SAFETY: a background worker has a PGPROC by the time it runs.
        slots.launcher.store(unsafe { my_procno() }, Ordering::Release);
        unsafe { pg_sys::before_shmem_exit(Some(unlisten), pg_sys::Datum::from(0)) };
    }

    #[pg_guard]
    unsafe extern "C-unwind" fn unlisten(_code: i32, _arg: pg_sys::Datum) {
        if let Some(slots) = slots() {
            slots.launcher.store(-1, Ordering::Release);
        }
    }

    fn group(g: usize) -> &'static Group {
        &slots().expect("the launcher runs only when preloaded").groups[g]
    }

    /// The database each group serves, `None` where it is free.
    pub fn groups() -> Vec<Option<u32>> {
        let slots = slots().expect("the launcher runs only when preloaded");
        slots.groups.iter().map(|g| Some(g.database.load(Ordering::Acquire)).filter(|d| *d != 0)).collect()
    }

    /// What group `g`'s dispatchers found of the extension, and for an
    /// absent one, the [`asked`] count before they looked.
    pub fn extension(g: usize) -> (Extension, u64) {
        let group = group(g);
        let found = Extension::ALL.get(group.extension.load(Ordering::Acquire) as usize).copied();
        (found.unwrap_or(Extension::Unknown), group.absent_as_of.load(Ordering::Acquire))
    }

    /// Gives free group `g` to `database`, its rows from zero (the launcher
    /// resets its counters first: `counters::reset`).
    pub fn assign(g: usize, database: u32) {
        clear(g);
        group(g).database.store(database, Ordering::Release);
    }

    /// Has group `g`'s dispatcher 0 look for the extension again.
    pub fn look_again(g: usize) {
        group(g).extension.store(Extension::Unknown as u8, Ordering::Release);
    }

    /// Frees group `g`, whose dispatchers have all exited.
    pub fn free(g: usize) {
        group(g).database.store(0, Ordering::Release);
        clear(g);
    }

    fn clear(g: usize) {
        let group = group(g);
        group.extension.store(Extension::Unknown as u8, Ordering::Release);
        group.absent_as_of.store(0, Ordering::Release);
        for turn in &group.turns {
            turn.store(-1, Ordering::Release);
        }
        for (index, slot) in group.slots.iter().enumerate() {
            slot.state.store(State::Stopped as u8, Ordering::Relaxed);
            slot.started_at.store(0, Ordering::Relaxed);
            slot.last_heartbeat.store(0, Ordering::Relaxed);
            slot.dispatched.store(0, Ordering::Relaxed);
            slot.persistence.store(0, Ordering::Relaxed);
            set_slot_error(g, index, None);
        }
    }

    /// Records, before dispatcher `index` of group `g` is registered, the
    /// reloads counted so far ([`Slot::reloads_at_start`]).
    pub fn starting(g: usize, index: usize) {
        group(g).slots[index].reloads_at_start.store(reloads(), Ordering::SeqCst);
    }

    /// Counts a reload of the configuration the launcher has done, and
    /// wakes every dispatcher: one behind the count reads the files again.
    pub fn count_reload() {
        let slots = slots().expect("the launcher runs only when preloaded");
        slots.reloads.fetch_add(1, Ordering::SeqCst);
        for slot in slots.groups.iter().flat_map(|g| g.slots.iter()) {
            if let Some(latch) = latch(slot.procno.load(Ordering::Acquire)) {
                // SAFETY: as in wake_database.
                unsafe { pg_sys::SetLatch(latch) };
            }
        }
    }

    /// Shows dispatcher `index` of group `g` as started, or as not
    /// startable for `error`.
    pub fn launched(g: usize, index: usize, error: Option<&str>) {
        let state = if error.is_some() { State::NoWorkerSlot } else { State::Starting };
        group(g).slots[index].state.store(state as u8, Ordering::Relaxed);
        set_slot_error(g, index, error);
    }

    /// The databases asked for since the count `since` ([`asked`]), and
    /// the count now; `None` for the databases when more asked than are
    /// remembered (every database is then to be looked at again).
    pub fn asks_since(since: u64) -> (u64, Option<Vec<u32>>) {
        let slots = slots().expect("the launcher runs only when preloaded");
        let now = slots.asked.load(Ordering::Acquire);
        if now.saturating_sub(since) > ASKS as u64 {
            return (now, None);
        }
        let mut databases = Vec::new();
        for seq in since + 1..=now {
            let entry = slots.asks[seq as usize % ASKS].load(Ordering::Acquire);
            // Not written yet, or written over since: look at everything.
            if entry >> 32 != seq & 0xffff_ffff {
                return (now, None);
            }
            databases.push(entry as u32);
        }
        (now, Some(databases))
    }

    /// Whether dispatcher `index` of group `g` is alive, started or not by
    /// this launcher (one its predecessor started may still be exiting).
    pub fn occupied(g: usize, index: usize) -> bool {
        group(g).slots[index].pid.load(Ordering::Acquire) != 0
    }

    /// Frees the holds of backends that exited without freeing them (a
    /// FATAL error ends a backend without unwinding).
    pub fn free_stale_holds() {
        let slots = slots().expect("the launcher runs only when preloaded");
        for hold in &slots.holds {
            let pid = hold.pid.load(Ordering::Acquire);
            // SAFETY: reads the proc array under its lock.
            if pid != 0 && unsafe { pg_sys::BackendPidGetProc(pid) }.is_null() {
                let _ = hold.pid.compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Relaxed);
            }
        }
    }
}

/// Is `database` held by a command that needs it alone?
pub fn held(database: pg_sys::Oid) -> bool {
    slots().is_some_and(|s| {
        s.holds.iter().any(|h| {
            h.pid.load(Ordering::Acquire) != 0 && h.database.load(Ordering::Acquire) == database.to_u32()
        })
    })
}

/// A hold on a database, freed when dropped.
pub struct Holding(&'static Hold);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.database.store(0, Ordering::Release);
        self.0.pid.store(0, Ordering::Release);
        wake_launcher();
    }
}

/// Why [`hold`] holds nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotHeld {
    /// The library is not preloaded: there are no dispatchers to hold off.
    NotPreloaded,
    /// Every entry is taken.
    Full,
    /// The session's user holds [`HOLDS_PER_ROLE`] databases already.
    RoleShare,
}

impl std::fmt::Display for NotHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotHeld::NotPreloaded => write!(f, "the library is not preloaded"),
            NotHeld::Full => write!(f, "{MAX_HOLDS} databases are held already, the most at once"),
            NotHeld::RoleShare => {
                write!(f, "this login holds {HOLDS_PER_ROLE} databases already, the most one login may")
            }
        }
    }
}

/// Holds `database` for this backend: the launcher starts no dispatcher
/// for it, and one that connects exits.
pub fn hold(database: pg_sys::Oid) -> Result<Holding, NotHeld> {
    let slots = slots().ok_or(NotHeld::NotPreloaded)?;
    // SAFETY: process globals.
    let (me, role) = unsafe { (pg_sys::MyProcPid, pg_sys::GetSessionUserId().to_u32()) };
    let hold = slots
        .holds
        .iter()
        .find(|h| h.pid.compare_exchange(0, me, Ordering::SeqCst, Ordering::Relaxed).is_ok())
        .ok_or(NotHeld::Full)?;
    // The entry is taken first and the login's count checked after, all in
    // one order: two of its commands at once may both give theirs up,
    // never both keep more.
    hold.role.store(role, Ordering::SeqCst);
    let holding = Holding(hold);
    let of_role = slots
        .holds
        .iter()
        .filter(|h| h.pid.load(Ordering::SeqCst) != 0 && h.role.load(Ordering::SeqCst) == role)
        .count();
    if of_role > HOLDS_PER_ROLE {
        return Err(NotHeld::RoleShare);
    }
    hold.database.store(database.to_u32(), Ordering::Release);
    wake_launcher();
    Ok(holding)
}

/// The pids of the dispatchers running in `database`.
pub fn running_in(database: pg_sys::Oid) -> Vec<i32> {
    let Some(slots) = slots() else { return Vec::new() };
    slots
        .groups
        .iter()
        .filter(|g| g.database.load(Ordering::Acquire) == database.to_u32())
        .flat_map(|g| &g.slots)
        .map(|slot| slot.pid.load(Ordering::Acquire))
        .filter(|pid| *pid != 0)
        .collect()
}

/// One row of `outbox.workers`.
pub struct WorkerRow {
    /// The database served.
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
        let database = pg_sys::Oid::from(group.database.load(Ordering::Acquire));
        if database == pg_sys::Oid::INVALID || only.is_some_and(|o| o != database) {
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
