//! The sidecar's connection to PostgreSQL: a libpq connection string or
//! URL, with TLS unless it says `sslmode=disable`.

use std::error::Error;
use std::path::Path;

use postgres::config::SslMode;
use postgres::{Client, Config, NoTls};

/// Connects to `dsn`. TLS certificates must chain to the authorities of
/// `ca_file` (`--tls-ca-file`), or to the system's.
pub fn connect(dsn: &str, ca_file: Option<&Path>) -> Result<Client, String> {
    let config: Config = dsn.parse().map_err(|e| format!("the DSN: {}", chain(&e)))?;
    let connected = if config.get_ssl_mode() == SslMode::Disable {
        config.connect(NoTls)
    } else {
        let tls = outbox_core::tls::client_config("--tls-ca-file", ca_file)?;
        config.connect(tokio_postgres_rustls::MakeRustlsConnect::new((*tls).clone()))
    };
    connected.map_err(|e| chain(&e))
}

/// An error and its causes, each once: "error connecting to server" says
/// nothing without the refusal under it.
pub fn chain(error: &dyn Error) -> String {
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
