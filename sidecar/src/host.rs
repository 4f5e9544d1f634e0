//! A dispatcher as a thread of `outbox-dispatch run`: what the engine
//! needs of the process it runs in ([`outbox_core::engine::Host`]), kept
//! in memory and shown in `outbox.sidecar_workers` (`outbox.workers`).
//!
//! The threads of one process share its counters and its control
//! connection, which holds the turns (session advisory locks, kept from
//! one use to the next while the uses come, each use by one thread of the
//! process at a time) and writes the status rows, never inside a
//! dispatcher's transaction. Each thread waits with poll(2) on the
//! broker's socket and its [`Bell`], which the process rings for a wake, a
//! reload or a shutdown.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postgres::Client;

use outbox_core::engine::{Held, Host, State, Turn};
use outbox_core::link::{Interest, Interrupted, Wait, NAP};
use outbox_core::metrics::{Counters, Shown, WakeSource};
use outbox_core::sink::{BrokerConfig, Persistence};

use crate::connect::Connector;
use crate::store::PgDb;

/// The first key of every advisory lock of outbox_dispatch ("outb"); the
/// install takes (KEY, 1).
pub const LOCK_CLASS: i32 = 0x6f75_7462;
/// The second key of dispatcher `n`'s lock: `DISPATCHER_LOCKS + n`.
pub const DISPATCHER_LOCKS: i32 = 1000;
/// The second key of a turn's lock: `TURN_LOCKS + turn`.
const TURN_LOCKS: i32 = 2000;
/// The status row is written at most this often, but for what shows at
/// once (see [`Status::publish_when`]).
const PUBLISH_EVERY: Duration = Duration::from_secs(1);
/// A turn's lock held is confirmed (the control connection answers) at
/// most this long before it is used; one another session holds is asked
/// for again after this.
const TURN_CHECK: Duration = Duration::from_secs(1);
/// A turn's lock unused this long is given back.
const TURN_IDLE: Duration = Duration::from_secs(2);

/// How long a stop lets the push in flight finish, and its marks be
/// written, before its broker operation is abandoned.
pub const STOP_DRAIN: Duration = Duration::from_secs(5);

/// The exit status when the outbox is not installed, is installed at
/// another release, or the extension serves the database.
pub const EXIT_NOT_INSTALLED: i32 = 3;

/// What the threads of one process share.
pub struct Process {
    pub counters: Counters,
    stopping: AtomicBool,
    /// When the stop came.
    stopped_at: Mutex<Option<Instant>>,
    /// `host:pid` of this process, in the status rows.
    pub name: String,
    control: Control,
    /// Whether a thread of the process has the turn now.
    turns: [AtomicBool; Turn::COUNT],
    /// Each turn's lock, as the control connection holds it.
    locks: Mutex<[TurnLock; Turn::COUNT]>,
    /// Each dispatcher as the gauges count it, by number.
    shown: Mutex<HashMap<i32, Shown>>,
}

impl Process {
    pub fn new(connector: Connector, name: String) -> Process {
        Process {
            counters: Counters::default(),
            stopping: AtomicBool::new(false),
            stopped_at: Mutex::new(None),
            name,
            control: Control { connector, client: Mutex::new(Err(Instant::now())), made: AtomicU64::new(0) },
            turns: std::array::from_fn(|_| AtomicBool::new(false)),
            locks: Mutex::default(),
            shown: Mutex::default(),
        }
    }

    /// A SIGTERM came: every thread stops, once the push it has in flight
    /// is done (within [`STOP_DRAIN`]) and marked.
    pub fn stop(&self) {
        self.stopped_at.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(Instant::now);
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// The stop came [`STOP_DRAIN`] ago or more: a broker operation still
    /// in flight is abandoned (its events go back in line).
    fn giving_up(&self) -> bool {
        self.stopped_at.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|at| at.elapsed() >= STOP_DRAIN)
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// The dispatchers of this process as the gauges count them.
    pub fn shown(&self) -> Vec<Shown> {
        self.shown.lock().unwrap_or_else(|e| e.into_inner()).values().copied().collect()
    }

    /// Runs `body` on the control connection; `None` when there is none
    /// to be had or `body` failed (logged).
    pub fn with_control<R>(&self, body: impl FnOnce(&mut Client) -> Result<R, String>) -> Option<R> {
        self.control.with(body)
    }

    /// Whether the control connection `c` holds `turn`'s lock: kept from
    /// one use to the next while they come (reports are looked for ten
    /// times a second) and given back once unused for [`TURN_IDLE`]
    /// ([`Process::release_idle_turns`]); confirmed when the connection
    /// has not answered for [`TURN_CHECK`]. A lock held goes with its
    /// session: a connection made again asks anew.
    fn lock_turn(&self, c: &mut Client, turn: Turn) -> Result<bool, String> {
        let connection = self.control.made.load(Ordering::SeqCst);
        let now = Instant::now();
        let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        let lock = &mut locks[turn as usize];
        match lock.held {
            Some(held) if held.on == connection => {
                let mut answered = held.answered;
                if now >= answered + TURN_CHECK {
                    c.batch_execute("SELECT").map_err(|e| crate::connect::chain(&e))?;
                    answered = now;
                }
                lock.held = Some(LockHeld { answered, used: now, ..held });
                return Ok(true);
            }
            _ => lock.held = None,
        }
        if lock.refused_until.is_some_and(|until| now < until) {
            return Ok(false);
        }
        let key = TURN_LOCKS + turn as i32;
        let taken = c
            .query_one("SELECT pg_catalog.pg_try_advisory_lock($1, $2)", &[&LOCK_CLASS, &key])
            .map_err(|e| crate::connect::chain(&e))?
            .get::<_, bool>(0);
        *lock = match taken {
            true => TurnLock {
                held: Some(LockHeld { on: connection, answered: now, used: now }),
                refused_until: None,
                squatter: None,
            },
            false => TurnLock {
                held: None,
                refused_until: Some(now + TURN_CHECK),
                squatter: squatters(c, key..=key)?
                    .into_iter()
                    .next()
                    .map(|holder| format!("the {} turn is held by {holder}", turn.name())),
            },
        };
        Ok(taken)
    }

    /// Gives back the locks of turns no thread of the process has used
    /// for [`TURN_IDLE`]: a process that stops collecting (its broker is
    /// down) or whose housekeeping is done lets another sidecar take them.
    pub fn release_idle_turns(&self) {
        let now = Instant::now();
        let idle = |locks: &[TurnLock; Turn::COUNT], turn: Turn| {
            locks[turn as usize].held.is_some_and(|held| now >= held.used + TURN_IDLE)
        };
        {
            let locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            if !Turn::ALL.iter().any(|&turn| idle(&locks, turn)) {
                return;
            }
        }
        self.control.with(|c| {
            let connection = self.control.made.load(Ordering::SeqCst);
            let mut locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
            for turn in Turn::ALL {
                // Not while a thread has the turn (it holds the flag).
                if !idle(&locks, turn) || self.turns[turn as usize].swap(true, Ordering::SeqCst) {
                    continue;
                }
                // Held on a connection since lost, it went with its session.
                let released = match locks[turn as usize].held.take() {
                    Some(held) if held.on == connection => c
                        .execute(
                            "SELECT pg_catalog.pg_advisory_unlock($1, $2)",
                            &[&LOCK_CLASS, &(TURN_LOCKS + turn as i32)],
                        )
                        .map(drop)
                        .map_err(|e| crate::connect::chain(&e)),
                    _ => Ok(()),
                };
                self.turns[turn as usize].store(false, Ordering::SeqCst);
                released?;
            }
            Ok(())
        });
    }

    /// What holds a turn of this process back that is not the outbox's
    /// (see [`squatters`]), one line per turn.
    fn squatted(&self) -> Option<String> {
        let locks = self.locks.lock().unwrap_or_else(|e| e.into_inner());
        let lines: Vec<&str> = locks.iter().filter_map(|l| l.squatter.as_deref()).collect();
        (!lines.is_empty()).then(|| lines.join("; "))
    }
}

/// The sessions holding one of the advisory locks `keys` (with
/// [`LOCK_CLASS`]) whose role is not a member of the outbox's owner, each
/// as `role R (pid P), ...`. Any role that may connect can take any
/// advisory lock, and hold a turn or a dispatcher's number forever: what
/// it holds is named, for the database's administrator to end (the
/// squatter is no dispatcher of ours: docs/guides/managed.md, "Privileges").
pub fn squatters(c: &mut Client, keys: std::ops::RangeInclusive<i32>) -> Result<Vec<String>, String> {
    let rows = c
        .query(
            "SELECT a.usename::pg_catalog.text, a.pid \
               FROM pg_catalog.pg_locks AS l JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid \
              WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 \
                AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d \
                                   WHERE d.datname = pg_catalog.current_database()) \
                AND l.classid::pg_catalog.int8 = $1 AND l.objid::pg_catalog.int8 BETWEEN $2 AND $3 \
                AND NOT pg_catalog.pg_has_role(a.usesysid, outbox.owner(), 'MEMBER') \
              ORDER BY a.pid",
            &[&i64::from(LOCK_CLASS), &i64::from(*keys.start()), &i64::from(*keys.end())],
        )
        .map_err(|e| crate::connect::chain(&e))?;
    Ok(rows
        .iter()
        .map(|r| {
            let (role, pid): (Option<String>, i32) = (r.get(0), r.get(1));
            format!(
                "role {} (pid {pid}), which is not the outbox's owner: end it with pg_terminate_backend({pid})",
                role.as_deref().unwrap_or("?")
            )
        })
        .collect())
}

/// A turn's lock the control connection holds.
#[derive(Clone, Copy)]
struct LockHeld {
    /// The connection it is held on (which one of those made).
    on: u64,
    /// When that connection last answered.
    answered: Instant,
    /// When a thread last took the turn.
    used: Instant,
}

/// A turn's advisory lock, as the control connection holds it.
#[derive(Clone, Default)]
struct TurnLock {
    held: Option<LockHeld>,
    /// Another session held it: not asked for again before this.
    refused_until: Option<Instant>,
    /// That session, when it is not the outbox's (see [`squatters`]).
    squatter: Option<String>,
}

/// The control connection, made when first needed and again after it
/// failed.
struct Control {
    connector: Connector,
    /// The connection, or when to try making one again.
    client: Mutex<Result<Client, Instant>>,
    /// Connections made so far: the current one's number.
    made: AtomicU64,
}

/// How long a statement of the control connection may run, and how soon a
/// failed connect is tried again.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(10);
const CONTROL_RETRY: Duration = Duration::from_secs(1);

impl Control {
    /// Runs `body` on the connection; `None` when there is none to be had
    /// or the statement failed (logged).
    fn with<R>(&self, body: impl FnOnce(&mut Client) -> Result<R, String>) -> Option<R> {
        let mut guard = self.client.lock().unwrap_or_else(|e| e.into_inner());
        let usable = matches!(&*guard, Ok(client) if !client.is_closed());
        if !usable {
            if matches!(&*guard, Err(retry_at) if Instant::now() < *retry_at) {
                return None;
            }
            let connected = self.connector.connect(CONTROL_TIMEOUT).and_then(|mut c| {
                crate::connect::pin_session(&mut c)?;
                c.batch_execute(&format!("SET statement_timeout = {}", CONTROL_TIMEOUT.as_millis()))
                    .map_err(|e| crate::connect::chain(&e))?;
                Ok(c)
            });
            match connected {
                Ok(client) => {
                    *guard = Ok(client);
                    self.made.fetch_add(1, Ordering::SeqCst);
                }
                Err(e) => {
                    crate::log::warning(&format!(
                        "the control connection failed: {e}; trying again in {}s",
                        CONTROL_RETRY.as_secs()
                    ));
                    *guard = Err(Instant::now() + CONTROL_RETRY);
                    return None;
                }
            }
        }
        let Ok(client) = &mut *guard else { return None };
        match body(client) {
            Ok(value) => Some(value),
            Err(e) => {
                crate::log::warning(&format!("the control connection: {e}"));
                None
            }
        }
    }
}

/// Rings every bell for a wake of `source`.
pub fn wake_all(bells: &[Arc<Bell>], source: WakeSource) {
    bells.iter().for_each(|b| b.wake(source));
}

/// How the process reaches one thread: the flags it sets, and a pipe whose
/// byte ends the thread's wait.
pub struct Bell {
    reload: AtomicBool,
    wakes: AtomicU8,
    read: OwnedFd,
    write: OwnedFd,
}

impl Bell {
    pub fn new() -> std::io::Result<Bell> {
        let mut fds = [0; 2];
        // SAFETY: two descriptors written into `fds` on success.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the pipe's two ends, owned from here on.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Bell { reload: AtomicBool::new(false), wakes: AtomicU8::new(0), read, write })
    }

    /// Sleeps for `timeout`, or until the bell rings.
    pub fn pause(&self, timeout: Duration) {
        self.wait(None, timeout);
    }

    fn ring(&self) {
        // SAFETY: one byte to our own non-blocking pipe; a full pipe rings
        // already.
        unsafe { libc::write(self.write.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    }

    /// Events may be waiting (`source`).
    pub fn wake(&self, source: WakeSource) {
        self.wakes.fetch_or(1 << source as u8, Ordering::SeqCst);
        self.ring();
    }

    /// A SIGHUP: the settings are read again.
    pub fn reload(&self) {
        self.reload.store(true, Ordering::SeqCst);
        self.ring();
    }

    /// A reload that failed: tried again at the next step.
    pub fn reload_later(&self) {
        self.reload.store(true, Ordering::SeqCst);
    }

    /// Ends the wait for a shutdown (the flag is the process's).
    pub fn stop(&self) {
        self.ring();
    }

    pub fn take_reload(&self) -> bool {
        self.reload.swap(false, Ordering::SeqCst)
    }

    fn reload_pending(&self) -> bool {
        self.reload.load(Ordering::SeqCst)
    }

    /// Whether a wake came (and has not been slept on since).
    pub fn woken(&self) -> bool {
        self.wakes.load(Ordering::SeqCst) != 0
    }

    /// Waits for the socket, the bell, or the time to pass; empties the pipe.
    fn wait(&self, socket: Option<(RawFd, Interest)>, timeout: Duration) {
        let mut fds = vec![libc::pollfd { fd: self.read.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        if let Some((fd, interest)) = socket {
            let events = match interest {
                Interest::Readable => libc::POLLIN,
                Interest::Writable => libc::POLLOUT,
            };
            fds.push(libc::pollfd { fd, events, revents: 0 });
        }
        // Rounded up: a wait of less than a millisecond is not a busy loop.
        let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: valid pollfds; EINTR just returns early.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if fds[0].revents != 0 {
            let mut sink = [0u8; 64];
            // SAFETY: reads our own non-blocking pipe into `sink`.
            while unsafe { libc::read(self.read.as_raw_fd(), sink.as_mut_ptr().cast(), sink.len()) } > 0 {}
        }
    }
}

/// A dispatcher's row of `outbox.sidecar_workers`, as last set.
#[derive(Clone, PartialEq)]
struct Row {
    state: State,
    connected: bool,
    last_error: Option<String>,
    persistence: Option<Persistence>,
    dispatched: u64,
    heartbeat: bool,
}

/// One dispatcher thread: dispatcher `index` on the connection whose
/// backend is `pid`.
pub struct Sidecar {
    process: Arc<Process>,
    bell: Arc<Bell>,
    index: i32,
    database_oid: u32,
    /// Its row, which its broker operations' waits publish too.
    status: Rc<Status>,
    /// Settings the database gets wrong: `last_error` while no other
    /// error shows.
    refused: RefCell<Option<String>>,
    /// A turn held by a session not the outbox's, as last shown: in
    /// `last_error` after the above.
    squatted: RefCell<Option<String>>,
}

impl Sidecar {
    pub fn new(process: Arc<Process>, bell: Arc<Bell>, index: i32, pid: i32, database_oid: u32) -> Sidecar {
        let row = Row {
            state: State::Starting,
            connected: false,
            last_error: None,
            persistence: None,
            dispatched: 0,
            heartbeat: false,
        };
        let status = Status {
            process: Arc::clone(&process),
            index,
            pid,
            row: RefCell::new(row),
            published: RefCell::new(None),
        };
        Sidecar {
            process,
            bell,
            index,
            database_oid,
            status: Rc::new(status),
            refused: RefCell::new(None),
            squatted: RefCell::new(None),
        }
    }

    /// What `last_error` shows while no error of a step does.
    fn standing(&self) -> Option<String> {
        self.refused.borrow().clone().or_else(|| self.squatted.borrow().clone())
    }

    /// Shows a turn held back by a session not the outbox's, or that it
    /// no longer is: in the log as it changes, in `last_error` unless an
    /// error of a step shows there.
    fn show_squatted(&self) {
        let now = self.process.squatted();
        if *self.squatted.borrow() == now {
            return;
        }
        match &now {
            Some(why) => crate::log::warning(&format!("dispatcher {}: {why}", self.index)),
            None => crate::log::info(&format!("dispatcher {}: the turns are the outbox's again", self.index)),
        }
        let before = self.standing();
        *self.squatted.borrow_mut() = now;
        let after = self.standing();
        self.update(|r| {
            if r.last_error == before {
                r.last_error = after;
            }
        });
    }

    /// Sleeps until `timeout` passed, a wake, a reload or a shutdown;
    /// returns whether the time ran out.
    pub fn sleep(&self, timeout: Duration) -> bool {
        if self.bell.woken() || self.interrupt_pending() {
            return false;
        }
        let started = Instant::now();
        self.bell.wait(None, timeout);
        !self.bell.woken() && !self.interrupt_pending() && started.elapsed() >= timeout
    }

    /// Writes the row, between steps, when it changed: its state and its
    /// error at once, the rest at most every [`PUBLISH_EVERY`].
    pub fn publish(&self) {
        self.status.publish_when(false);
    }

    /// The settings refused at the last reading (logged by the caller),
    /// shown in `last_error` until they are read right.
    pub fn refuse_settings(&self, why: Option<String>) {
        *self.refused.borrow_mut() = why;
        let shown = self.standing();
        self.update(|r| r.last_error = shown);
    }

    fn update(&self, change: impl FnOnce(&mut Row)) {
        self.status.update(change);
    }
}

/// A dispatcher's row of `outbox.sidecar_workers`, as it is and as it was
/// last written.
struct Status {
    process: Arc<Process>,
    index: i32,
    pid: i32,
    row: RefCell<Row>,
    /// What was last written, and when.
    published: RefCell<Option<(Row, Instant)>>,
}

impl Status {
    /// Writes the row when it changed. Within a step (a push the broker
    /// holds up, a long drain) an error or a connection lost or made is
    /// shown at once, as the library shows it; a state at most every
    /// [`PUBLISH_EVERY`], which keeps a drain's batches from costing a
    /// write each.
    fn publish_when(&self, within_step: bool) {
        let row = self.row.borrow().clone();
        let due = match &*self.published.borrow() {
            None => true,
            Some((last, _)) if last.last_error != row.last_error || last.connected != row.connected => true,
            Some((last, _)) if last.state != row.state && !within_step => true,
            Some((last, at)) => *last != row && at.elapsed() >= PUBLISH_EVERY,
        };
        if !due {
            return;
        }
        let persistence = row.persistence.map(|p| p.name());
        let written = self.process.control.with(|c| {
            c.execute(
                "INSERT INTO outbox.sidecar_workers AS w \
                        (worker, pid, host, state, connected, started_at, last_heartbeat, last_error, \
                         events_dispatched, broker_persistence) \
                 VALUES ($1, $2, $3, $4, $5, pg_catalog.now(), CASE WHEN $6 THEN pg_catalog.now() END, $7, $8, $9) \
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
                &[
                    &self.index,
                    &self.pid,
                    &self.process.name,
                    &row.state.name(),
                    &row.connected,
                    &row.heartbeat,
                    &row.last_error,
                    &(row.dispatched as i64),
                    &persistence,
                ],
            )
            .map_err(|e| crate::connect::chain(&e))
        });
        if written.is_some() {
            self.row.borrow_mut().heartbeat = false;
            *self.published.borrow_mut() = Some((row, Instant::now()));
        }
    }

    /// Changes the row; what shows at once is written at once.
    fn update(&self, change: impl FnOnce(&mut Row)) {
        let shown = {
            let mut row = self.row.borrow_mut();
            change(&mut row);
            Shown {
                running: row.state != State::Stopped,
                connected: row.connected,
                blocked: row.state == State::Blocked,
            }
        };
        self.process.shown.lock().unwrap_or_else(|e| e.into_inner()).insert(self.index, shown);
        self.publish_when(true);
    }
}

impl Drop for Status {
    fn drop(&mut self) {
        self.process.shown.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.index);
    }
}

/// A turn a thread has: its flag in the process (the lock is the control connection's).
struct TurnHeld {
    process: Arc<Process>,
    turn: Turn,
}

impl Drop for TurnHeld {
    /// The turn goes back to the process; its lock stays with the control
    /// connection, for the next use.
    fn drop(&mut self) {
        self.process.turns[self.turn as usize].store(false, Ordering::SeqCst);
    }
}

/// The [`Wait`] of broker operations: the socket and the bell; a
/// shutdown abandons the operation once it has had [`STOP_DRAIN`] to
/// finish (a push whose answers came is marked). A reload does not: the broker's
/// settings are the process's own, read at its start, and the rest are
/// read once the operation is done (the log says so).
pub struct Waiter {
    process: Arc<Process>,
    bell: Arc<Bell>,
    /// The row, written when due while the broker holds the operation up
    /// (a state changed within a step shows within a second).
    status: Rc<Status>,
    index: i32,
    /// The reload pending at the last check, logged then.
    reload_noted: bool,
}

impl Wait for Waiter {
    fn wait(&mut self, socket: Option<(RawFd, Interest)>, deadline: Instant) -> Result<(), Interrupted> {
        self.check()?;
        let left = deadline.saturating_duration_since(Instant::now());
        self.bell.wait(socket, if socket.is_some() { left.min(PUBLISH_EVERY) } else { left.min(NAP) });
        self.status.publish_when(true);
        self.check()
    }

    fn check(&mut self) -> Result<(), Interrupted> {
        if self.process.giving_up() {
            return Err(Interrupted);
        }
        let pending = self.bell.reload_pending();
        if pending && !self.reload_noted {
            crate::log::info(&format!(
                "outbox dispatcher {}: a reload came during a broker operation; the broker's settings are the \
                 process's own: the operation goes on, and the rest are read once it is done",
                self.index
            ));
        }
        self.reload_noted = pending;
        Ok(())
    }
}

impl Host for Sidecar {
    type Db = PgDb;
    type Waiter = Waiter;

    fn waiter(&self, _config: &BrokerConfig) -> Waiter {
        Waiter {
            process: Arc::clone(&self.process),
            bell: Arc::clone(&self.bell),
            status: Rc::clone(&self.status),
            index: self.index,
            reload_noted: false,
        }
    }

    fn set_state(&self, state: State) {
        self.update(|r| r.state = state);
    }

    fn resume(&self) {
        self.update(|r| {
            if r.state == State::Paused {
                r.state = State::Idle;
            }
        });
    }

    fn set_error(&self, error: Option<&str>) {
        let shown = error.map(str::to_string).or_else(|| self.standing());
        self.update(|r| r.last_error = shown);
    }

    fn set_connected(&self, connected: bool) {
        self.update(|r| r.connected = connected);
    }

    fn heartbeat(&self) {
        self.update(|r| r.heartbeat = true);
    }

    fn set_persistence(&self, persistence: Persistence) {
        self.update(|r| r.persistence = Some(persistence));
    }

    fn add_dispatched(&self, events: u64) {
        self.update(|r| r.dispatched += events);
    }

    fn take_wake_sources(&self) -> u8 {
        self.bell.wakes.swap(0, Ordering::SeqCst)
    }

    fn take_turn(&self, turn: Turn) -> Option<Held> {
        if self.process.turns[turn as usize].swap(true, Ordering::SeqCst) {
            return None;
        }
        // Held from here: dropped (a refusal, a panic), the flag goes back.
        let held = TurnHeld { process: Arc::clone(&self.process), turn };
        let taken = self.process.control.with(|c| self.process.lock_turn(c, turn));
        self.show_squatted();
        (taken == Some(true)).then(|| Box::new(held) as Held)
    }

    fn counters(&self) -> &Counters {
        &self.process.counters
    }

    fn report_running(&self, _what: &'static CStr) {}

    fn log(&self, message: &str) {
        crate::log::info(message);
    }

    fn warning(&self, message: &str) {
        crate::log::warning(message);
    }

    fn interrupt_pending(&self) -> bool {
        self.process.stopping() || self.bell.reload_pending()
    }

    fn linger(&self, until: Instant) -> bool {
        loop {
            if self.interrupt_pending() {
                return false;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            self.bell.wait(None, left);
        }
    }

    fn found_outbox(&self, _found: bool, _asked: u64) {}

    fn asked(&self) -> u64 {
        0
    }

    fn database_oid(&self) -> u32 {
        self.database_oid
    }

    fn leave(&self) -> ! {
        crate::log::warning(
            "the outbox is no longer installed in the database (or the extension was created there): \
             outbox-dispatch run stops",
        );
        std::process::exit(EXIT_NOT_INSTALLED)
    }
}
