//! The broker end: one Redis connection, batches pushed in one pipelined
//! round trip, and a clear line between the broker's fault (the connection)
//! and one event's fault (Redis answered an error for its push).
//!
//! Every call is bounded by `timeout`: a background worker must keep
//! answering SIGTERM, and a blocking read would not.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use redis::{Client, Connection, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, TlsCertificates, Value};

/// Why the broker could not be used. The batch in flight is not the events'
/// fault: it goes back to pending without spending retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkError {
    /// `outbox.redis_url` does not parse, or the TLS settings cannot be used.
    InvalidConfig(String),
    /// Connecting (or authenticating) failed.
    Connect(String),
    /// The broker did not answer within the timeout.
    Timeout,
    /// An established connection broke.
    ConnectionLost(String),
}

impl SinkError {
    /// Every [`SinkError::reason`], in the order of [`SinkError::reason_index`].
    pub const REASONS: [&'static str; 4] = ["invalid_config", "connect_failed", "timeout", "connection_lost"];

    /// A short stable name, for logs and metric labels.
    pub fn reason(&self) -> &'static str {
        Self::REASONS[self.reason_index()]
    }

    pub fn reason_index(&self) -> usize {
        match self {
            SinkError::InvalidConfig(_) => 0,
            SinkError::Connect(_) => 1,
            SinkError::Timeout => 2,
            SinkError::ConnectionLost(_) => 3,
        }
    }

    fn from_redis(err: &redis::RedisError, connected: bool) -> SinkError {
        if err.is_timeout() {
            SinkError::Timeout
        } else if connected {
            SinkError::ConnectionLost(err.to_string())
        } else {
            SinkError::Connect(err.to_string())
        }
    }
}

impl fmt::Display for SinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SinkError::InvalidConfig(e) => write!(f, "{e}"),
            SinkError::Connect(e) => write!(f, "cannot connect to Redis: {e}"),
            SinkError::Timeout => write!(f, "Redis did not answer within outbox.redis_timeout"),
            SinkError::ConnectionLost(e) => write!(f, "lost the Redis connection: {e}"),
        }
    }
}

impl std::error::Error for SinkError {}

/// Where the broker is and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// `redis://` or `rediss://` (TLS).
    pub url: String,
    /// Timeout of every connect, read and write.
    pub timeout: Duration,
    /// PEM file of the certificate authorities trusted for `rediss://`;
    /// `None`: the system's. The server's certificate is verified either way.
    pub tls_ca_file: Option<PathBuf>,
    /// File holding the password, which then stays out of the URL (and so
    /// out of the server log, where PostgreSQL prints a changed setting).
    pub password_file: Option<PathBuf>,
}

/// Messages bound for one Redis list: pushed with a single multi-value LPUSH,
/// in order, so that a BRPOP consumer sees them first to last.
#[derive(Debug, Default)]
pub struct KeyBatch {
    pub key: String,
    pub messages: Vec<String>,
}

pub struct Sink {
    config: BrokerConfig,
    /// The parsed URL, before the files add to it.
    info: ConnectionInfo,
    connection: Option<Connection>,
    display_url: String,
}

impl Sink {
    /// Parses the URL; connects lazily.
    pub fn new(config: &BrokerConfig) -> Result<Sink, SinkError> {
        let display_url = redact_url(&config.url);
        let info =
            config.url.as_str().into_connection_info().map_err(|e| {
                SinkError::InvalidConfig(format!("invalid outbox.redis_url {display_url}: {e}"))
            })?;
        Ok(Sink { config: config.clone(), info, connection: None, display_url })
    }

    /// A client for the next connection. The files are read each time, so
    /// that a rotated password or CA file takes effect at the next connect.
    fn client(&self) -> Result<Client, SinkError> {
        let mut info = self.info.clone();
        if let Some(path) = &self.config.password_file {
            let text = read_setting_file("outbox.redis_password_file", path)?;
            info.redis.password =
                Some(String::from_utf8_lossy(&text).trim_end_matches(['\r', '\n']).to_string());
        }
        let tls = matches!(info.addr, ConnectionAddr::TcpTls { .. });
        match self.config.tls_ca_file.as_ref().filter(|_| tls) {
            Some(path) => {
                let pem = read_setting_file("outbox.redis_tls_ca_file", path)?;
                let certificates = TlsCertificates { client_tls: None, root_cert: Some(pem) };
                Client::build_with_tls(info, certificates).map_err(|e| {
                    SinkError::InvalidConfig(format!(
                        "unusable outbox.redis_tls_ca_file {}: {e}",
                        path.display()
                    ))
                })
            }
            None => Client::open(info).map_err(|e| SinkError::InvalidConfig(e.to_string())),
        }
    }

    /// The broker's address with any credentials masked.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    pub fn is_connected(&self) -> bool {
        self.connection.is_some()
    }

    pub fn disconnect(&mut self) {
        self.connection = None;
    }

    /// Connects if not connected, and proves the connection with a PING.
    pub fn connect(&mut self) -> Result<(), SinkError> {
        if self.connection.is_none() {
            let timeout = self.config.timeout;
            let connection = self
                .client()?
                .get_connection_with_timeout(timeout)
                .map_err(|e| SinkError::from_redis(&e, false))?;
            for set in [Connection::set_read_timeout, Connection::set_write_timeout] {
                set(&connection, Some(timeout)).map_err(|e| SinkError::Connect(e.to_string()))?;
            }
            self.connection = Some(connection);
        }
        self.ping()
    }

    /// One PING round trip; drops the connection when it fails.
    pub fn ping(&mut self) -> Result<(), SinkError> {
        let connection = self.connection.as_mut().ok_or(SinkError::ConnectionLost("not connected".into()))?;
        let result = redis::cmd("PING").query::<String>(connection);
        result.map(drop).map_err(|e| self.fail(&e))
    }

    /// Pushes every batch in one pipelined round trip. The outer error is the
    /// broker's (nothing can be assumed delivered); the inner results are one
    /// per batch, in order: `Err` holds the error Redis answered for that key
    /// (e.g. WRONGTYPE), the fault of those events alone.
    pub fn push(&mut self, batches: &[KeyBatch]) -> Result<Vec<Result<(), String>>, SinkError> {
        let mut pipe = redis::pipe();
        for batch in batches.iter().filter(|b| !b.messages.is_empty()) {
            pipe.cmd("LPUSH").arg(&batch.key).arg(&batch.messages);
        }
        let packed = pipe.get_packed_pipeline();
        let connection = self.connection.as_mut().ok_or(SinkError::ConnectionLost("not connected".into()))?;
        if let Err(e) = connection.send_packed_command(&packed) {
            return Err(self.fail(&e));
        }
        let mut outcomes = Vec::with_capacity(batches.len());
        for batch in batches {
            if batch.messages.is_empty() {
                outcomes.push(Ok(()));
                continue;
            }
            let connection = self.connection.as_mut().expect("connected above");
            match connection.recv_response() {
                Ok(reply @ Value::ServerError(_)) => {
                    let err = reply.extract_error().expect_err("a server error");
                    outcomes.push(Err(err.to_string()));
                }
                Ok(_) => outcomes.push(Ok(())),
                // Errors Redis answers arrive as values above; anything else
                // (I/O, timeout, an unparsable reply) leaves the stream in an
                // unknown state: the connection is done for.
                Err(e) => return Err(self.fail(&e)),
            }
        }
        Ok(outcomes)
    }

    fn fail(&mut self, err: &redis::RedisError) -> SinkError {
        self.connection = None;
        SinkError::from_redis(err, true)
    }
}

fn read_setting_file(setting: &str, path: &Path) -> Result<Vec<u8>, SinkError> {
    std::fs::read(path)
        .map_err(|e| SinkError::InvalidConfig(format!("cannot read {setting} {}: {e}", path.display())))
}

/// `redis://user:secret@host:6379/0` → `redis://***@host:6379/0`: logs,
/// views and errors may show where the broker is, never a credential.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(unparsable URL)".to_string();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{tail}"),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(redact_url("redis://u:pw@h:6379/0"), "redis://***@h:6379/0");
        assert_eq!(redact_url("redis://:pw@h"), "redis://***@h");
        assert_eq!(redact_url("rediss://user:p@ss@h:1/2?x=1"), "rediss://***@h:1/2?x=1");
        assert_eq!(redact_url("redis://h:6379/0"), "redis://h:6379/0");
        assert_eq!(redact_url("garbage"), "(unparsable URL)");
    }

    fn config(url: &str) -> BrokerConfig {
        BrokerConfig {
            url: url.into(),
            timeout: Duration::from_secs(1),
            tls_ca_file: None,
            password_file: None,
        }
    }

    #[test]
    fn a_malformed_url_is_refused_without_echoing_secrets() {
        let err = Sink::new(&config("redis://user:secret@host:notaport/0")).err().expect("refused");
        assert_eq!(err.reason(), "invalid_config");
        assert!(!err.to_string().contains("secret"), "{err}");
    }

    #[test]
    fn an_unreadable_ca_file_is_refused_by_name() {
        let missing = PathBuf::from("/nonexistent/ca.pem");
        let tls = BrokerConfig { tls_ca_file: Some(missing.clone()), ..config("rediss://h:6379/0") };
        let err = Sink::new(&tls).unwrap().connect().unwrap_err();
        assert_eq!(err.reason(), "invalid_config");
        assert!(err.to_string().contains("outbox.redis_tls_ca_file /nonexistent/ca.pem"), "{err}");
        // Plain redis:// ignores the CA file: the refusal comes from port 1.
        let plain = BrokerConfig { tls_ca_file: Some(missing), ..config("redis://127.0.0.1:1/0") };
        assert_eq!(Sink::new(&plain).unwrap().connect().unwrap_err().reason(), "connect_failed");
    }

    #[test]
    fn an_unreadable_password_file_is_refused_by_name() {
        let broker = BrokerConfig { password_file: Some("/nonexistent/pw".into()), ..config("redis://h/0") };
        let err = Sink::new(&broker).unwrap().connect().unwrap_err();
        assert!(err.to_string().contains("cannot read outbox.redis_password_file /nonexistent/pw"), "{err}");
    }

    #[test]
    fn an_unreachable_broker_is_a_connect_error() {
        // Port 1 on loopback: nothing listens there, the refusal is immediate.
        let mut sink = Sink::new(&config("redis://127.0.0.1:1/0")).unwrap();
        let err = sink.connect().unwrap_err();
        assert!(matches!(err, SinkError::Connect(_)), "{err:?}");
        assert!(!sink.is_connected());
        let err = sink.push(&[KeyBatch { key: "q".into(), messages: vec!["m".into()] }]);
        assert!(matches!(err, Err(SinkError::ConnectionLost(_))));
    }
}
