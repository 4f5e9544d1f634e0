//! `outbox.broker_url`, in kombu's vocabulary:
//! `redis://[[user]:password@]host[:port][/db]`, `rediss://` for TLS, and
//! Redis Sentinel as `sentinel://[[user]:password@]host:port[;sentinel://host:port…][/db]`
//! (the credentials, database and `?ssl_cert_reqs=required`, which asks
//! for TLS, are the master's, as in kombu); RabbitMQ as
//! `amqp://[user:password@]host[:port][/vhost]` (`amqps://` for TLS,
//! `pyamqp://` as kombu also spells it), several nodes of a cluster as
//! `amqp://h1;amqp://h2`, tried in that order (the credentials and vhost
//! are the first URL's); Kafka as `kafka://[user:password@]h1:9092,h2:9092`
//! (`kafkas://` for TLS), the bootstrap servers as Kafka's clients list
//! them (or as `kafka://h1;kafka://h2`).
//!
//! Parsed with a real URL parser (`url`); the password may be
//! percent-encoded, as in kombu, and must be where it holds `/`, `?`, `#`,
//! `@`, `:` or `%`. Errors and the redacted form never echo any part of
//! the text.

use std::fmt;

use percent_encoding::percent_decode_str;
use url::{Host, Url};

/// Where the master is found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoints {
    /// This address.
    Direct(String, u16),
    /// Ask these sentinels, in order, for the master's address.
    Sentinels(Vec<(String, u16)>),
    /// RabbitMQ nodes, tried in order at each connect.
    Amqp(Vec<(String, u16)>),
    /// Kafka's bootstrap servers, asked in order for the cluster's
    /// metadata.
    Kafka(Vec<(String, u16)>),
}

/// A parsed broker URL.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    pub tls: bool,
    pub endpoints: Endpoints,
    /// Redis's database; 0 for AMQP.
    pub db: u32,
    /// AMQP's virtual host (kombu's `virtual_host`): the path without its
    /// first `/`, decoded; `/` when empty. Empty for Redis.
    pub vhost: String,
    /// ACL user (Redis 6+); `None` authenticates as `default` (Redis) or
    /// `guest` (AMQP, as kombu does).
    pub username: Option<String>,
    pub password: Option<String>,
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokerUrl")
            .field("tls", &self.tls)
            .field("endpoints", &self.endpoints)
            .field("db", &self.db)
            .field("vhost", &self.vhost)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

const DEFAULT_PORT: u16 = 6379;
const SENTINEL_PORT: u16 = 26379;
const AMQP_PORT: u16 = 5672;
const AMQPS_PORT: u16 = 5671;
const KAFKA_PORT: u16 = 9092;

/// How to write a character a password must not hold as it is.
const ENCODE_HINT: &str =
    "percent-encode /, ?, #, @, :, ; and % in a user name or password (%2F, %3F, %23, %40, %3A, %3B, %25)";

impl BrokerUrl {
    /// Parses `text` with a URL parser (`url`), each `;`-separated URL on
    /// its own. The error says what is wrong and never repeats any part of
    /// the text: a password holding `/`, `?` or `#` unencoded ends the
    /// authority early, and any part may then be a piece of it.
    pub fn parse(text: &str) -> Result<BrokerUrl, String> {
        let text = kafka_hosts(text);
        let mut parts = text.split(';');
        let first = Url::parse(parts.next().unwrap_or_default()).map_err(|e| {
            format!(
                "not a URL ({e}); expected redis://host:port/db, rediss://…, sentinel://…, \
                 amqp://host:port/vhost or kafka://host:port,host:port; {ENCODE_HINT}"
            )
        })?;
        let scheme = Scheme::of(first.scheme())?;
        let mut urls = vec![first];
        for part in parts {
            let Some(spelled) = scheme.several() else {
                return Err("several hosts (\";\") are for sentinel:// and amqp:// URLs".into());
            };
            let url = Url::parse(part)
                .map_err(|e| format!("a host after \";\" is not a URL ({e}); {ENCODE_HINT}"))?;
            if Scheme::of(url.scheme()) != Ok(scheme) {
                return Err(format!("each host after \";\" is written {spelled}://host:port"));
            }
            urls.push(url);
        }
        match scheme {
            Scheme::Amqp { tls } => return nodes(&urls, tls, false),
            Scheme::Kafka { tls } => return nodes(&urls, tls, true),
            _ => {}
        }
        let (tls, sentinel) = (scheme == Scheme::Rediss, scheme == Scheme::Sentinel);
        let last = urls.last().expect("at least one URL");
        if last.fragment().is_some() || urls.iter().any(|u| u.fragment().is_some()) {
            return Err(format!("a URL fragment (#) is not supported; {ENCODE_HINT}"));
        }
        let query_tls = check_query(last)?;
        let db = match last.path().trim_matches('/') {
            "" => 0,
            db => {
                db.parse().map_err(|_| format!("the database (the path) is not a number; {ENCODE_HINT}"))?
            }
        };
        // kombu reads credentials from the first URL only.
        let username = Some(decode(urls[0].username(), "user name")?).filter(|u| !u.is_empty());
        let password =
            urls[0].password().map(|p| decode(p, "password")).transpose()?.filter(|p| !p.is_empty());
        let endpoints = if sentinel {
            Endpoints::Sentinels(urls.iter().map(|u| address(u, SENTINEL_PORT)).collect::<Result<_, _>>()?)
        } else {
            let (host, port) = address(&urls[0], DEFAULT_PORT)?;
            Endpoints::Direct(host, port)
        };
        // kombu's certificate option asks for TLS to a sentinel's master.
        Ok(BrokerUrl {
            tls: tls || (sentinel && query_tls),
            endpoints,
            db,
            vhost: String::new(),
            username,
            password,
        })
    }

    pub fn is_amqp(&self) -> bool {
        matches!(self.endpoints, Endpoints::Amqp(_))
    }

    pub fn is_kafka(&self) -> bool {
        matches!(self.endpoints, Endpoints::Kafka(_))
    }

    /// The URL without its credentials, rebuilt from what was parsed: what
    /// logs, views and errors may show.
    pub fn display(&self) -> String {
        let scheme = match (&self.endpoints, self.tls) {
            (Endpoints::Sentinels(_), _) => "sentinel",
            (Endpoints::Direct(..), true) => "rediss",
            (Endpoints::Direct(..), false) => "redis",
            (Endpoints::Amqp(_), true) => "amqps",
            (Endpoints::Amqp(_), false) => "amqp",
            (Endpoints::Kafka(_), true) => "kafkas",
            (Endpoints::Kafka(_), false) => "kafka",
        };
        let credentials = if self.username.is_some() || self.password.is_some() { "***@" } else { "" };
        let host = |(host, port): &(String, u16)| {
            if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            }
        };
        if let Endpoints::Amqp(nodes) = &self.endpoints {
            // Each node's URL names the vhost, as kombu's failover URLs do.
            let vhost = percent_encoding::utf8_percent_encode(&self.vhost, VHOST).to_string();
            let nodes: Vec<String> = nodes.iter().map(|n| format!("{}/{vhost}", host(n))).collect();
            return format!("{scheme}://{credentials}{}", nodes.join(&format!(";{scheme}://")));
        }
        if let Endpoints::Kafka(servers) = &self.endpoints {
            let servers: Vec<String> = servers.iter().map(host).collect();
            return format!("{scheme}://{credentials}{}", servers.join(","));
        }
        let hosts = match &self.endpoints {
            Endpoints::Direct(h, p) => host(&(h.clone(), *p)),
            Endpoints::Sentinels(all) | Endpoints::Amqp(all) | Endpoints::Kafka(all) => {
                all.iter().map(host).collect::<Vec<_>>().join(&format!(";{scheme}://"))
            }
        };
        let query = if scheme == "sentinel" && self.tls { "?ssl_cert_reqs=required" } else { "" };
        format!("{scheme}://{credentials}{hosts}/{}{query}", self.db)
    }
}

/// What a vhost's display escapes: enough that it reads back as it is,
/// except `/`, which kombu writes as it is (`amqp://h//` is vhost `/`).
const VHOST: &percent_encoding::AsciiSet =
    &percent_encoding::CONTROLS.add(b' ').add(b'?').add(b'#').add(b'%').add(b';').add(b'@');

/// The schemes, and how they may list several hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Redis,
    Rediss,
    Sentinel,
    Amqp { tls: bool },
    Kafka { tls: bool },
}

impl Scheme {
    fn of(scheme: &str) -> Result<Scheme, String> {
        match scheme {
            "redis" => Ok(Scheme::Redis),
            "rediss" => Ok(Scheme::Rediss),
            "sentinel" => Ok(Scheme::Sentinel),
            "amqp" | "pyamqp" => Ok(Scheme::Amqp { tls: false }),
            "amqps" => Ok(Scheme::Amqp { tls: true }),
            "kafka" => Ok(Scheme::Kafka { tls: false }),
            "kafkas" => Ok(Scheme::Kafka { tls: true }),
            _ => {
                Err("unsupported scheme (expected redis, rediss, sentinel, amqp, amqps, kafka or kafkas)"
                    .into())
            }
        }
    }

    /// How the hosts after the first are written, for schemes that list
    /// several.
    fn several(self) -> Option<&'static str> {
        match self {
            Scheme::Sentinel => Some("sentinel"),
            Scheme::Amqp { tls: false } => Some("amqp"),
            Scheme::Amqp { tls: true } => Some("amqps"),
            Scheme::Kafka { tls: false } => Some("kafka"),
            Scheme::Kafka { tls: true } => Some("kafkas"),
            Scheme::Redis | Scheme::Rediss => None,
        }
    }
}

/// `kafka://user:password@h1:9092,h2:9092/` as `kafka://user:password@h1:9092;kafka://h2:9092/`:
/// Kafka's list of bootstrap servers, written as the URLs of the other
/// schemes that name several hosts. Other text is returned as it is.
fn kafka_hosts(text: &str) -> std::borrow::Cow<'_, str> {
    let Some((scheme @ ("kafka" | "kafkas"), rest)) = text.split_once("://") else { return text.into() };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if !authority.contains(',') {
        return text.into();
    }
    // The credentials end at the last @ (an @ in them is percent-encoded).
    let hosts_at = authority.rfind('@').map_or(0, |at| at + 1);
    let (credentials, hosts) = authority.split_at(hosts_at);
    let hosts: Vec<&str> = hosts.split(',').collect();
    format!("{scheme}://{credentials}{}{tail}", hosts.join(&format!(";{scheme}://"))).into()
}

/// An AMQP URL, its nodes in `urls`: kombu's `amqp://user:password@host:port/vhost`;
/// or (`kafka`) a Kafka URL, its bootstrap servers in `urls`, which names
/// no vhost. Takes no parameters: TLS is the scheme's, its authorities
/// `outbox.broker_tls_ca_file`'s.
fn nodes(urls: &[Url], tls: bool, kafka: bool) -> Result<BrokerUrl, String> {
    let first = &urls[0];
    let kind = if kafka { "Kafka" } else { "AMQP" };
    if urls.iter().any(|u| u.query().is_some()) {
        return Err(format!("{kind} URLs take no parameters (?…); {ENCODE_HINT}"));
    }
    // A fragment, or an @ in the path, is a password with a /, # or ? that
    // ended the authority early: what follows may be a piece of it.
    if urls.iter().any(|u| u.fragment().is_some() || u.path().contains('@')) {
        return Err(format!("the URL has a # or an @ after the host; {ENCODE_HINT}"));
    }
    let port = match (kafka, tls) {
        (true, _) => KAFKA_PORT,
        (false, true) => AMQPS_PORT,
        (false, false) => AMQP_PORT,
    };
    let path = first.path();
    let vhost = decode(path.strip_prefix('/').unwrap_or(path), "vhost")?;
    if kafka && urls.iter().any(|u| !matches!(u.path(), "" | "/")) {
        return Err("a Kafka URL has no path: kafka://host:port,host:port".into());
    }
    let username = Some(decode(first.username(), "user name")?).filter(|u| !u.is_empty());
    let password = first.password().map(|p| decode(p, "password")).transpose()?;
    let servers = urls.iter().map(|u| address(u, port)).collect::<Result<_, _>>()?;
    Ok(BrokerUrl {
        tls,
        endpoints: if kafka { Endpoints::Kafka(servers) } else { Endpoints::Amqp(servers) },
        db: 0,
        vhost: match (kafka, vhost.is_empty()) {
            (true, _) => String::new(),
            (false, true) => "/".into(),
            (false, false) => vhost,
        },
        username,
        password,
    })
}

/// The URL's query: kombu's `ssl_cert_reqs=required` (returns true) or
/// nothing. Names no parameter: one may be a piece of a password.
fn check_query(url: &Url) -> Result<bool, String> {
    let mut tls = false;
    for (name, value) in url.query_pairs() {
        match (name.as_ref(), value.as_ref()) {
            // kombu's spelling for "verify the server": always done here.
            ("ssl_cert_reqs", "required" | "CERT_REQUIRED") => tls = true,
            ("ssl_cert_reqs", _) => {
                return Err(
                    "ssl_cert_reqs other than required is not supported: the server's certificate is \
                            always verified (outbox.broker_tls_ca_file names the authorities to trust)"
                        .into(),
                )
            }
            _ => {
                return Err(format!(
                    "an unsupported URL parameter (only ssl_cert_reqs=required is accepted); {ENCODE_HINT}"
                ))
            }
        }
    }
    Ok(tls)
}

fn address(url: &Url, default_port: u16) -> Result<(String, u16), String> {
    let host = match url.host() {
        Some(Host::Ipv6(ip)) => ip.to_string(),
        Some(Host::Ipv4(ip)) => ip.to_string(),
        Some(Host::Domain(name)) if !name.is_empty() => decode(name, "host")?,
        _ => return Err(format!("the host is missing; {ENCODE_HINT}")),
    };
    Ok((host, url.port().unwrap_or(default_port)))
}

/// Percent-decoding; `what` names the part for the error, never its value.
fn decode(text: &str, what: &str) -> Result<String, String> {
    let bytes = text.as_bytes();
    let malformed = bytes.iter().enumerate().any(|(i, b)| {
        *b == b'%' && !bytes.get(i + 1..i + 3).is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
    });
    if malformed {
        return Err(format!("the {what} has a bad percent-escape; {ENCODE_HINT}"));
    }
    percent_decode_str(text)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| format!("the {what} is not UTF-8 once decoded"))
}

/// `redis://user:secret@host:6379/0` → `redis://***@host:6379/0`: logs,
/// views and errors may show where the broker is, never a credential. An
/// unparsable URL shows as nothing but that.
pub fn redact(url: &str) -> String {
    BrokerUrl::parse(url).map_or_else(|_| "(unparsable URL)".into(), |u| u.display())
}

/// `text` with every occurrence of `url` replaced by its redacted form;
/// `None` when `url` is empty or not in `text`.
pub fn redact_within(text: &str, url: &str) -> Option<String> {
    (!url.is_empty() && text.contains(url)).then(|| text.replace(url, &redact(url)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_within_a_line_is_redacted() {
        let url = "amqp://outbox:s%2F%3F%23%40%25ecret@rabbit.example:5672/%2F";
        let line = format!("parameter \"outbox.broker_url\" changed to \"{url}\"");
        let redacted = redact_within(&line, url).unwrap();
        assert!(!redacted.contains("ecret") && redacted.contains("rabbit.example"), "{redacted}");
        assert!(redacted.starts_with("parameter \"outbox.broker_url\" changed to \""));
        // Written unencoded, the URL does not parse: none of it is shown.
        let raw = "redis://:se/cr?et@h:1/0";
        let redacted = redact_within(&format!("changed to \"{raw}\""), raw).unwrap();
        assert!(!redacted.contains("se/cr") && !redacted.contains("et@h"), "{redacted}");
        assert_eq!(redact_within("changed to \"\"", ""), None);
        assert_eq!(redact_within("another line", url), None);
    }

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
    fn amqp_urls_parse_as_kombu_reads_them() {
        let u = BrokerUrl::parse("amqp://guest:guest@localhost:5672//").unwrap();
        assert_eq!(u.endpoints, Endpoints::Amqp(vec![("localhost".into(), 5672)]));
        assert_eq!(
            (u.vhost.as_str(), u.username.as_deref(), u.password.as_deref()),
            ("/", Some("guest"), Some("guest"))
        );
        assert_eq!(u.display(), "amqp://***@localhost:5672//");
        let u = BrokerUrl::parse("amqp://h").unwrap();
        assert_eq!((u.vhost.as_str(), u.username, u.password, u.tls), ("/", None, None, false));
        let u = BrokerUrl::parse("pyamqp://h/orders").unwrap();
        assert_eq!(u.vhost, "orders");
        let u = BrokerUrl::parse("amqps://u:p%40w@h1:5673/a%2Fb;amqps://h2").unwrap();
        assert!(u.tls);
        assert_eq!(u.endpoints, Endpoints::Amqp(vec![("h1".into(), 5673), ("h2".into(), 5671)]));
        assert_eq!((u.vhost.as_str(), u.password.as_deref()), ("a/b", Some("p@w")));
        assert_eq!(u.display(), "amqps://***@h1:5673/a/b;amqps://h2:5671/a/b");
        assert_eq!(BrokerUrl::parse(&u.display().replace("***@", "")).unwrap().vhost, "a/b");
        assert!(u.is_amqp());
    }

    #[test]
    fn bad_urls_say_what_is_wrong_without_the_password() {
        for (url, expected) in [
            ("localhost:6379", "scheme"),
            ("http://h/0", "unsupported scheme"),
            ("redis://u:secret@h:99999/0", "not a URL (invalid port number)"),
            ("redis://u:secret@h/zero", "the database (the path) is not a number"),
            ("redis://u:secret@/0", "empty host"),
            ("redis://u:sec%zzret@h/0", "the password has a bad percent-escape"),
            ("rediss://h/0?ssl_cert_reqs=none", "always verified"),
            ("redis://h/0?socket_timeout=3", "an unsupported URL parameter"),
            ("sentinel://h1:1;h2:2/0", "each host after \";\" is written sentinel://host:port"),
            ("sentinel://h1:1;:x/0", "a host after \";\" is not a URL"),
            ("amqp://u:secret@h1;amqps://h2", "each host after \";\" is written amqp://host:port"),
            ("amqp://u:secret@h/v?heartbeat=10", "AMQP URLs take no parameters"),
            ("amqp://u:secret@h/v%zz", "the vhost has a bad percent-escape"),
            ("redis://u:secret@h1;sentinel://h2/0", "several hosts"),
        ] {
            let err = BrokerUrl::parse(url).unwrap_err();
            assert!(err.contains(expected), "{url}: {err}");
            assert!(
                !err.contains("secret") && !err.contains("sec%") && !err.contains("socket"),
                "{url}: {err}"
            );
        }
    }

    /// A password with each character that ends or splits an authority,
    /// as it is in the URL: whatever becomes of it, no piece of it is shown.
    #[test]
    fn no_piece_of_a_password_is_ever_shown() {
        for c in ["/", "?", "#", "@", ":", "%", ";"] {
            let password = format!("Zq{c}Xy{c}Wv");
            for template in [
                "redis://:{}@h:6379/0",
                "redis://user:{}@h/3",
                "rediss://:{}@h:6380/0?ssl_cert_reqs=required",
                "sentinel://:{}@s1:26379;sentinel://s2:26380/1",
                "amqp://user:{}@h:5672/vhost",
                "amqps://user:{}@h1;amqps://h2",
                "amqp://user:12{}@h:5672/vhost",
                "amqp://user:{}@h",
            ] {
                let url = template.replace("{}", &password);
                let shown = match BrokerUrl::parse(&url) {
                    Ok(parsed) => format!("{} {parsed:?}", parsed.display()),
                    Err(e) => e,
                };
                let shown = format!("{shown} {}", redact(&url));
                for piece in ["Zq", "Xy", "Wv"] {
                    assert!(!shown.contains(piece), "{url}: {shown}");
                }
            }
            // Percent-encoded, it is the password.
            let encoded: String = password.bytes().map(|b| format!("%{b:02X}")).collect();
            let parsed = BrokerUrl::parse(&format!("redis://:{encoded}@h:6379/0")).unwrap();
            assert_eq!(parsed.password.as_deref(), Some(password.as_str()));
            assert_eq!(parsed.display(), "redis://***@h:6379/0");
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
        assert_eq!(redact("redis://:pw@h"), "redis://***@h:6379/0");
        assert_eq!(redact("rediss://user:p%40ss@h:1/2"), "rediss://***@h:1/2");
        assert_eq!(redact("redis://h:6379/0"), "redis://h:6379/0");
        assert_eq!(redact("redis://[::1]:7000/1"), "redis://[::1]:7000/1");
        assert_eq!(redact("garbage"), "(unparsable URL)");
        assert_eq!(
            redact("sentinel://:pw@h1:1;sentinel://:pw@h2:2/0"),
            "sentinel://***@h1:1;sentinel://h2:2/0"
        );
    }

    #[test]
    fn kafka_urls_list_bootstrap_servers() {
        let u = BrokerUrl::parse("kafka://k1:9093,k2,[::1]:9094").unwrap();
        let servers = vec![("k1".into(), 9093), ("k2".into(), 9092), ("::1".into(), 9094)];
        assert_eq!(
            (u.tls, u.endpoints.clone(), u.username.clone()),
            (false, Endpoints::Kafka(servers), None)
        );
        assert!(u.is_kafka() && !u.is_amqp());
        assert_eq!(u.display(), "kafka://k1:9093,k2:9092,[::1]:9094");
        let u = BrokerUrl::parse("kafkas://outbox:p%40ss%2Cw@k1:9093,k2:9093/").unwrap();
        assert_eq!(
            (u.tls, u.username.as_deref(), u.password.as_deref()),
            (true, Some("outbox"), Some("p@ss,w"))
        );
        assert_eq!(u.display(), "kafkas://***@k1:9093,k2:9093");
        // Written as the other schemes list hosts, too.
        let u = BrokerUrl::parse("kafka://k1;kafka://k2:1").unwrap();
        assert_eq!(u.endpoints, Endpoints::Kafka(vec![("k1".into(), 9092), ("k2".into(), 1)]));
        for (bad, why) in [
            ("kafka://k1/topic", "no path"),
            ("kafka://k1?acks=1", "no parameters"),
            ("kafka://k1,", "host is missing"),
            ("kafka://k1;amqp://k2", "kafka://host:port"),
        ] {
            let error = BrokerUrl::parse(bad).unwrap_err();
            assert!(error.contains(why), "{bad}: {error}");
            assert!(!error.contains("s3cr"), "{error}");
        }
    }
}
