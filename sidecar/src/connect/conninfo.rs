//! libpq's connection parameters as text: a connection string
//! (`host=db user=app sslmode=verify-full`) or URI
//! (`postgresql://app@db/app?sslmode=verify-full`), parsed by libpq's
//! rules; then what it leaves out from a service of `pg_service.conf`,
//! and then from the `PG*` environment variables, in libpq's order.
//!
//! A DSN may hold a password: no error repeats any part of it but a
//! keyword.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// Every keyword of libpq (PostgreSQL 17) and the variable that gives it
/// when neither the DSN nor a service does.
pub const KEYWORDS: [(&str, Option<&str>); 41] = [
    ("host", Some("PGHOST")),
    ("hostaddr", Some("PGHOSTADDR")),
    ("port", Some("PGPORT")),
    ("dbname", Some("PGDATABASE")),
    ("user", Some("PGUSER")),
    ("password", Some("PGPASSWORD")),
    ("passfile", Some("PGPASSFILE")),
    ("channel_binding", Some("PGCHANNELBINDING")),
    ("connect_timeout", Some("PGCONNECT_TIMEOUT")),
    ("client_encoding", Some("PGCLIENTENCODING")),
    ("options", Some("PGOPTIONS")),
    ("application_name", Some("PGAPPNAME")),
    ("fallback_application_name", None),
    ("keepalives", None),
    ("keepalives_idle", None),
    ("keepalives_interval", None),
    ("keepalives_count", None),
    ("tcp_user_timeout", None),
    ("replication", None),
    ("gssencmode", Some("PGGSSENCMODE")),
    ("sslmode", Some("PGSSLMODE")),
    ("sslnegotiation", Some("PGSSLNEGOTIATION")),
    ("sslcompression", Some("PGSSLCOMPRESSION")),
    ("sslcert", Some("PGSSLCERT")),
    ("sslkey", Some("PGSSLKEY")),
    ("sslpassword", None),
    ("sslcertmode", Some("PGSSLCERTMODE")),
    ("sslrootcert", Some("PGSSLROOTCERT")),
    ("sslcrl", Some("PGSSLCRL")),
    ("sslcrldir", Some("PGSSLCRLDIR")),
    ("sslsni", Some("PGSSLSNI")),
    ("requirepeer", Some("PGREQUIREPEER")),
    ("require_auth", Some("PGREQUIREAUTH")),
    ("ssl_min_protocol_version", Some("PGSSLMINPROTOCOLVERSION")),
    ("ssl_max_protocol_version", Some("PGSSLMAXPROTOCOLVERSION")),
    ("krbsrvname", Some("PGKRBSRVNAME")),
    ("gsslib", Some("PGGSSLIB")),
    ("gssdelegation", Some("PGGSSDELEGATION")),
    ("service", Some("PGSERVICE")),
    ("target_session_attrs", Some("PGTARGETSESSIONATTRS")),
    ("load_balance_hosts", Some("PGLOADBALANCEHOSTS")),
];

/// Where the service files are when `PGSYSCONFDIR` does not say: libpq's
/// as Debian builds it.
const SYSCONFDIR: &str = "/etc/postgresql-common";

/// Why a DSN, a service file or a value in them is refused. None holds a
/// value: only keywords, positions, files and lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DsnError {
    /// The `n`th word of a `key=value` string has no `=` after its key.
    MissingEquals(usize),
    /// A quoted value never ends.
    Unterminated,
    /// A keyword libpq does not have (shown when it is one word of lower
    /// case letters, as keywords are).
    UnknownKeyword(Option<String>),
    /// Part of a URI: what is wrong with it.
    Uri(&'static str),
    /// A service file: its path, the line, what is wrong.
    ServiceFile(PathBuf, usize, &'static str),
    /// No service file defines this service.
    ServiceNotFound(String),
    /// A keyword's value is not one it takes: the keyword, and what it
    /// takes.
    Value(&'static str, String),
}

impl fmt::Display for DsnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DsnError::MissingEquals(n) => {
                write!(f, "the DSN: word {n} is not keyword=value (not shown: it may be a password)")
            }
            DsnError::Unterminated => write!(f, "the DSN: a quoted value has no closing quote"),
            DsnError::UnknownKeyword(Some(k)) => write!(f, "the DSN: invalid connection option \"{k}\""),
            DsnError::UnknownKeyword(None) => write!(f, "the DSN: an invalid connection option (not shown)"),
            DsnError::Uri(why) => write!(f, "the DSN (a URI): {why}"),
            DsnError::ServiceFile(path, line, why) => {
                write!(f, "service file {}, line {line}: {why}", path.display())
            }
            DsnError::ServiceNotFound(name) => write!(f, "definition of service \"{name}\" not found"),
            DsnError::Value(keyword, takes) => {
                write!(f, "the DSN: {keyword} takes {takes} (the value given is not shown)")
            }
        }
    }
}

/// The parameters of one connection, by keyword, as text.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Params {
    values: BTreeMap<&'static str, String>,
}

impl fmt::Debug for Params {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown = self.values.iter().map(|(k, v)| (k, if *k == "password" { "***" } else { v.as_str() }));
        f.debug_map().entries(shown).finish()
    }
}

impl Params {
    /// Parses a DSN: a URI when it starts with `postgresql://` or
    /// `postgres://`, a `key=value` string otherwise.
    pub fn parse(dsn: &str) -> Result<Params, DsnError> {
        let mut params = Params::default();
        match ["postgresql://", "postgres://"].iter().find_map(|scheme| dsn.strip_prefix(scheme)) {
            Some(rest) => params.parse_uri(rest)?,
            None => params.parse_pairs(dsn)?,
        }
        Ok(params)
    }

    pub fn get(&self, keyword: &str) -> Option<&str> {
        self.values.get(keyword).map(String::as_str)
    }

    /// Sets `keyword` unless it is set already.
    pub fn set_default(&mut self, keyword: &'static str, value: &str) {
        self.values.entry(keyword).or_insert_with(|| value.to_string());
    }

    fn set(&mut self, keyword: &str, value: String) -> Result<(), DsnError> {
        let keyword = known(keyword)?;
        self.values.insert(keyword, value);
        Ok(())
    }

    /// libpq's `key = value` pairs, separated by white space; a value
    /// single-quoted (with `\'` and `\\`) or not (with `\` escaping the
    /// next character).
    fn parse_pairs(&mut self, text: &str) -> Result<(), DsnError> {
        let mut chars = text.chars().peekable();
        let mut word = 0;
        loop {
            while chars.next_if(|c| c.is_whitespace()).is_some() {}
            if chars.peek().is_none() {
                return Ok(());
            }
            word += 1;
            let mut keyword = String::new();
            while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
                keyword.push(c);
            }
            while chars.next_if(|c| c.is_whitespace()).is_some() {}
            if chars.next() != Some('=') {
                return Err(DsnError::MissingEquals(word));
            }
            while chars.next_if(|c| c.is_whitespace()).is_some() {}
            let mut value = String::new();
            if chars.next_if_eq(&'\'').is_some() {
                loop {
                    match chars.next() {
                        None => return Err(DsnError::Unterminated),
                        Some('\'') => break,
                        Some('\\') => value.push(chars.next().ok_or(DsnError::Unterminated)?),
                        Some(c) => value.push(c),
                    }
                }
            } else {
                while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                    match c {
                        '\\' => value.extend(chars.next()),
                        c => value.push(c),
                    }
                }
            }
            self.set(&keyword, value)?;
        }
    }

    /// `[user[:password]@][host[:port][,...]][/dbname][?key=value&...]`,
    /// each part percent-decoded; `?ssl=true` is `sslmode=require`, as
    /// libpq takes it.
    fn parse_uri(&mut self, text: &str) -> Result<(), DsnError> {
        let (mut rest, query) = match text.split_once('?') {
            Some((before, query)) => (before, Some(query)),
            None => (text, None),
        };
        // libpq looks for the user's part up to the first '/'.
        let authority_end = rest.find('/').unwrap_or(rest.len());
        if let Some(at) = rest[..authority_end].rfind('@') {
            let (user, password) = match rest[..at].split_once(':') {
                Some((user, password)) => (user, Some(password)),
                None => (&rest[..at], None),
            };
            if !user.is_empty() {
                self.set("user", decode(user, "the user name")?)?;
            }
            if let Some(password) = password {
                self.set("password", decode(password, "the password")?)?;
            }
            rest = &rest[at + 1..];
        }
        let (hosts, dbname) = match rest.split_once('/') {
            Some((hosts, dbname)) => (hosts, Some(dbname)),
            None => (rest, None),
        };
        let (mut names, mut ports) = (Vec::new(), Vec::new());
        if !hosts.is_empty() {
            for spec in hosts.split(',') {
                let (name, port) = host_and_port(spec)?;
                names.push(decode(name, "a host")?);
                ports.push(decode(port, "a port")?);
            }
        }
        if names.iter().any(|n| !n.is_empty()) {
            self.set("host", names.join(","))?;
        }
        if ports.iter().any(|p| !p.is_empty()) {
            self.set("port", ports.join(","))?;
        }
        if let Some(dbname) = dbname.filter(|d| !d.is_empty()) {
            self.set("dbname", decode(dbname, "the database name")?)?;
        }
        for pair in query.into_iter().flat_map(|q| q.split('&')).filter(|p| !p.is_empty()) {
            let Some((keyword, value)) = pair.split_once('=') else {
                return Err(DsnError::Uri("a query parameter without \"=\""));
            };
            let (keyword, value) =
                (decode(keyword, "a query parameter")?, decode(value, "a query parameter")?);
            match (keyword.as_str(), value.as_str()) {
                ("ssl", "true") => self.set("sslmode", "require".into())?,
                _ => self.set(&keyword, value)?,
            }
        }
        Ok(())
    }

    /// What the DSN leaves out, from the service it or `PGSERVICE` names:
    /// the section of that name in `PGSERVICEFILE` (or
    /// `~/.pg_service.conf`), else in `PGSYSCONFDIR/pg_service.conf`.
    pub fn add_service(
        &mut self,
        env: &dyn Fn(&str) -> Option<String>,
        home: Option<&Path>,
    ) -> Result<(), DsnError> {
        let Some(name) = self.get("service").map(str::to_string).or_else(|| env("PGSERVICE")) else {
            return Ok(());
        };
        let user_file =
            env("PGSERVICEFILE").map(PathBuf::from).or_else(|| home.map(|h| h.join(".pg_service.conf")));
        let system_file =
            Path::new(&env("PGSYSCONFDIR").unwrap_or_else(|| SYSCONFDIR.into())).join("pg_service.conf");
        for path in user_file.iter().chain([&system_file]) {
            let Ok(text) = std::fs::read_to_string(path) else { continue };
            if let Some(pairs) =
                service(&text, &name).map_err(|(line, why)| DsnError::ServiceFile(path.clone(), line, why))?
            {
                for (line, keyword, value) in pairs {
                    let keyword = known(&keyword).map_err(|_| {
                        DsnError::ServiceFile(path.clone(), line, "an invalid connection option")
                    })?;
                    self.set_default(keyword, &value);
                }
                return Ok(());
            }
        }
        Err(DsnError::ServiceNotFound(name))
    }

    /// What is left out still, from the `PG*` variables.
    pub fn add_environment(&mut self, env: &dyn Fn(&str) -> Option<String>) {
        for (keyword, variable) in KEYWORDS {
            if let Some(value) = variable.and_then(env) {
                self.set_default(keyword, &value);
            }
        }
    }
}

/// `keyword` as libpq spells it, or why not.
fn known(keyword: &str) -> Result<&'static str, DsnError> {
    KEYWORDS.iter().map(|(k, _)| *k).find(|k| *k == keyword).ok_or_else(|| {
        let plain = !keyword.is_empty()
            && keyword.len() <= 32
            && keyword.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
        DsnError::UnknownKeyword(plain.then(|| keyword.to_string()))
    })
}

/// `host:port`, `[v6]:port`, `host`, `:port` or nothing.
fn host_and_port(spec: &str) -> Result<(&str, &str), DsnError> {
    if let Some(bracketed) = spec.strip_prefix('[') {
        let (address, after) =
            bracketed.split_once(']').ok_or(DsnError::Uri("an IPv6 address without \"]\""))?;
        return match after {
            "" => Ok((address, "")),
            _ => after
                .strip_prefix(':')
                .map(|port| (address, port))
                .ok_or(DsnError::Uri("something after an IPv6 address's \"]\"")),
        };
    }
    Ok(spec.split_once(':').unwrap_or((spec, "")))
}

/// Percent-decoding as libpq does it: `%00` and bad escapes refused.
fn decode(text: &str, what: &'static str) -> Result<String, DsnError> {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
            let byte = hex.and_then(|h| u8::from_str_radix(h, 16).ok()).filter(|b| *b != 0);
            decoded.push(byte.ok_or(DsnError::Uri(match what {
                "the password" => "the password has a bad percent-escape",
                _ => "a bad percent-escape (%00, or not two hex digits)",
            }))?);
            i += 3;
        } else {
            decoded.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(decoded).map_err(|_| DsnError::Uri("not UTF-8 once percent-decoded"))
}

/// A service's keywords and values, with their line numbers.
type Pairs = Vec<(usize, String, String)>;

/// The pairs of the section `[name]` of a service file; `None` when it
/// has no such section.
fn service(text: &str, name: &str) -> Result<Option<Pairs>, (usize, &'static str)> {
    let mut found: Option<Pairs> = None;
    let mut inside = false;
    for (number, line) in text.lines().enumerate().map(|(i, l)| (i + 1, l.trim())) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(section) = line.strip_prefix('[') {
            if found.is_some() {
                break;
            }
            inside = section.strip_suffix(']').ok_or((number, "a section name without \"]\""))? == name;
            if inside {
                found = Some(Vec::new());
            }
            continue;
        }
        if !inside {
            continue;
        }
        let (keyword, value) = line.split_once('=').ok_or((number, "syntax error: no \"=\""))?;
        if keyword == "service" {
            return Err((number, "nested service specifications not supported"));
        }
        found.get_or_insert_with(Vec::new).push((number, keyword.to_string(), value.to_string()));
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(dsn: &str) -> Vec<(&'static str, String)> {
        Params::parse(dsn).unwrap().values.into_iter().collect()
    }

    fn pairs(list: &[(&'static str, &str)]) -> Vec<(&'static str, String)> {
        let mut v: Vec<_> = list.iter().map(|(k, v)| (*k, v.to_string())).collect();
        v.sort();
        v
    }

    #[test]
    fn key_value_strings_parse_as_libpq_parses_them() {
        assert_eq!(
            parsed("host=db port = 5433  dbname='my db' password='it\\'s \\\\ x' user=a\\ b sslmode="),
            pairs(&[
                ("host", "db"),
                ("port", "5433"),
                ("dbname", "my db"),
                ("password", "it's \\ x"),
                ("user", "a b"),
                ("sslmode", ""),
            ])
        );
        // An unquoted empty value takes the next word, as libpq's does.
        assert_eq!(parsed("user= host=db"), pairs(&[("user", "host=db")]));
        assert_eq!(parsed("  "), vec![]);
    }

    #[test]
    fn uris_parse_as_libpq_parses_them() {
        assert_eq!(
            parsed("postgresql://us%40r:p%3Ass@h1:5433,[::1]:5434,h3/my%20db?sslmode=verify-full&application_name=x"),
            pairs(&[
                ("user", "us@r"),
                ("password", "p:ss"),
                ("host", "h1,::1,h3"),
                ("port", "5433,5434,"),
                ("dbname", "my db"),
                ("sslmode", "verify-full"),
                ("application_name", "x"),
            ])
        );
        assert_eq!(
            parsed("postgres://%2Fvar%2Frun%2Fpostgresql/db?ssl=true"),
            pairs(&[("host", "/var/run/postgresql"), ("dbname", "db"), ("sslmode", "require")])
        );
        assert_eq!(parsed("postgresql://"), vec![]);
        assert_eq!(parsed("postgresql:///db?host=/tmp"), pairs(&[("dbname", "db"), ("host", "/tmp")]));
        assert_eq!(parsed("postgresql://u@:5433"), pairs(&[("user", "u"), ("port", "5433")]));
    }

    #[test]
    fn errors_never_show_a_value() {
        let secret = "S3CRET";
        for dsn in [
            format!("host=db {secret}"),
            format!("host=db password='{secret}"),
            format!("{secret}=x"),
            format!("pasword={secret}"),
            format!("postgresql://u:{secret}%zz@h/db"),
            format!("postgresql://u:{secret}@h/db?{secret}"),
            format!("postgresql://u:{secret}@[::1/db"),
            format!("postgresql://u:{secret}@h/db?sslmode=%00"),
        ] {
            let e = Params::parse(&dsn).unwrap_err().to_string();
            assert!(!e.contains(secret), "{dsn}: {e}");
        }
        assert_eq!(Params::parse("host=db x y").unwrap_err(), DsnError::MissingEquals(2));
        assert_eq!(
            Params::parse("pasword=x").unwrap_err().to_string(),
            "the DSN: invalid connection option \"pasword\""
        );
    }

    #[test]
    fn a_service_fills_what_the_dsn_leaves_and_the_environment_what_is_left() {
        let dir = std::env::temp_dir().join(format!("outbox-service-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("services.conf");
        std::fs::write(&file, "# comment\n[other]\nhost=wrong\n\n[app]\nhost=svc-host\nport=6000\ndbname=svc\n[last]\nuser=no\n").unwrap();
        let env = |name: &str| match name {
            "PGSERVICEFILE" => Some(file.display().to_string()),
            "PGPORT" => Some("7000".to_string()),
            "PGUSER" => Some("env-user".to_string()),
            "PGSYSCONFDIR" => Some("/nonexistent".to_string()),
            _ => None,
        };
        let mut params = Params::parse("service=app dbname=dsn").unwrap();
        params.add_service(&env, None).unwrap();
        params.add_environment(&env);
        assert_eq!(params.get("host"), Some("svc-host"));
        assert_eq!(params.get("port"), Some("6000"));
        assert_eq!(params.get("dbname"), Some("dsn"));
        assert_eq!(params.get("user"), Some("env-user"));
        let mut missing = Params::parse("service=nope").unwrap();
        assert_eq!(missing.add_service(&env, None), Err(DsnError::ServiceNotFound("nope".into())));
        std::fs::write(&file, "[app]\nservice=x\n").unwrap();
        let e = Params::parse("service=app").unwrap().add_service(&env, None).unwrap_err();
        assert!(e.to_string().contains("line 2: nested service"), "{e}");
        // PGSERVICE names it when the DSN does not.
        std::fs::write(&file, "[app]\nhost=h\n").unwrap();
        let env_service = |name: &str| if name == "PGSERVICE" { Some("app".to_string()) } else { env(name) };
        let mut params = Params::parse("").unwrap();
        params.add_service(&env_service, None).unwrap();
        assert_eq!(params.get("host"), Some("h"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
