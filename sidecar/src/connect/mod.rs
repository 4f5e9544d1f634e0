//! The sidecar's connections to PostgreSQL, made as libpq makes them, or
//! more safely: libpq's connection strings and URIs
//! ([`conninfo`]), services and `PG*` variables, its password file
//! ([`pgpass`]), `sslmode` from `disable` to `verify-full` with
//! `sslrootcert`, `sslcert` and `sslkey` ([`tls`]), several hosts and
//! `target_session_attrs`; over the `postgres` crate, whose client the
//! rest of the sidecar uses (docs/design/departures.md says why not
//! libpq itself).
//!
//! More safely than libpq, in three ways:
//! - Under `sslmode=prefer`, a server that refuses TLS gets no password:
//!   the connection is made again without one, and a server that then
//!   asks for one is refused, saying what to set. Only `disable` and
//!   `allow` send a password without TLS (a Unix socket uses none, as
//!   libpq's).
//! - Whenever TLS is used, the server's certificate is verified: its
//!   chain to `sslrootcert` (or the system's authorities), and its name
//!   but under `verify-ca`. A certificate that fails is never a reason
//!   to go on without TLS.
//! - Each attempt ends within its deadline, whatever the server does.

mod conninfo;
mod options;
mod pgpass;
mod tls;

use std::error::Error;
use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use postgres::config::SslMode as WireSsl;
use postgres::tls::{MakeTlsConnect, TlsConnect};
use postgres::{CancelToken, Client, Config, NoTls, Socket};
use tokio_postgres_rustls::MakeRustlsConnect;

use conninfo::Params;
use options::{Account, Endpoint, Host, Options, SessionAttrs, SslMode};
use pgpass::Lookup;

/// How to connect to one database, again and again.
#[derive(Clone)]
pub struct Connector {
    options: Arc<Options>,
    /// `None`: no TLS is ever used (`sslmode=disable`, or Unix sockets
    /// alone).
    tls: Option<MakeRustlsConnect>,
}

/// How one attempt goes over the wire.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Transport {
    Tls,
    Plain,
}

/// Why one attempt failed.
enum Failure {
    /// The server would not begin TLS (it answered `N`, or closed).
    NoTls(String),
    /// The server refused the session (an error it sent).
    Server(String),
    /// Anything else: the socket, the handshake, a deadline.
    Other(String),
}

impl Failure {
    fn text(self) -> String {
        match self {
            Failure::NoTls(t) | Failure::Server(t) | Failure::Other(t) => t,
        }
    }
}

impl Connector {
    /// Parses `dsn`, with what the environment adds to it as libpq's
    /// would. `ca_file` (`--tls-ca-file`) stands for `sslrootcert` where
    /// the DSN and its service name none, before `PGSSLROOTCERT`.
    pub fn new(dsn: &str, ca_file: Option<&Path>) -> Result<Connector, String> {
        Connector::with_environment(dsn, ca_file, &|name| std::env::var(name).ok(), &account())
    }

    fn with_environment(
        dsn: &str,
        ca_file: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
        account: &Account,
    ) -> Result<Connector, String> {
        let mut params = Params::parse(dsn).map_err(|e| e.to_string())?;
        params.add_service(env, account.home.as_deref()).map_err(|e| e.to_string())?;
        let ca_file = ca_file.filter(|f| !f.as_os_str().is_empty());
        let roots_named = match (params.get("sslrootcert"), ca_file) {
            (Some(given), Some(ca)) if Path::new(given) != ca => {
                crate::log::warning(
                    "both the DSN (sslrootcert) and --tls-ca-file (OUTBOX_TLS_CA_FILE) name root certificates: \
                     the DSN's are used",
                );
                "sslrootcert"
            }
            (None, Some(ca)) => {
                params.set_default("sslrootcert", &ca.to_string_lossy());
                "--tls-ca-file"
            }
            _ => "sslrootcert",
        };
        params.add_environment(env);
        let options = Options::from_params(&params, account).map_err(|e| e.to_string())?;
        let tcp = options.endpoints.iter().any(|e| matches!(e.host, Host::Tcp(_)));
        let tls = match options.sslmode != SslMode::Disable && tcp {
            true => Some(MakeRustlsConnect::new((*tls::client_config(&options, roots_named)?).clone())),
            false => None,
        };
        Ok(Connector { options: Arc::new(options), tls })
    }

    /// The database it connects to: the DSN's `dbname`, its service's or
    /// `PGDATABASE`, else the user's name, as libpq resolves it.
    pub fn database(&self) -> &str {
        &self.options.dbname
    }

    /// A new connection to the first host that answers as
    /// `target_session_attrs` asks (a primary unless it says otherwise:
    /// the sidecar writes), each attempt given up after `timeout` (or the
    /// DSN's `connect_timeout`, when shorter).
    pub fn connect(&self, timeout: Duration) -> Result<Client, String> {
        let mut order: Vec<&Endpoint> = self.options.endpoints.iter().collect();
        if self.options.load_balance {
            for i in (1..order.len()).rev() {
                let j = (outbox_core::backoff::random_unit() * (i + 1) as f64) as usize;
                order.swap(i, j.min(i));
            }
        }
        let passes: &[SessionAttrs] = match self.options.target.unwrap_or(SessionAttrs::Primary) {
            SessionAttrs::PreferStandby => &[SessionAttrs::Standby, SessionAttrs::Any],
            SessionAttrs::Any => &[SessionAttrs::Any],
            SessionAttrs::ReadWrite => &[SessionAttrs::ReadWrite],
            SessionAttrs::ReadOnly => &[SessionAttrs::ReadOnly],
            SessionAttrs::Primary => &[SessionAttrs::Primary],
            SessionAttrs::Standby => &[SessionAttrs::Standby],
        };
        let mut failures = Vec::new();
        for &wanted in passes {
            for endpoint in &order {
                let fits = self.attempt(endpoint, timeout).and_then(|mut client| {
                    session_fits(&mut client, wanted).map(|fits| fits.then_some(client))
                });
                match fits {
                    Ok(Some(client)) => return Ok(client),
                    Ok(None) => failures.push(format!(
                        "{}: not a {} (target_session_attrs)",
                        endpoint.name(),
                        describe(wanted)
                    )),
                    Err(why) => failures.push(format!("{}: {why}", endpoint.name())),
                }
            }
        }
        Err(failures.join("; "))
    }

    /// One host, over TLS or not as `sslmode` says.
    fn attempt(&self, endpoint: &Endpoint, timeout: Duration) -> Result<Client, String> {
        let password = self.password(endpoint);
        let mode = match endpoint.host {
            // As libpq: no TLS over a Unix socket, which the kernel keeps.
            Host::Unix(_) => SslMode::Disable,
            Host::Tcp(_) => self.options.sslmode,
        };
        let once = |transport, password: Option<&str>| self.once(endpoint, transport, password, timeout);
        match mode {
            SslMode::Disable => once(Transport::Plain, password.as_deref()).map_err(Failure::text),
            SslMode::Allow => match once(Transport::Plain, password.as_deref()) {
                Err(Failure::Server(_)) => once(Transport::Tls, password.as_deref()).map_err(Failure::text),
                other => other.map_err(Failure::text),
            },
            SslMode::Prefer => match once(Transport::Tls, password.as_deref()) {
                // Again without TLS, and without the password.
                Err(Failure::NoTls(_)) => once(Transport::Plain, None).map_err(|failure| match failure {
                    Failure::Other(why) if password.is_some() && why.contains("password missing") => {
                        "the server refused TLS and asks for a password, which is never sent without TLS under \
                         sslmode=prefer: turn ssl on in the server, or say sslmode=disable (or allow) in the DSN \
                         to send it in clear"
                            .to_string()
                    }
                    other => other.text(),
                }),
                other => other.map_err(Failure::text),
            },
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                once(Transport::Tls, password.as_deref()).map_err(|failure| match failure {
                    Failure::NoTls(why) => format!("{why}: sslmode={} asks for TLS", sslmode_name(mode)),
                    other => other.text(),
                })
            }
        }
    }

    /// The password: the DSN's or `PGPASSWORD`, else the password file's
    /// line for this host (read again at each connect).
    fn password(&self, endpoint: &Endpoint) -> Option<String> {
        let options = &self.options;
        if options.password.is_some() {
            return options.password.clone();
        }
        match pgpass::lookup(options.passfile.as_deref()?, endpoint, &options.dbname, &options.user) {
            Lookup::Found(password) => Some(password),
            Lookup::Nothing => None,
            Lookup::Ignored(why) => {
                crate::log::warning(&why);
                None
            }
        }
    }

    /// One connection attempt, ended by `timeout` whatever the server
    /// does (a server that accepts and never answers holds a thread of
    /// its own until it closes, never the caller).
    fn once(
        &self,
        endpoint: &Endpoint,
        transport: Transport,
        password: Option<&str>,
        timeout: Duration,
    ) -> Result<Client, Failure> {
        // libpq's connect_timeout is the whole attempt's, as here.
        let timeout = self.options.connect_timeout.map_or(timeout, |t| t.min(timeout));
        let config = self.config(endpoint, transport, password, timeout);
        let (sent, received) = mpsc::channel();
        let watched = Watched::new(self.tls.clone());
        let (made, began) = (Arc::clone(&watched.made), Arc::clone(&watched.began));
        let spawned = std::thread::Builder::new().name("connect".into()).spawn(move || {
            let connected = match (transport, watched.inner.is_some()) {
                (Transport::Tls, true) => config.connect(watched),
                _ => config.connect(NoTls),
            };
            let _ = sent.send(connected);
        });
        if let Err(e) = spawned {
            return Err(Failure::Other(format!("a thread to connect: {e}")));
        }
        match received.recv_timeout(timeout) {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(e)) if e.as_db_error().is_some() => Err(Failure::Server(chain(&e))),
            Ok(Err(e))
                if transport == Transport::Tls
                    && made.load(Ordering::SeqCst)
                    && !began.load(Ordering::SeqCst) =>
            {
                Err(Failure::NoTls(chain(&e)))
            }
            Ok(Err(e)) => Err(Failure::Other(chain(&e))),
            Err(_) => Err(Failure::Other(format!("no session within {}s", timeout.as_secs_f64()))),
        }
    }

    /// The `postgres` crate's configuration of one attempt.
    fn config(
        &self,
        endpoint: &Endpoint,
        transport: Transport,
        password: Option<&str>,
        timeout: Duration,
    ) -> Config {
        let o = &self.options;
        let mut config = Config::new();
        match &endpoint.host {
            Host::Tcp(name) => config.host(name),
            Host::Unix(dir) => config.host_path(dir),
        };
        if let Some(addr) = endpoint.hostaddr {
            config.hostaddr(addr);
        }
        config.port(endpoint.port).user(&o.user).dbname(&o.dbname);
        if let Some(password) = password {
            config.password(password);
        }
        if let Some(options) = &o.options {
            config.options(options);
        }
        config.application_name(o.application_name.as_deref().unwrap_or("outbox-dispatch"));
        config.ssl_mode(match transport {
            Transport::Tls => WireSsl::Require,
            Transport::Plain => WireSsl::Disable,
        });
        if o.direct {
            config.ssl_negotiation(postgres::config::SslNegotiation::Direct);
        }
        config.channel_binding(o.channel_binding);
        config.connect_timeout(timeout);
        // A peer gone without a word (a failover, a cut network) is found
        // out within a minute, not the kernel's two hours, unless the DSN
        // says otherwise.
        config.tcp_user_timeout(o.tcp_user_timeout.unwrap_or(Duration::from_secs(30)));
        config.keepalives(o.keepalives);
        config.keepalives_idle(o.keepalives_idle.unwrap_or(Duration::from_secs(30)));
        config.keepalives_interval(o.keepalives_interval.unwrap_or(Duration::from_secs(10)));
        config.keepalives_retries(o.keepalives_count.unwrap_or(3));
        config
    }

    /// Asks the server to cancel what the connection of `token` runs.
    pub fn cancel(&self, token: &CancelToken) {
        // A cancel that fails leaves the statement to its own deadline.
        let _ = match &self.tls {
            None => token.cancel_query(NoTls),
            Some(tls) => token.cancel_query(tls.clone()),
        };
    }
}

/// Whether the session `client` is is one `wanted` accepts: libpq's
/// tests, on `pg_is_in_recovery()` and `default_transaction_read_only`.
fn session_fits(client: &mut Client, wanted: SessionAttrs) -> Result<bool, String> {
    if wanted == SessionAttrs::Any {
        return Ok(true);
    }
    let row = client
        .query_one(
            "SELECT pg_catalog.pg_is_in_recovery(), \
                    pg_catalog.current_setting('default_transaction_read_only') = 'on'",
            &[],
        )
        .map_err(|e| chain(&e))?;
    let (standby, read_only): (bool, bool) =
        (row.try_get(0).map_err(|e| chain(&e))?, row.try_get(1).map_err(|e| chain(&e))?);
    Ok(match wanted {
        SessionAttrs::Any | SessionAttrs::PreferStandby => true,
        SessionAttrs::ReadWrite => !standby && !read_only,
        SessionAttrs::ReadOnly => standby || read_only,
        SessionAttrs::Primary => !standby,
        SessionAttrs::Standby => standby,
    })
}

fn describe(wanted: SessionAttrs) -> &'static str {
    match wanted {
        SessionAttrs::Any | SessionAttrs::PreferStandby => "server",
        SessionAttrs::ReadWrite => "server that accepts writes",
        SessionAttrs::ReadOnly => "read-only server",
        SessionAttrs::Primary => "primary (it is in recovery: a standby)",
        SessionAttrs::Standby => "standby",
    }
}

fn sslmode_name(mode: SslMode) -> &'static str {
    options::SSLMODES.iter().find(|(_, m)| *m == mode).map_or("?", |(name, _)| name)
}

/// The process's user: its name (libpq's default `user`) and home (where
/// `.pgpass`, `.pg_service.conf` and `.postgresql/` are): `HOME`, else
/// the user database's.
fn account() -> Account {
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buffer = vec![0 as libc::c_char; 16 * 1024];
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: a buffer of the given size, an entry and a pointer to it.
    let status = unsafe {
        libc::getpwuid_r(libc::geteuid(), &mut entry, buffer.as_mut_ptr(), buffer.len(), &mut found)
    };
    let field = |p: *const libc::c_char| {
        // SAFETY: a field of the entry found, a C string within `buffer`.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    let (name, home) = match status == 0 && !found.is_null() {
        true => (field(entry.pw_name), field(entry.pw_dir)),
        false => (None, None),
    };
    let home =
        std::env::var_os("HOME").filter(|h| !h.is_empty()).map(PathBuf::from).or(home.map(PathBuf::from));
    Account { name, home }
}

/// The TLS connector of one attempt, which tells whether the socket was
/// made (`made`) and whether the handshake began (`began`): a socket
/// made on which TLS never began is a server that refused it.
struct Watched {
    inner: Option<MakeRustlsConnect>,
    made: Arc<AtomicBool>,
    began: Arc<AtomicBool>,
}

impl Watched {
    fn new(inner: Option<MakeRustlsConnect>) -> Watched {
        Watched { inner, made: Arc::default(), began: Arc::default() }
    }
}

/// One handshake of a [`Watched`].
struct WatchedConnect<T> {
    inner: T,
    began: Arc<AtomicBool>,
}

impl MakeTlsConnect<Socket> for Watched {
    type Stream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;
    type TlsConnect = WatchedConnect<<MakeRustlsConnect as MakeTlsConnect<Socket>>::TlsConnect>;
    type Error = Box<dyn Error + Send + Sync>;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, Self::Error> {
        self.made.store(true, Ordering::SeqCst);
        let inner = self.inner.as_mut().ok_or("no TLS configured")?;
        Ok(WatchedConnect {
            inner: MakeTlsConnect::<Socket>::make_tls_connect(inner, domain)?,
            began: Arc::clone(&self.began),
        })
    }
}

impl<T: TlsConnect<Socket>> TlsConnect<Socket> for WatchedConnect<T> {
    type Stream = T::Stream;
    type Error = T::Error;
    type Future = T::Future;

    fn connect(self, stream: Socket) -> T::Future {
        self.began.store(true, Ordering::SeqCst);
        self.inner.connect(stream)
    }
}

/// Whether `dsn` holds a password (or cannot be parsed well enough to
/// tell).
pub fn holds_password(dsn: &str) -> bool {
    Params::parse(dsn).map_or(true, |params| params.get("password").is_some())
}

/// Connects to `dsn` once.
pub fn connect(dsn: &str, ca_file: Option<&Path>) -> Result<Client, String> {
    Connector::new(dsn, ca_file)?.connect(Duration::from_secs(30))
}

/// An error and its causes, each once: "error connecting to server" says
/// nothing without the refusal under it. What the server raised is its
/// message, with its detail and hint.
///
/// A server's words are its own: control characters in them (a newline
/// that would forge a line of the log, a terminal's escape) are shown
/// escaped.
pub fn chain(error: &(dyn Error + 'static)) -> String {
    if let Some(db) = error.downcast_ref::<postgres::Error>().and_then(postgres::Error::as_db_error) {
        let mut text = db.message().to_string();
        for more in [db.detail(), db.hint()].into_iter().flatten() {
            text.push_str(": ");
            text.push_str(more);
        }
        return crate::log::printable(&text);
    }
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        let line = e.to_string();
        if !text.contains(&line) {
            text.push_str(": ");
            text.push_str(&line);
        }
        cause = e.source();
    }
    crate::log::printable(&text)
}

/// Pins what every statement of the sidecar relies on, whatever the
/// database's and the role's settings say.
pub fn pin_session(client: &mut Client) -> Result<(), String> {
    client
        .batch_execute(
            "SET search_path = pg_catalog, pg_temp; \
             SET synchronous_commit = off; \
             SET lock_timeout = '1s'; \
             SET statement_timeout = 0; \
             SET idle_in_transaction_session_timeout = 0; \
             SET idle_session_timeout = 0; \
             SET exit_on_error = off; \
             SET default_transaction_isolation = 'read committed'; \
             SET default_transaction_read_only = off; \
             SET enable_bitmapscan = off; \
             SET enable_sort = off; \
             SET jit = off; \
             SET DateStyle = 'ISO, YMD'; \
             SET IntervalStyle = postgres; \
             SET TimeZone = 'UTC'; \
             SET application_name = 'outbox-dispatch'; \
             SET outbox.notify = off; \
             SET outbox.dispatching = on; \
             SELECT pg_catalog.set_config('transaction_timeout', '0', false) \
              WHERE pg_catalog.current_setting('server_version_num')::pg_catalog.int4 >= 170000",
        )
        .map_err(|e| chain(&e))
}
