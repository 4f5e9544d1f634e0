//! The sidecar's connections to PostgreSQL: a libpq connection string or
//! URL, with TLS unless it says `sslmode=disable`.

use std::error::Error;
use std::path::Path;
use std::time::Duration;

use postgres::config::SslMode;
use postgres::{CancelToken, Client, Config, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

/// How to connect to one database, again and again.
#[derive(Clone)]
pub struct Connector {
    config: Config,
    /// `None`: `sslmode=disable`.
    tls: Option<MakeRustlsConnect>,
}

impl Connector {
    /// Parses `dsn`. TLS certificates must chain to the authorities of
    /// `ca_file` (`--tls-ca-file`), or to the system's.
    pub fn new(dsn: &str, ca_file: Option<&Path>) -> Result<Connector, String> {
        let mut config: Config = dsn.parse().map_err(|e| format!("the DSN: {}", chain(&e)))?;
        // A peer gone without a word (a failover, a cut network) is found
        // out within a minute, not the kernel's two hours, unless the DSN
        // says otherwise.
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(Duration::from_secs(30));
        }
        if config.get_keepalives_idle() == Duration::from_secs(2 * 3600) {
            config.keepalives_idle(Duration::from_secs(30));
            config.keepalives_interval(Duration::from_secs(10));
            config.keepalives_retries(3);
        }
        let tls = match config.get_ssl_mode() {
            SslMode::Disable => None,
            _ => {
                let tls = outbox_core::tls::client_config("--tls-ca-file", ca_file)?;
                Some(MakeRustlsConnect::new((*tls).clone()))
            }
        };
        Ok(Connector { config, tls })
    }

    /// A new connection, given up after `timeout` (unless the DSN's
    /// `connect_timeout` is shorter).
    pub fn connect(&self, timeout: Duration) -> Result<Client, String> {
        let mut config = self.config.clone();
        if config.get_connect_timeout().is_none_or(|t| *t > timeout) {
            config.connect_timeout(timeout);
        }
        let connected = match &self.tls {
            None => config.connect(NoTls),
            Some(tls) => config.connect(tls.clone()),
        };
        connected.map_err(|e| chain(&e))
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

/// Connects to `dsn` once.
pub fn connect(dsn: &str, ca_file: Option<&Path>) -> Result<Client, String> {
    Connector::new(dsn, ca_file)?.connect(Duration::from_secs(30))
}

/// An error and its causes, each once: "error connecting to server" says
/// nothing without the refusal under it. What the server raised is its
/// message, with its detail and hint.
pub fn chain(error: &(dyn Error + 'static)) -> String {
    if let Some(db) = error.downcast_ref::<postgres::Error>().and_then(postgres::Error::as_db_error) {
        let mut text = db.message().to_string();
        for more in [db.detail(), db.hint()].into_iter().flatten() {
            text.push_str(": ");
            text.push_str(more);
        }
        return text;
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
    text
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
