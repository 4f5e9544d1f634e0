//! `outbox.redis_url`, in kombu's vocabulary:
//! `redis://[[user]:password@]host[:port][/db]`, `rediss://` for TLS, and
//! Redis Sentinel as `sentinel://[[user]:password@]host:port[;sentinel://host:port…][/db]`
//! (the credentials, database and `?ssl_cert_reqs=required`, which asks
//! for TLS, are the master's, as in kombu).
//!
//! The password may be percent-encoded, as in kombu. Errors never echo it.

use std::fmt;

/// Where the master is found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoints {
    /// This address.
    Direct(String, u16),
    /// Ask these sentinels, in order, for the master's address.
    Sentinels(Vec<(String, u16)>),
}

/// A parsed broker URL.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    pub tls: bool,
    pub endpoints: Endpoints,
    pub db: u32,
    /// ACL user (Redis 6+); `None` authenticates as `default`.
    pub username: Option<String>,
    pub password: Option<String>,
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokerUrl")
            .field("tls", &self.tls)
            .field("endpoints", &self.endpoints)
            .field("db", &self.db)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

const DEFAULT_PORT: u16 = 6379;
const SENTINEL_PORT: u16 = 26379;

impl BrokerUrl {
    /// Parses `url`; the error says what is wrong without repeating secrets.
    pub fn parse(url: &str) -> Result<BrokerUrl, String> {
        let (scheme, rest) =
            url.split_once("://").ok_or("expected redis://host:port/db, rediss://… or sentinel://…")?;
        let (mut tls, sentinel) = match scheme {
            "redis" => (false, false),
            "rediss" => (true, false),
            "sentinel" => (false, true),
            other => {
                return Err(format!("unsupported scheme \"{other}\" (expected redis, rediss or sentinel)"))
            }
        };
        let (rest, query) = match rest.split_once('?') {
            Some((rest, query)) => (rest, Some(query)),
            None => (rest, None),
        };
        if let Some(query) = query {
            check_query(query)?;
            // kombu's certificate option asks for TLS to a sentinel's master.
            tls |= sentinel;
        }
        // Hosts are separated by ";", each after the first written
        // sentinel://host:port; the database follows the last one.
        let mut authorities: Vec<&str> = Vec::new();
        for (i, part) in rest.split(';').enumerate() {
            match (i, part.strip_prefix("sentinel://")) {
                (0, _) => authorities.push(part),
                (_, Some(part)) if sentinel => authorities.push(part),
                (_, Some(_)) => return Err("several hosts (\";\") are for sentinel:// URLs".into()),
                (_, None) => return Err("each sentinel after \";\" is written sentinel://host:port".into()),
            }
        }
        let last = authorities.len() - 1;
        let path = match authorities[last].split_once('/') {
            Some((authority, path)) => {
                authorities[last] = authority;
                path
            }
            None => "",
        };
        let (credentials, address) = match authorities[0].rsplit_once('@') {
            Some((credentials, address)) => (Some(credentials), address),
            None => (None, authorities[0]),
        };
        let (username, password) = match credentials {
            None => (None, None),
            Some(c) => {
                let (user, password) = match c.split_once(':') {
                    Some((user, password)) => (user, Some(password)),
                    None => (c, None),
                };
                let user = Some(decode(user, "user name")?).filter(|u| !u.is_empty());
                let password = password.map(|p| decode(p, "password")).transpose()?.filter(|p| !p.is_empty());
                (user, password)
            }
        };
        let db = match path.trim_end_matches('/') {
            "" => 0,
            db => db.parse().map_err(|_| format!("the database \"{db}\" is not a number"))?,
        };
        let endpoints = if sentinel {
            let mut sentinels = vec![host_and_port(address, SENTINEL_PORT)?];
            for more in &authorities[1..] {
                // kombu reads credentials from the first URL only.
                let address = more.rsplit_once('@').map_or(*more, |(_, address)| address);
                sentinels.push(host_and_port(address, SENTINEL_PORT)?);
            }
            Endpoints::Sentinels(sentinels)
        } else {
            let (host, port) = host_and_port(address, DEFAULT_PORT)?;
            Endpoints::Direct(host, port)
        };
        Ok(BrokerUrl { tls, endpoints, db, username, password })
    }
}

fn check_query(query: &str) -> Result<(), String> {
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            // kombu's spelling for "verify the server": always done here.
            Some(("ssl_cert_reqs", "required" | "CERT_REQUIRED")) => {}
            Some(("ssl_cert_reqs", other)) => {
                return Err(format!(
                    "ssl_cert_reqs={other} is not supported: the server's certificate is always verified \
                     (outbox.redis_tls_ca_file names the authorities to trust)"
                ))
            }
            _ => {
                let name = pair.split('=').next().unwrap_or(pair);
                return Err(format!("unsupported URL parameter \"{name}\""));
            }
        }
    }
    Ok(())
}

fn host_and_port(address: &str, default_port: u16) -> Result<(String, u16), String> {
    let (host, port) = if let Some(bracketed) = address.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or("unterminated [IPv6 address]")?;
        (host, after.strip_prefix(':'))
    } else {
        match address.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (address, None),
        }
    };
    if host.is_empty() {
        return Err("the host is missing".into());
    }
    let port = match port {
        None | Some("") => default_port,
        Some(p) => {
            p.parse().ok().filter(|p| *p > 0).ok_or_else(|| format!("the port \"{p}\" is not a port"))?
        }
    };
    Ok((host.to_string(), port))
}

/// Percent-decoding; `what` names the part for the error, never its value.
fn decode(text: &str, what: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("the {what} has a bad percent-escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("the {what} is not UTF-8 once decoded"))
}

/// `redis://user:secret@host:6379/0` → `redis://***@host:6379/0`: logs,
/// views and errors may show where the broker is, never a credential.
/// Each `;`-separated sentinel URL is redacted on its own.
pub fn redact(url: &str) -> String {
    url.split(';')
        .map(redact_one)
        .collect::<Option<Vec<_>>>()
        .map_or("(unparsable URL)".into(), |parts| parts.join(";"))
}

fn redact_one(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    Some(match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{tail}"),
        None => url.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kombu_urls_parse() {
        let u = BrokerUrl::parse("redis://127.0.0.1:6380/2").unwrap();
        assert_eq!(
            (u.tls, u.endpoints.clone(), u.db),
            (false, Endpoints::Direct("127.0.0.1".into(), 6380), 2)
        );
        assert_eq!((u.username, u.password), (None, None));

        let u = BrokerUrl::parse("rediss://outbox:p%40ss%3Aw@redis.example:6390/0?ssl_cert_reqs=required")
            .unwrap();
        assert!(u.tls);
        assert_eq!(u.username.as_deref(), Some("outbox"));
        assert_eq!(u.password.as_deref(), Some("p@ss:w"));

        let u = BrokerUrl::parse("redis://:secret@h").unwrap();
        assert_eq!((u.username, u.password.as_deref(), u.db), (None, Some("secret"), 0));
        assert_eq!(u.endpoints, Endpoints::Direct("h".into(), 6379));

        let u = BrokerUrl::parse("redis://[::1]:7000/").unwrap();
        assert_eq!(u.endpoints, Endpoints::Direct("::1".into(), 7000));
    }

    #[test]
    fn sentinel_urls_list_the_sentinels_and_the_masters_options() {
        let u =
            BrokerUrl::parse("sentinel://:pw@h1:26380;sentinel://h2;sentinel://:pw@[::1]:26381/3").unwrap();
        let sentinels = vec![("h1".into(), 26380), ("h2".into(), 26379), ("::1".into(), 26381)];
        assert_eq!(
            (u.endpoints, u.db, u.password.as_deref(), u.tls),
            (Endpoints::Sentinels(sentinels), 3, Some("pw"), false)
        );

        let u = BrokerUrl::parse("sentinel://h1;sentinel://h2:7").unwrap();
        assert_eq!(
            (u.endpoints, u.db),
            (Endpoints::Sentinels(vec![("h1".into(), 26379), ("h2".into(), 7)]), 0)
        );

        let u = BrokerUrl::parse("sentinel://h1:26379/0?ssl_cert_reqs=required").unwrap();
        assert!(u.tls);
        assert_eq!(u.endpoints, Endpoints::Sentinels(vec![("h1".into(), 26379)]));
    }

    #[test]
    fn bad_urls_say_what_is_wrong_without_the_password() {
        for (url, expected) in [
            ("localhost:6379", "expected redis://"),
            ("http://h/0", "unsupported scheme \"http\""),
            ("redis://u:secret@h:notaport/0", "the port \"notaport\" is not a port"),
            ("redis://u:secret@h/zero", "the database \"zero\" is not a number"),
            ("redis://u:secret@/0", "the host is missing"),
            ("redis://u:sec%zzret@h/0", "the password has a bad percent-escape"),
            ("rediss://h/0?ssl_cert_reqs=none", "always verified"),
            ("redis://h/0?socket_timeout=3", "unsupported URL parameter \"socket_timeout\""),
            ("sentinel://h1:1;h2:2/0", "each sentinel after \";\" is written sentinel://host:port"),
            ("redis://u:secret@h1;sentinel://h2/0", "several hosts"),
        ] {
            let err = BrokerUrl::parse(url).unwrap_err();
            assert!(err.contains(expected), "{url}: {err}");
            assert!(!err.contains("secret") && !err.contains("sec%"), "{url}: {err}");
        }
    }

    #[test]
    fn debug_hides_the_password() {
        let u = BrokerUrl::parse("redis://:hunter2@h/0").unwrap();
        assert!(!format!("{u:?}").contains("hunter2"));
    }

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(redact("redis://u:pw@h:6379/0"), "redis://***@h:6379/0");
        assert_eq!(redact("redis://:pw@h"), "redis://***@h");
        assert_eq!(redact("rediss://user:p@ss@h:1/2?x=1"), "rediss://***@h:1/2?x=1");
        assert_eq!(redact("redis://h:6379/0"), "redis://h:6379/0");
        assert_eq!(redact("garbage"), "(unparsable URL)");
        assert_eq!(
            redact("sentinel://:pw@h1:1;sentinel://:pw@h2:2/0"),
            "sentinel://***@h1:1;sentinel://***@h2:2/0"
        );
    }
}
