//! `outbox-dispatch run`: the dispatchers of one database, as threads of
//! this process, each on a connection of its own (a backend of the
//! server), running the engine the background workers run.
//!
//! The main thread takes the signals (blocked in every thread, taken with
//! `sigtimedwait`): SIGTERM or SIGINT stops every dispatcher once the push
//! it has in flight is done and marked, within [`STOP_DRAIN`]; what still
//! runs then is cancelled (its statements, its broker operations); SIGHUP
//! reads the settings again. A thread whose connection fails connects
//! again after a backoff with jitter, under the first dispatcher number
//! free (a lease its session holds, which no two dispatchers of the
//! database hold: the number tells whose claims a restart puts back in
//! line).

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use postgres::Client;

use outbox_core::backoff;
use outbox_core::engine::{self, Dispatcher, Host, Settings, State};
use outbox_core::guc;

use crate::connect::{chain, pin_session, Connector};
use crate::host::{Bell, Process, Sidecar, EXIT_NOT_INSTALLED, STOP_DRAIN};
use crate::status::Board;
use crate::store::{PgDb, Session, Watchdog};
use crate::{lease, log, metrics, pooler, script};

/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stop waits for the dispatchers to finish what they do, the
/// [`STOP_DRAIN`] given to the pushes in flight included, and then for
/// their last rows to be written.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const FLUSH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long reading the settings again may take.
const SETTINGS_TIMEOUT: Duration = Duration::from_secs(10);
/// Reconnects to the database back off between these.
const RECONNECT_MIN: Duration = Duration::from_secs(1);
const RECONNECT_MAX: Duration = Duration::from_secs(30);

/// What `run` is given: the sidecar's own configuration. The rest of the
/// settings are the database's (`outbox.settings`, `ALTER DATABASE ... SET`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunConfig {
    pub dsn: String,
    pub tls_ca_file: Option<PathBuf>,
    pub dispatchers: usize,
    /// The longest a dispatcher sleeps without a wake (a NOTIFY).
    pub poll_interval: Duration,
    /// Where `/metrics` is served (`host:port`); `None`: nowhere.
    pub metrics_listen: Option<String>,
    /// The settings that belong to the sidecar (secrets, paths on its
    /// host), by their names in the database.
    pub own: Vec<(&'static str, String)>,
}

/// Settings the sidecar's configuration holds, never the database: their
/// option, environment variable and setting.
pub const OWN_SETTINGS: [(&str, &str, &str); 7] = [
    ("--broker-url", "OUTBOX_BROKER_URL", "outbox.broker_url"),
    ("--broker-password-file", "OUTBOX_BROKER_PASSWORD_FILE", "outbox.broker_password_file"),
    ("--broker-tls-ca-file", "OUTBOX_BROKER_TLS_CA_FILE", "outbox.broker_tls_ca_file"),
    ("--broker-tls-cert-file", "OUTBOX_BROKER_TLS_CERT_FILE", "outbox.broker_tls_cert_file"),
    ("--broker-tls-key-file", "OUTBOX_BROKER_TLS_KEY_FILE", "outbox.broker_tls_key_file"),
    (
        "--kafka-sasl-plain-cleartext",
        "OUTBOX_KAFKA_SASL_PLAIN_CLEARTEXT",
        "outbox.kafka_sasl_plain_cleartext",
    ),
    ("--sentinel-password-file", "OUTBOX_SENTINEL_PASSWORD_FILE", "outbox.redis_sentinel_password_file"),
];

/// Whether the setting `name` is the sidecar's own, never the database's:
/// those of [`OWN_SETTINGS`] and their former names, and `outbox.redis_url`,
/// the former name of `outbox.broker_url`, whose default stands when no URL
/// is given (the database must not choose where the events, and the
/// broker's password, go).
fn is_own(name: &str) -> bool {
    let name = guc::RENAMED.iter().find(|(former, _)| *former == name).map_or(name, |(_, new)| new);
    name == "outbox.redis_url" || OWN_SETTINGS.iter().any(|(_, _, setting)| *setting == name)
}

/// Why a database is not served.
enum Check {
    /// For good: the outbox is not installed, or at another release, or
    /// the extension serves the database.
    Refused(String),
    /// For now: the connection or a statement failed.
    Failed(String),
}

impl From<postgres::Error> for Check {
    fn from(e: postgres::Error) -> Check {
        Check::Failed(chain(&e))
    }
}

/// Whether this database is served by `run`: the outbox of this release
/// installed, and not the extension.
fn check_installed(client: &mut Client) -> Result<(), Check> {
    // The extension first: its schema may be one this role cannot see.
    let extension = client.query_one(
        "SELECT EXISTS (SELECT FROM pg_catalog.pg_extension WHERE extname = 'outbox_dispatch')",
        &[],
    )?;
    if extension.get::<_, bool>(0) {
        return Err(Check::Refused(
            "the extension outbox_dispatch is created in this database: its background workers deliver its \
             events; outbox-dispatch run is for databases where it cannot be loaded"
                .into(),
        ));
    }
    let installed = client.query_one("SELECT pg_catalog.to_regclass('outbox.installed') IS NOT NULL", &[])?;
    if !installed.get::<_, bool>(0) {
        return Err(Check::Refused(
            "the outbox is not installed in this database: run outbox-dispatch install".into(),
        ));
    }
    let version: String = client
        .query_one("SELECT version FROM outbox.installed ORDER BY installed_at DESC LIMIT 1", &[])?
        .get(0);
    if version != script::VERSION {
        return Err(Check::Refused(format!(
            "outbox_dispatch {version} is installed in this database and this outbox-dispatch is {}: \
             run the outbox-dispatch of {version}",
            script::VERSION
        )));
    }
    Ok(())
}

/// Connects to the database and checks it is one to serve, on a session
/// of its own (no pooler in transaction mode between them).
fn connect_checked(connector: &Connector) -> Result<Client, Check> {
    let mut client = connector.connect(CONNECT_TIMEOUT).map_err(Check::Failed)?;
    pin_session(&mut client).map_err(Check::Failed)?;
    match pooler::refuse_pooled(&mut client, connector) {
        Ok(()) => {}
        Err(refusal @ pooler::Refusal::Pooled(_)) => return Err(Check::Refused(refusal.to_string())),
        Err(failed) => return Err(Check::Failed(failed.to_string())),
    }
    check_installed(&mut client)?;
    Ok(client)
}

/// The settings: the sidecar's own from its configuration, the others as
/// the database has them; the values refused are named in the log and in
/// `last_error`.
fn read_settings(
    client: &mut Client,
    own: &[(&'static str, String)],
    oid: u32,
) -> Result<(Settings, Vec<String>), String> {
    let names: Vec<&str> = guc::DECLARED.iter().map(|d| d.name).collect();
    let rows = client
        .query("SELECT n, outbox.setting(n) FROM pg_catalog.unnest($1::text[]) AS n", &[&names])
        .map_err(|e| chain(&e))?;
    let database: HashMap<String, Option<String>> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let value = |name: &str| match own.iter().find(|(n, _)| *n == name) {
        Some((_, v)) => Some(v.clone()),
        None if is_own(name) => None,
        None => database.get(name).cloned().flatten(),
    };
    let (settings, invalid) = Settings::read(&value, oid);
    Ok((settings, invalid.iter().map(|i| format!("{i}: using the default")).collect()))
}

/// Runs the dispatchers until a SIGTERM or SIGINT; the exit status.
pub fn run(config: RunConfig) -> i32 {
    let signals = block_signals();
    for (_, value) in config.own.iter().filter(|(name, _)| *name == "outbox.broker_url") {
        log::hide(value);
    }
    let connector = match Connector::new(&config.dsn, config.tls_ca_file.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            log::error(&e);
            return 2;
        }
    };
    // Refused at once, rather than retried: nothing here will change. On
    // a thread of its own, while this one answers signals: a server that
    // accepts and never answers must not hold off a SIGTERM.
    let checked = {
        let connector = connector.clone();
        std::thread::spawn(move || connect_checked(&connector).map(drop))
    };
    while !checked.is_finished() {
        match next_signal(&signals, Duration::from_millis(100)) {
            // Nothing read yet: nothing to read again.
            None | Some(libc::SIGHUP) => {}
            Some(signal) => {
                log::info(&format!("received {}, stopping", signal_name(signal)));
                return 0;
            }
        }
    }
    match checked.join() {
        Ok(Ok(())) => {}
        Ok(Err(Check::Refused(why))) => {
            log::error(&why);
            return EXIT_NOT_INSTALLED;
        }
        Ok(Err(Check::Failed(why))) => log::warning(&format!("connecting: {why}; trying again")),
        Err(_) => log::warning("connecting: a panic; trying again"),
    }
    let listener = match config.metrics_listen.as_deref().map(TcpListener::bind).transpose() {
        Ok(listener) => listener,
        Err(e) => {
            log::error(&format!("--metrics-listen: {e}"));
            return 2;
        }
    };
    let name = format!("{}:{}", engine::hostname(), std::process::id());
    let board = Board::start(connector.clone(), name.clone());
    let process = Arc::new(Process::new(Arc::clone(&board), name));
    if let Some(listener) = listener {
        let (process, connector) = (Arc::clone(&process), connector.clone());
        let _ = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || metrics::serve(listener, process, connector));
    }
    let config = Arc::new(config);
    let watchdogs: Arc<Mutex<HashMap<usize, Watchdog>>> = Arc::default();
    let mut bells = Vec::new();
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    for slot in 0..config.dispatchers {
        let bell = match Bell::new() {
            Ok(bell) => Arc::new(bell),
            Err(e) => {
                log::error(&format!("a pipe: {e}"));
                return 1;
            }
        };
        bells.push(Arc::clone(&bell));
        let thread = DispatcherThread {
            slot,
            process: Arc::clone(&process),
            bell,
            config: Arc::clone(&config),
            connector: connector.clone(),
            watchdogs: Arc::clone(&watchdogs),
        };
        let spawned =
            std::thread::Builder::new().name(format!("dispatcher {slot}")).spawn(move || thread.serve());
        match spawned {
            Ok(handle) => threads.push(handle),
            Err(e) => {
                log::error(&format!("a thread: {e}"));
                return 1;
            }
        }
    }
    {
        let (process, bells, connector) = (Arc::clone(&process), bells.clone(), connector.clone());
        let _ = std::thread::Builder::new()
            .name("listener".into())
            .spawn(move || crate::listen::listen(&process, &bells, &connector));
    }
    log::info(&format!(
        "outbox-dispatch {} running {} dispatcher(s), polling every {} ms",
        script::VERSION,
        config.dispatchers,
        config.poll_interval.as_millis()
    ));
    loop {
        match next_signal(&signals, Duration::from_secs(1)) {
            Some(libc::SIGHUP) => {
                log::info("received SIGHUP, reading the settings again");
                bells.iter().for_each(|b| b.reload());
            }
            Some(signal) => {
                log::info(&format!("received {}, stopping", signal_name(signal)));
                break;
            }
            None if threads.iter().all(JoinHandle::is_finished) => break,
            None => board.watch(),
        }
    }
    process.stop();
    bells.iter().for_each(|b| b.stop());
    let deadline = Instant::now() + STOP_TIMEOUT;
    let drained = Instant::now() + STOP_DRAIN;
    while Instant::now() < drained && !threads.iter().all(JoinHandle::is_finished) {
        std::thread::sleep(Duration::from_millis(20));
    }
    watchdogs.lock().unwrap_or_else(|e| e.into_inner()).values().for_each(Watchdog::cancel_now);
    while Instant::now() < deadline && !threads.iter().all(JoinHandle::is_finished) {
        std::thread::sleep(Duration::from_millis(20));
    }
    board.flush(Instant::now() + FLUSH_TIMEOUT);
    if threads.iter().all(JoinHandle::is_finished) {
        log::info("stopped");
        0
    } else {
        log::warning(&format!(
            "dispatchers still busy after {}s: exiting all the same",
            STOP_TIMEOUT.as_secs()
        ));
        1
    }
}

/// One dispatcher thread: the `slot`th of the process, and what it
/// shares with the others.
struct DispatcherThread {
    slot: usize,
    process: Arc<Process>,
    bell: Arc<Bell>,
    config: Arc<RunConfig>,
    connector: Connector,
    /// Each thread's, for a shutdown to cancel what they run.
    watchdogs: Arc<Mutex<HashMap<usize, Watchdog>>>,
}

impl DispatcherThread {
    /// Serves until the process stops, connecting again (after a backoff)
    /// whenever its connection fails. A panic ends the session, not the
    /// thread.
    fn serve(&self) {
        let DispatcherThread { slot, process, bell, .. } = self;
        let mut attempt = 0u32;
        while !process.stopping() {
            let started = Instant::now();
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.session()));
            let why = match served {
                Ok(Ok(())) => continue,
                Ok(Err(why)) => why,
                Err(_) => "a panic (a bug: please report it)".to_string(),
            };
            if process.stopping() {
                break;
            }
            // A session that served a while starts the backoff again.
            if started.elapsed() > RECONNECT_MAX {
                attempt = 0;
            }
            let delay =
                backoff::reconnect_delay(RECONNECT_MIN, RECONNECT_MAX, attempt, backoff::random_unit());
            attempt = attempt.saturating_add(1);
            log::warning(&format!(
                "dispatcher thread {slot}: {why}; connecting again in {:.1}s",
                delay.as_secs_f64()
            ));
            let until = Instant::now() + delay;
            while !process.stopping() && Instant::now() < until {
                bell.pause(until - Instant::now());
            }
        }
    }

    /// One connection's life: takes a dispatcher number, serves under it
    /// until the connection fails (an error) or the process stops (`Ok`).
    fn session(&self) -> Result<(), String> {
        let DispatcherThread { slot, process, bell, config, connector, watchdogs } = self;
        let slot = *slot;
        let mut client = match connect_checked(connector) {
            Ok(client) => client,
            Err(Check::Failed(why)) => return Err(why),
            Err(Check::Refused(why)) => {
                log::error(&why);
                std::process::exit(EXIT_NOT_INSTALLED);
            }
        };
        let row = client
            .query_one(
                "SELECT d.oid, d.datname::text, pg_catalog.pg_backend_pid() \
               FROM pg_catalog.pg_database AS d WHERE d.datname = pg_catalog.current_database()",
                &[],
            )
            .map_err(|e| chain(&e))?;
        let (oid, database, pid): (u32, String, i32) = (row.get(0), row.get(1), row.get(2));
        let holder = format!("thread {slot} of {}", process.name);
        let index = lease::take_number(&mut client, &holder).map_err(|e| e.to_string())?;
        let (settings, invalid) = read_settings(&mut client, &config.own, oid)?;
        let blind = !client
            .query_one("SELECT pg_catalog.pg_has_role('pg_read_all_stats', 'USAGE')", &[])
            .map_err(|e| chain(&e))?
            .get::<_, bool>(0);
        // Shown with the settings refused, for as long as it holds.
        let standing: Vec<String> = blind
            .then(|| {
                "the role is not a member of pg_read_all_stats: the rotation cannot see other roles' \
             transactions and waits while any of their sessions is connected, so that old generations \
             are not truncated (GRANT pg_read_all_stats TO the outbox's owner)"
                    .to_string()
            })
            .into_iter()
            .collect();
        let session = {
            let connector = connector.clone();
            Session::new(client, move |token| connector.cancel(token))
        };
        watchdogs.lock().unwrap_or_else(|e| e.into_inner()).insert(slot, session.watchdog());
        let db = PgDb::new(session.clone());
        let closed = db.closed();
        let host = Sidecar::new(Arc::clone(process), Arc::clone(bell), index, pid, oid, session.clone());
        let mut dispatcher = Dispatcher::new(index as usize, host, db, database, engine::origin(), settings);
        dispatcher.log_start();
        show_invalid(dispatcher.host(), &[invalid, standing.clone()].concat());
        // Shown before the first step, which may drain a backlog first.
        dispatcher.host().publish();
        let mut reload_failed = false;
        loop {
            if process.stopping() {
                dispatcher.host().set_state(State::Stopped);
                dispatcher.host().publish();
                return Ok(());
            }
            if bell.take_reload() {
                let read = session
                    .run(SETTINGS_TIMEOUT, |c| Ok(read_settings(c, &config.own, oid)))
                    .and_then(|read| read);
                let failed_before = std::mem::replace(&mut reload_failed, read.is_err());
                match read {
                    Ok((settings, invalid)) => {
                        dispatcher.reconfigure(settings);
                        show_invalid(dispatcher.host(), &[invalid, standing.clone()].concat());
                    }
                    Err(why) => {
                        if !failed_before {
                            log::warning(&format!(
                                "dispatcher {index}: the settings could not be read ({why}): kept as they \
                                 were, read again at each step until they are"
                            ));
                        }
                        bell.reload_later();
                    }
                }
            }
            let nap = dispatcher.step();
            dispatcher.host().publish();
            dispatcher.host().give_back_idle_turns();
            if closed.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(format!("dispatcher {index}: the connection to the database was lost"));
            }
            // Each poll is a step: the engine asks whether there is anything
            // to claim (read only) before it claims.
            let timed_out = dispatcher.host().sleep(nap.min(config.poll_interval));
            dispatcher.count_wake(timed_out);
        }
    }
}

/// Names the values refused (and what else stands in the way), in the log
/// and in `last_error`.
fn show_invalid(host: &Sidecar, invalid: &[String]) {
    for why in invalid {
        host.warning(why);
    }
    host.refuse_settings(Some(invalid.join("; ")).filter(|why| !why.is_empty()));
}

/// Blocks the signals the main thread takes, in it and every thread it
/// starts.
fn block_signals() -> libc::sigset_t {
    // SAFETY: a signal set built and installed for this thread.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, signal);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn signal_name(signal: i32) -> &'static str {
    if signal == libc::SIGINT {
        "SIGINT"
    } else {
        "SIGTERM"
    }
}

/// The next of `signals` to come within `timeout`.
fn next_signal(signals: &libc::sigset_t, timeout: Duration) -> Option<i32> {
    let timeout =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as _ };
    // SAFETY: a blocked set, a timeout; no siginfo wanted.
    let signal = unsafe { libc::sigtimedwait(signals, std::ptr::null_mut(), &timeout) };
    (signal > 0).then_some(signal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_former_names_of_its_own_settings_are_its_own_too() {
        for (former, new) in guc::RENAMED {
            assert_eq!(is_own(former), is_own(new), "{former}");
        }
        assert!(is_own("outbox.redis_password_file") && is_own("outbox.redis_tls_ca_file"));
        assert!(is_own("outbox.redis_url") && !is_own("outbox.redis_timeout"));
    }
}
