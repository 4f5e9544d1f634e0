//! A dispatcher as a thread of `outbox-dispatch run`: what the engine
//! needs of the process it runs in ([`outbox_core::engine::Host`]), kept
//! in memory and shown in `outbox.sidecar_workers` (`outbox.workers`).
//!
//! The threads of one process share its counters and the board of status
//! rows, which a thread of its own writes ([`crate::status`]): a dispatcher
//! never waits on another's connection. Its turns (housekeeping, reports)
//! are leases it takes on its own connection ([`crate::lease`]). Each
//! thread waits with poll(2) on the broker's socket and its [`Bell`], which
//! the process rings for a wake, a reload or a shutdown.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::engine::{Held, Host, State, Turn};
use outbox_core::link::{Interest, Interrupted, Wait, NAP};
use outbox_core::metrics::{Counters, Shown, WakeSource};
use outbox_core::sink::{BrokerConfig, Persistence};

use crate::lease::Turns;
use crate::status::{Board, WorkerRow};
use crate::store::{PgDb, Session};

/// The status row is written at most this often, but for what shows at
/// once (see [`Status::publish_when`]).
const PUBLISH_EVERY: Duration = Duration::from_secs(1);

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
    /// `host:pid` of this process, in the status rows and the leases.
    pub name: String,
    board: Arc<Board>,
    /// Each dispatcher as the gauges count it, by number.
    shown: Mutex<HashMap<i32, Shown>>,
}

impl Process {
    pub fn new(board: Arc<Board>, name: String) -> Process {
        Process {
            counters: Counters::default(),
            stopping: AtomicBool::new(false),
            stopped_at: Mutex::new(None),
            name,
            board,
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
    /// Its own connection, between the store's transactions.
    session: Session,
    /// Its turns' leases.
    turns: RefCell<Turns>,
    /// Its row, which its broker operations' waits publish too.
    status: Rc<Status>,
    /// Settings the database gets wrong: `last_error` while no other
    /// error shows.
    refused: RefCell<Option<String>>,
    /// Why a turn's lease could not be had, as last shown: in `last_error`
    /// after the above.
    unleased: RefCell<Option<String>>,
}

impl Sidecar {
    pub fn new(
        process: Arc<Process>,
        bell: Arc<Bell>,
        index: i32,
        pid: i32,
        database_oid: u32,
        session: Session,
    ) -> Sidecar {
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
            session,
            turns: RefCell::default(),
            status: Rc::new(status),
            refused: RefCell::new(None),
            unleased: RefCell::new(None),
        }
    }

    /// What `last_error` shows while no error of a step does.
    fn standing(&self) -> Option<String> {
        self.refused.borrow().clone().or_else(|| self.unleased.borrow().clone())
    }

    /// Shows why a turn's lease could not be had, or that it now can: in
    /// the log as it changes, in `last_error` unless an error of a step
    /// shows there.
    fn show_unleased(&self, now: Option<String>) {
        if *self.unleased.borrow() == now {
            return;
        }
        match &now {
            Some(why) => crate::log::warning(&format!("dispatcher {}: {why}", self.index)),
            None => {
                crate::log::info(&format!("dispatcher {}: its turns' leases are taken again", self.index))
            }
        }
        let before = self.standing();
        *self.unleased.borrow_mut() = now;
        let after = self.standing();
        self.update(|r| {
            if r.last_error == before {
                r.last_error = after;
            }
        });
    }

    /// Gives back the turns it has not used for a while, for another
    /// dispatcher to take.
    pub fn give_back_idle_turns(&self) {
        let given = self.turns.borrow_mut().give_back_idle(&self.session);
        if let Err(e) = given {
            self.show_unleased(Some(e.to_string()));
        }
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
        self.process.board.post(
            self.index,
            WorkerRow {
                pid: self.pid,
                state: row.state.name(),
                connected: row.connected,
                last_error: row.last_error.clone(),
                dispatched: row.dispatched as i64,
                persistence: row.persistence.map(|p| p.name()),
                heartbeat: row.heartbeat,
            },
        );
        self.row.borrow_mut().heartbeat = false;
        *self.published.borrow_mut() = Some((Row { heartbeat: false, ..row }, Instant::now()));
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
        let holder = format!("dispatcher {} of {}", self.index, self.process.name);
        let taken = self.turns.borrow_mut().take(&self.session, turn, &holder);
        match taken {
            Ok(taken) => {
                self.show_unleased(None);
                taken.then(|| Box::new(()) as Held)
            }
            Err(e) => {
                self.show_unleased(Some(e.to_string()));
                None
            }
        }
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
