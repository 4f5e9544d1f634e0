//! The connection's options, typed: what [`Params`] says, checked, with
//! libpq's defaults for what it leaves out. Options libpq has and the
//! sidecar cannot honour are refused rather than ignored where ignoring
//! them would make the connection less safe than asked (`sslcrl`,
//! `requirepeer`, `require_auth`, `gssencmode=require`).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::conninfo::{DsnError, Params};

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// libpq's `target_session_attrs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionAttrs {
    Any,
    ReadWrite,
    ReadOnly,
    Primary,
    Standby,
    PreferStandby,
}

/// Whose certificates the server's must chain to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Roots {
    /// `sslrootcert=FILE`.
    File(PathBuf),
    /// `sslrootcert=system`, or none given and no `~/.postgresql/root.crt`.
    System,
}

/// Where one host is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// A host name or address, or the directory of a Unix socket.
    pub host: Host,
    /// `hostaddr`: the address to connect to, the host name kept for TLS.
    pub hostaddr: Option<IpAddr>,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    Tcp(String),
    Unix(PathBuf),
}

impl Endpoint {
    /// How the logs and errors name it: `host:port` or the socket's path.
    pub fn name(&self) -> String {
        match &self.host {
            Host::Tcp(name) if name.contains(':') => format!("[{name}]:{}", self.port),
            Host::Tcp(name) => format!("{name}:{}", self.port),
            Host::Unix(dir) => format!("{}/.s.PGSQL.{}", dir.display(), self.port),
        }
    }
}

/// A client certificate and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The TLS versions allowed, as rustls has them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Versions {
    pub tls12: bool,
    pub tls13: bool,
}

#[derive(Clone, PartialEq, Eq)]
pub struct Options {
    pub endpoints: Vec<Endpoint>,
    pub user: String,
    pub dbname: String,
    /// `password` or `PGPASSWORD`; else the password file is read at
    /// each connect.
    pub password: Option<String>,
    /// `passfile`, `PGPASSFILE` or `~/.pgpass`.
    pub passfile: Option<PathBuf>,
    pub sslmode: SslMode,
    pub roots: Roots,
    pub client_cert: Option<ClientCert>,
    pub sni: bool,
    pub versions: Versions,
    /// `sslnegotiation=direct`: TLS at once, without PostgreSQL's request.
    pub direct: bool,
    pub channel_binding: postgres::config::ChannelBinding,
    pub connect_timeout: Option<Duration>,
    pub keepalives: bool,
    pub keepalives_idle: Option<Duration>,
    pub keepalives_interval: Option<Duration>,
    pub keepalives_count: Option<u32>,
    pub tcp_user_timeout: Option<Duration>,
    pub options: Option<String>,
    pub application_name: Option<String>,
    /// `None`: not given (the sidecar, which writes, then asks for a
    /// primary).
    pub target: Option<SessionAttrs>,
    pub load_balance: bool,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("endpoints", &self.endpoints)
            .field("user", &self.user)
            .field("dbname", &self.dbname)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("sslmode", &self.sslmode)
            .field("roots", &self.roots)
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

/// What the process knows of its user: libpq's defaults for `user` and
/// the files under the home directory.
pub struct Account {
    pub name: Option<String>,
    pub home: Option<PathBuf>,
}

/// `sslmode`'s values, by name.
pub const SSLMODES: [(&str, SslMode); 6] = [
    ("disable", SslMode::Disable),
    ("allow", SslMode::Allow),
    ("prefer", SslMode::Prefer),
    ("require", SslMode::Require),
    ("verify-ca", SslMode::VerifyCa),
    ("verify-full", SslMode::VerifyFull),
];

/// `target_session_attrs`'s values, by name.
const SESSION_ATTRS: [(&str, SessionAttrs); 6] = [
    ("any", SessionAttrs::Any),
    ("read-write", SessionAttrs::ReadWrite),
    ("read-only", SessionAttrs::ReadOnly),
    ("primary", SessionAttrs::Primary),
    ("standby", SessionAttrs::Standby),
    ("prefer-standby", SessionAttrs::PreferStandby),
];

/// libpq's default port.
const PORT: u16 = 5432;
/// The directories libpq's builds put the server's socket in: Debian's,
/// then PostgreSQL's own default.
const SOCKET_DIRS: [&str; 2] = ["/var/run/postgresql", "/tmp"];

impl Options {
    pub fn from_params(params: &Params, account: &Account) -> Result<Options, DsnError> {
        let get = |k: &str| params.get(k).filter(|v| !v.is_empty());
        let dot = |file: &str| account.home.as_ref().map(|h| h.join(".postgresql").join(file));
        let sslmode = get("sslmode").map(|v| one_of("sslmode", v, &SSLMODES)).transpose()?;
        let roots = match get("sslrootcert") {
            Some("system") => Roots::System,
            Some(file) => Roots::File(PathBuf::from(file)),
            None => dot("root.crt").filter(|f| f.exists()).map_or(Roots::System, Roots::File),
        };
        // libpq 16: the system's authorities are trusted for a server's
        // name alone.
        let sslmode = match (sslmode, &roots, get("sslrootcert")) {
            (None, _, Some("system")) => SslMode::VerifyFull,
            (Some(mode), _, Some("system")) if mode != SslMode::VerifyFull => {
                return Err(DsnError::Value(
                    "sslmode",
                    "verify-full with sslrootcert=system (as libpq)".into(),
                ));
            }
            (mode, _, _) => mode.unwrap_or(SslMode::Prefer),
        };
        let direct = choice(params, "sslnegotiation", "postgres", &[("postgres", false), ("direct", true)])?;
        if direct && sslmode < SslMode::Require {
            return Err(DsnError::Value(
                "sslnegotiation",
                "direct only with sslmode require, verify-ca or verify-full".into(),
            ));
        }
        let sends_cert = choice(params, "sslcertmode", "allow", &[("allow", true), ("disable", false)])?;
        let client_cert = match (get("sslcert"), get("sslkey")) {
            _ if !sends_cert => None,
            (Some(cert), key) => Some(ClientCert {
                cert: cert.into(),
                key: key.map_or_else(|| Path::new(cert).with_extension("key"), PathBuf::from),
            }),
            (None, key) => dot("postgresql.crt").filter(|c| c.exists()).map(|cert| ClientCert {
                key: key.map(PathBuf::from).or_else(|| dot("postgresql.key")).unwrap_or_default(),
                cert,
            }),
        };
        let version = |k: &'static str, default: &str| {
            choice(params, k, default, &[("TLSv1", 10), ("TLSv1.1", 11), ("TLSv1.2", 12), ("TLSv1.3", 13)])
        };
        let (min, max) = (
            version("ssl_min_protocol_version", "TLSv1.2")?,
            version("ssl_max_protocol_version", "TLSv1.3")?,
        );
        let versions = Versions { tls12: min <= 12 && max >= 12, tls13: max >= 13 };
        if !versions.tls12 && !versions.tls13 {
            return Err(DsnError::Value(
                "ssl_max_protocol_version",
                "TLSv1.2 or TLSv1.3, at least ssl_min_protocol_version".into(),
            ));
        }
        use postgres::config::ChannelBinding;
        let bindings = [
            ("disable", ChannelBinding::Disable),
            ("prefer", ChannelBinding::Prefer),
            ("require", ChannelBinding::Require),
        ];
        let channel_binding = choice(params, "channel_binding", "prefer", &bindings)?;
        refuse_unsupported(params)?;
        let user = get("user").map(str::to_string).or_else(|| account.name.clone()).ok_or(
            DsnError::Value("user", "a role's name: none is given and the process's user has no name".into()),
        )?;
        Ok(Options {
            endpoints: endpoints(params)?,
            dbname: get("dbname").unwrap_or(&user).to_string(),
            user,
            password: params.get("password").map(str::to_string),
            passfile: get("passfile")
                .map(PathBuf::from)
                .or_else(|| account.home.as_ref().map(|h| h.join(".pgpass"))),
            sslmode,
            roots,
            client_cert,
            sni: choice(params, "sslsni", "1", &[("1", true), ("0", false)])?,
            versions,
            direct,
            channel_binding,
            // libpq: 0 or less waits forever, and less than 2 seconds is 2.
            connect_timeout: seconds(params, "connect_timeout")?
                .filter(|s| *s > 0)
                .map(|s| Duration::from_secs(s.max(2) as u64)),
            keepalives: choice(params, "keepalives", "1", &[("1", true), ("0", false)])?,
            keepalives_idle: seconds(params, "keepalives_idle")?
                .filter(|s| *s > 0)
                .map(|s| Duration::from_secs(s as u64)),
            keepalives_interval: seconds(params, "keepalives_interval")?
                .filter(|s| *s > 0)
                .map(|s| Duration::from_secs(s as u64)),
            keepalives_count: seconds(params, "keepalives_count")?.filter(|s| *s > 0).map(|s| s as u32),
            tcp_user_timeout: seconds(params, "tcp_user_timeout")?
                .filter(|s| *s > 0)
                .map(|ms| Duration::from_millis(ms as u64)),
            options: get("options").map(str::to_string),
            application_name: get("application_name")
                .or_else(|| get("fallback_application_name"))
                .map(str::to_string),
            target: get("target_session_attrs")
                .map(|v| one_of("target_session_attrs", v, &SESSION_ATTRS))
                .transpose()?,
            load_balance: choice(
                params,
                "load_balance_hosts",
                "disable",
                &[("disable", false), ("random", true)],
            )?,
        })
    }
}

/// The value of `keyword` among `choices`, or an error listing them.
fn one_of<T: Copy>(keyword: &'static str, value: &str, choices: &[(&str, T)]) -> Result<T, DsnError> {
    choices.iter().find(|(name, _)| *name == value).map(|(_, t)| *t).ok_or_else(|| {
        let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
        DsnError::Value(keyword, format!("one of {}", names.join(", ")))
    })
}

/// The value of `keyword` among `choices`, or `default`'s when it is not
/// given (or empty).
fn choice<T: Copy>(
    params: &Params,
    keyword: &'static str,
    default: &str,
    choices: &[(&str, T)],
) -> Result<T, DsnError> {
    one_of(keyword, params.get(keyword).filter(|v| !v.is_empty()).unwrap_or(default), choices)
}

/// An integer option (seconds, or milliseconds for `tcp_user_timeout`).
fn seconds(params: &Params, keyword: &'static str) -> Result<Option<i64>, DsnError> {
    params
        .get(keyword)
        .filter(|v| !v.is_empty())
        .map(|v| v.trim().parse::<i64>().map_err(|_| DsnError::Value(keyword, "an integer".into())))
        .transpose()
}

/// Refuses what libpq would honour and the sidecar cannot: connecting
/// without it would be less safe than the DSN asks.
fn refuse_unsupported(params: &Params) -> Result<(), DsnError> {
    let given = |k: &str| params.get(k).is_some_and(|v| !v.is_empty());
    for (keyword, why) in [
        ("sslcrl", "nothing: revocation lists are not supported by outbox-dispatch"),
        ("sslcrldir", "nothing: revocation lists are not supported by outbox-dispatch"),
        ("requirepeer", "nothing: not supported by outbox-dispatch"),
        ("require_auth", "nothing: not supported by outbox-dispatch"),
        (
            "sslpassword",
            "nothing: an encrypted key is not supported; decrypt it (openssl pkey) and keep it u=rw (0600)",
        ),
    ] {
        if given(keyword) {
            return Err(DsnError::Value(keyword, why.into()));
        }
    }
    if params.get("replication").is_some_and(|v| !matches!(v, "" | "0" | "off" | "false" | "no")) {
        return Err(DsnError::Value(
            "replication",
            "nothing: outbox-dispatch needs an ordinary session".into(),
        ));
    }
    if params.get("gssencmode") == Some("require") {
        return Err(DsnError::Value("gssencmode", "disable or prefer: outbox-dispatch has no GSSAPI".into()));
    }
    if params.get("sslcertmode") == Some("require") {
        return Err(DsnError::Value("sslcertmode", "allow or disable".into()));
    }
    if let Some(encoding) = params.get("client_encoding").filter(|v| !v.is_empty()) {
        if !matches!(
            encoding.to_ascii_lowercase().replace(['-', '_'], "").as_str(),
            "utf8" | "unicode" | "auto"
        ) {
            return Err(DsnError::Value("client_encoding", "UTF8 (or auto)".into()));
        }
    }
    Ok(())
}

/// `host`, `hostaddr` and `port`, as lists of one or as many each.
fn endpoints(params: &Params) -> Result<Vec<Endpoint>, DsnError> {
    let list =
        |k: &str| params.get(k).map(|v| v.split(',').map(str::trim).map(str::to_string).collect::<Vec<_>>());
    let hosts = list("host").unwrap_or_default();
    let addrs: Vec<Option<IpAddr>> = list("hostaddr")
        .unwrap_or_default()
        .iter()
        .map(|a| match a.as_str() {
            "" => Ok(None),
            a => a
                .parse()
                .map(Some)
                .map_err(|_| DsnError::Value("hostaddr", "IP addresses, separated by commas".into())),
        })
        .collect::<Result<_, _>>()?;
    if !hosts.is_empty() && !addrs.is_empty() && hosts.len() != addrs.len() {
        return Err(DsnError::Value("hostaddr", "as many addresses as host has names".into()));
    }
    let count = hosts.len().max(addrs.len()).max(1);
    let ports: Vec<u16> = list("port")
        .unwrap_or_default()
        .iter()
        .map(|p| match p.as_str() {
            "" => Ok(PORT),
            p => p
                .parse()
                .ok()
                .filter(|p| *p > 0)
                .ok_or(DsnError::Value("port", "port numbers (1 to 65535), separated by commas".into())),
        })
        .collect::<Result<_, _>>()?;
    if ports.len() > 1 && ports.len() != count {
        return Err(DsnError::Value("port", "one port, or as many as there are hosts".into()));
    }
    (0..count)
        .map(|i| {
            let hostaddr = addrs.get(i).copied().flatten();
            let host = match hosts.get(i).map(String::as_str).filter(|h| !h.is_empty()) {
                Some(path) if path.starts_with('/') => Host::Unix(path.into()),
                Some(name) => Host::Tcp(name.to_string()),
                None => match hostaddr {
                    Some(addr) => Host::Tcp(addr.to_string()),
                    None => Host::Unix(
                        SOCKET_DIRS
                            .iter()
                            .map(PathBuf::from)
                            .find(|d| d.is_dir())
                            .unwrap_or_else(|| SOCKET_DIRS[1].into()),
                    ),
                },
            };
            Ok(Endpoint { host, hostaddr, port: ports.get(i).or(ports.first()).copied().unwrap_or(PORT) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(dsn: &str) -> Result<Options, DsnError> {
        let account = Account { name: Some("me".into()), home: Some("/nonexistent-home".into()) };
        Options::from_params(&Params::parse(dsn)?, &account)
    }

    #[test]
    fn libpq_s_defaults_stand_for_what_is_not_given() {
        let o = options("host=db").unwrap();
        assert_eq!(o.user, "me");
        assert_eq!(o.dbname, "me");
        assert_eq!(o.sslmode, SslMode::Prefer);
        assert_eq!(o.roots, Roots::System);
        assert_eq!(o.endpoints, vec![Endpoint { host: Host::Tcp("db".into()), hostaddr: None, port: 5432 }]);
        assert_eq!(o.passfile, Some("/nonexistent-home/.pgpass".into()));
        assert_eq!(o.target, None);
        assert_eq!(o.client_cert, None);
        assert!(o.sni && o.versions.tls12 && o.versions.tls13);
    }

    #[test]
    fn each_sslmode_and_its_root_certificates() {
        for (mode, expected) in [
            ("disable", SslMode::Disable),
            ("allow", SslMode::Allow),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
            ("verify-ca", SslMode::VerifyCa),
            ("verify-full", SslMode::VerifyFull),
        ] {
            assert_eq!(options(&format!("host=db sslmode={mode}")).unwrap().sslmode, expected);
        }
        let o = options("host=db sslmode=verify-ca sslrootcert=/ca.pem").unwrap();
        assert_eq!(o.roots, Roots::File("/ca.pem".into()));
        // sslrootcert=system means verify-full, and refuses anything weaker.
        assert_eq!(options("host=db sslrootcert=system").unwrap().sslmode, SslMode::VerifyFull);
        assert!(options("host=db sslrootcert=system sslmode=require").is_err());
        let e = options("host=db sslmode=verify_full").unwrap_err().to_string();
        assert!(e.contains("verify-full") && !e.contains("verify_full"), "{e}");
    }

    #[test]
    fn several_hosts_take_one_port_or_one_each() {
        let o = options("host=a,/run/pg,b port=1,2,3 hostaddr=10.0.0.1,,10.0.0.3").unwrap();
        assert_eq!(
            o.endpoints,
            vec![
                Endpoint {
                    host: Host::Tcp("a".into()),
                    hostaddr: Some("10.0.0.1".parse().unwrap()),
                    port: 1
                },
                Endpoint { host: Host::Unix("/run/pg".into()), hostaddr: None, port: 2 },
                Endpoint {
                    host: Host::Tcp("b".into()),
                    hostaddr: Some("10.0.0.3".parse().unwrap()),
                    port: 3
                },
            ]
        );
        assert!(options("host=a,b port=1,2,3").is_err());
        assert!(options("host=a,b hostaddr=10.0.0.1").is_err());
        assert_eq!(options("host=a,b port=7").unwrap().endpoints[1].port, 7);
        assert_eq!(options("hostaddr=10.0.0.9").unwrap().endpoints[0].host, Host::Tcp("10.0.0.9".into()));
    }

    #[test]
    fn a_client_certificate_and_its_key() {
        let o = options("host=db sslcert=/c/client.crt").unwrap();
        assert_eq!(
            o.client_cert,
            Some(ClientCert { cert: "/c/client.crt".into(), key: "/c/client.key".into() })
        );
        let o = options("host=db sslcert=/c/client.crt sslkey=/k/key.pem").unwrap();
        assert_eq!(o.client_cert.unwrap().key, PathBuf::from("/k/key.pem"));
        assert_eq!(options("host=db sslcert=/c/client.crt sslcertmode=disable").unwrap().client_cert, None);
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_not_ignored() {
        for dsn in [
            "host=db sslcrl=/crl.pem",
            "host=db requirepeer=postgres",
            "host=db sslpassword=x",
            "host=db gssencmode=require",
            "host=db replication=database",
            "host=db client_encoding=LATIN1",
            "host=db sslnegotiation=direct",
            "host=db ssl_max_protocol_version=TLSv1.1",
            "host=db target_session_attrs=master",
            "host=db connect_timeout=soon",
        ] {
            assert!(options(dsn).is_err(), "{dsn}");
        }
        assert!(options("host=db sslnegotiation=direct sslmode=require").unwrap().direct);
        assert_eq!(
            options("host=db connect_timeout=1").unwrap().connect_timeout,
            Some(Duration::from_secs(2))
        );
        assert_eq!(options("host=db connect_timeout=0").unwrap().connect_timeout, None);
        assert_eq!(
            options("host=db target_session_attrs=read-write").unwrap().target,
            Some(SessionAttrs::ReadWrite)
        );
        let v = options("host=db ssl_min_protocol_version=TLSv1.3").unwrap().versions;
        assert!(!v.tls12 && v.tls13);
    }
}
