//! The `outbox.*` settings as PostgreSQL declares them: kind, default,
//! range and unit, one line each; and the parsing of a value the way
//! PostgreSQL parses it (`5s`, `8MB`, `on`). The server registers its
//! settings with these ranges (the extension's `config.rs`, checked against
//! this table by the tests); the sidecar, which reads them as text from the
//! database, parses them here.

use std::ffi::CStr;
use std::fmt;

/// The unit an integer setting is kept in: a value without one is in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    None,
    Bytes,
    Kb,
    Ms,
    S,
}

impl Unit {
    /// The name `pg_settings.unit` shows.
    pub fn shown(self) -> Option<&'static str> {
        match self {
            Unit::None => None,
            Unit::Bytes => Some("B"),
            Unit::Kb => Some("kB"),
            Unit::Ms => Some("ms"),
            Unit::S => Some("s"),
        }
    }

    /// The units a value may be written in, with their size in this unit.
    fn accepted(self) -> &'static [(&'static str, f64)] {
        const KB: f64 = 1024.0;
        match self {
            Unit::None => &[],
            Unit::Bytes => {
                &[("B", 1.0), ("kB", KB), ("MB", KB * KB), ("GB", KB * KB * KB), ("TB", KB * KB * KB * KB)]
            }
            Unit::Kb => &[("B", 1.0 / KB), ("kB", 1.0), ("MB", KB), ("GB", KB * KB), ("TB", KB * KB * KB)],
            Unit::Ms => &[("us", 0.001), ("ms", 1.0), ("s", 1e3), ("min", 6e4), ("h", 3.6e6), ("d", 8.64e7)],
            Unit::S => {
                &[("us", 1e-6), ("ms", 1e-3), ("s", 1.0), ("min", 60.0), ("h", 3600.0), ("d", 86400.0)]
            }
        }
    }
}

/// A setting's kind and default (and for integers, range and unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Bool(bool),
    Int {
        default: i32,
        min: i32,
        max: i32,
        unit: Unit,
    },
    /// Empty: none. A C string, as the server's registration takes it.
    Text(&'static CStr),
    /// One of the names; the default is the first.
    Choice(&'static [&'static str]),
}

/// One setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Declared {
    pub name: &'static str,
    pub kind: Kind,
}

/// The most dispatchers per database (`outbox.workers`).
pub const MAX_WORKERS: i32 = 32;

const HOUR_MS: i32 = 3_600_000;
const DAY_S: i32 = 86_400;

const fn int(name: &'static str, default: i32, min: i32, max: i32, unit: Unit) -> Declared {
    Declared { name, kind: Kind::Int { default, min, max, unit } }
}

const fn flag(name: &'static str, default: bool) -> Declared {
    Declared { name, kind: Kind::Bool(default) }
}

const fn text(name: &'static str, default: &'static CStr) -> Declared {
    Declared { name, kind: Kind::Text(default) }
}

const fn choice(name: &'static str, names: &'static [&'static str]) -> Declared {
    Declared { name, kind: Kind::Choice(names) }
}

/// Every setting, one line each.
#[rustfmt::skip]
pub const DECLARED: [Declared; 53] = [
    int("outbox.workers", 1, 0, MAX_WORKERS, Unit::None),
    text("outbox.database", c"postgres"),
    flag("outbox.enabled", true),
    text("outbox.broker_url", c""),
    text("outbox.redis_url", c"redis://127.0.0.1:6379/0"),
    text("outbox.broker_password_file", c""),
    text("outbox.broker_tls_ca_file", c""),
    text("outbox.broker_tls_cert_file", c""),
    text("outbox.broker_tls_key_file", c""),
    text("outbox.redis_sentinel_master", c""),
    text("outbox.redis_sentinel_password_file", c""),
    int("outbox.redis_wait_replicas", -1, -1, 16, Unit::None),
    text("outbox.redis_key_prefix", c""),
    text("outbox.priority_steps", c"0,3,6,9"),
    text("outbox.priority_separator", c""),
    text("outbox.default_queue", c"celery"),
    int("outbox.batch_size", 100, 1, 100_000, Unit::None),
    int("outbox.max_batch_bytes", 8 * 1024, 64, 1024 * 1024, Unit::Kb),
    int("outbox.poll_interval", 60_000, 10, 24 * HOUR_MS, Unit::Ms),
    int("outbox.linger", 2, 0, 1000, Unit::Ms),
    int("outbox.max_retries", 3, 1, 1000, Unit::None),
    int("outbox.retry_backoff", 1_000, 0, HOUR_MS, Unit::Ms),
    int("outbox.reconnect_delay_min", 3_000, 10, HOUR_MS, Unit::Ms),
    int("outbox.reconnect_delay_max", 10_000, 10, HOUR_MS, Unit::Ms),
    int("outbox.broker_timeout", 5_000, 100, 600_000, Unit::Ms),
    int("outbox.processing_timeout", 300, 1, DAY_S, Unit::S),
    int("outbox.ack_timeout", 0, 0, 30 * DAY_S, Unit::S),
    int("outbox.max_redeliveries", 5, 0, 1000, Unit::None),
    int("outbox.statement_timeout", 60_000, 100, HOUR_MS, Unit::Ms),
    int("outbox.sweep_interval", 300, 1, DAY_S, Unit::S),
    int("outbox.retention", 7 * DAY_S, 1, 3650 * DAY_S, Unit::S),
    int("outbox.lifecycle_interval", 3600, 1, DAY_S, Unit::S),
    int("outbox.heartbeat_interval", 30, 1, DAY_S, Unit::S),
    text("outbox.report_key", c"outbox_dispatch.reports"),
    int("outbox.report_timeout", 3600, 0, 30 * DAY_S, Unit::S),
    flag("outbox.notify", false),
    text("outbox.notify_channel", c"outbox_new"),
    int("outbox.max_payload_bytes", 1024 * 1024, 1, i32::MAX, Unit::Bytes),
    int("outbox.inbox_retention", 30 * DAY_S, 3600, 3650 * DAY_S, Unit::S),
    choice("outbox.amqp_queue_type", &["classic", "quorum"]),
    int("outbox.amqp_max_priority", 0, 0, 255, Unit::None),
    flag("outbox.moving", false),
    choice("outbox.key_on_failure", &["block", "continue"]),
    text("outbox.kafka_topic", c"outbox.event.{event_type}"),
    flag("outbox.kafka_tombstones", false),
    choice("outbox.kafka_sasl_mechanism", &["scram-sha-512", "scram-sha-256", "plain"]),
    flag("outbox.kafka_sasl_plain_cleartext", false),
    int("outbox.kafka_request_timeout", 30_000, 100, 600_000, Unit::Ms),
    choice("outbox.kafka_compression", &["none", "lz4", "zstd"]),
    choice("outbox.kafka_key_format", &["string", "json"]),
    // The former names of [`RENAMED`]'s settings, as they were.
    int("outbox.redis_timeout", 5_000, 100, 600_000, Unit::Ms),
    text("outbox.redis_password_file", c""),
    text("outbox.redis_tls_ca_file", c""),
];

/// Settings renamed when they came to serve every broker: (former name,
/// name). The former stays declared, deprecated: it is read while the new
/// one is at its default and it is not, and a dispatcher that reads it says
/// so once.
pub const RENAMED: [(&str, &str); 3] = [
    ("outbox.redis_timeout", "outbox.broker_timeout"),
    ("outbox.redis_password_file", "outbox.broker_password_file"),
    ("outbox.redis_tls_ca_file", "outbox.broker_tls_ca_file"),
];

/// The declaration of `name`.
pub fn declared(name: &str) -> Option<&'static Declared> {
    DECLARED.iter().find(|d| d.name == name)
}

/// The declaration of `name`, at compile time: the server's settings take
/// their defaults from here (and a name not declared fails the build).
const fn find(name: &str) -> Declared {
    let mut i = 0;
    while i < DECLARED.len() {
        let (a, b) = (DECLARED[i].name.as_bytes(), name.as_bytes());
        if a.len() == b.len() {
            let mut j = 0;
            while j < a.len() && a[j] == b[j] {
                j += 1;
            }
            if j == a.len() {
                return DECLARED[i];
            }
        }
        i += 1;
    }
    panic!("not a declared setting")
}

/// The default of the integer setting `name`.
pub const fn int_default(name: &str) -> i32 {
    match find(name).kind {
        Kind::Int { default, .. } => default,
        _ => panic!("not an integer setting"),
    }
}

/// The default of the Boolean setting `name`.
pub const fn flag_default(name: &str) -> bool {
    match find(name).kind {
        Kind::Bool(default) => default,
        _ => panic!("not a Boolean setting"),
    }
}

/// The default of the text setting `name`.
pub const fn text_default(name: &str) -> &'static CStr {
    match find(name).kind {
        Kind::Text(default) => default,
        _ => panic!("not a text setting"),
    }
}

/// A value a setting is given, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    Bool(bool),
    Int(i32),
    Text(String),
    /// The index of the name among the choices.
    Choice(usize),
}

/// A value refused, with why, in PostgreSQL's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub name: &'static str,
    pub value: String,
    pub why: String,
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid value for parameter \"{}\": \"{}\": {}", self.name, self.value, self.why)
    }
}

impl std::error::Error for Invalid {}

impl Declared {
    /// The value a setting not set has.
    pub fn default(&self) -> Parsed {
        match self.kind {
            Kind::Bool(b) => Parsed::Bool(b),
            Kind::Int { default, .. } => Parsed::Int(default),
            Kind::Text(t) => Parsed::Text(t.to_string_lossy().into_owned()),
            Kind::Choice(_) => Parsed::Choice(0),
        }
    }

    /// Parses `value` as PostgreSQL parses a value of this setting.
    pub fn parse(&self, value: &str) -> Result<Parsed, Invalid> {
        let invalid = |why: String| Invalid { name: self.name, value: value.to_string(), why };
        match self.kind {
            Kind::Bool(_) => parse_bool(value)
                .map(Parsed::Bool)
                .ok_or_else(|| invalid("a Boolean value is on, off, true, false, yes, no, 1 or 0".into())),
            Kind::Text(_) => Ok(Parsed::Text(value.to_string())),
            Kind::Choice(names) => names
                .iter()
                .position(|n| n.eq_ignore_ascii_case(value.trim()))
                .map(Parsed::Choice)
                .ok_or_else(|| invalid(format!("available values: {}", names.join(", ")))),
            Kind::Int { min, max, unit, .. } => {
                let n = parse_int(value, unit).map_err(invalid)?;
                if n < min as f64 || n > max as f64 {
                    let shown = unit.shown().unwrap_or("");
                    return Err(invalid(format!("outside the valid range {min}{shown} .. {max}{shown}")));
                }
                Ok(Parsed::Int(n as i32))
            }
        }
    }
}

/// `on`, `off`, `true`, `false`, `yes`, `no` (or a unique prefix of them),
/// `1`, `0`, in any case.
fn parse_bool(value: &str) -> Option<bool> {
    let v = value.trim().to_ascii_lowercase();
    let prefix = |word: &str, least: usize| v.len() >= least && word.starts_with(v.as_str());
    match () {
        _ if v == "1" || prefix("true", 1) || prefix("yes", 1) || prefix("on", 2) => Some(true),
        _ if v == "0" || prefix("false", 1) || prefix("no", 1) || prefix("off", 2) => Some(false),
        _ => None,
    }
}

/// A number, rounded to a whole one, optionally followed by one of the
/// units of `unit`'s kind: in `unit`.
fn parse_int(value: &str, unit: Unit) -> Result<f64, String> {
    let v = value.trim();
    let split = v
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(v.len());
    let (number, suffix) = v.split_at(split);
    let number: f64 = number.parse().map_err(|_| format!("\"{v}\" is not a number"))?;
    let suffix = suffix.trim();
    let scale = if suffix.is_empty() {
        1.0
    } else {
        match unit.accepted().iter().find(|(name, _)| *name == suffix) {
            Some((_, scale)) => *scale,
            None if unit == Unit::None => return Err("this setting takes no unit".into()),
            None => {
                let names: Vec<&str> = unit.accepted().iter().map(|(n, _)| *n).collect();
                return Err(format!("valid units are {}", names.join(", ")));
            }
        }
    };
    let scaled = (number * scale).round();
    if !scaled.is_finite() {
        return Err("out of range".into());
    }
    Ok(scaled)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(name: &str, value: &str) -> Result<Parsed, Invalid> {
        declared(name).unwrap().parse(value)
    }

    #[test]
    fn a_former_name_is_declared_as_its_new_name_is() {
        for (former, new) in RENAMED {
            let (former, new) = (declared(former).unwrap(), declared(new).unwrap());
            assert_eq!(former.kind, new.kind, "{} and {}", former.name, new.name);
        }
    }

    #[test]
    fn integers_take_their_kind_of_unit_and_are_rounded() {
        assert_eq!(parse("outbox.poll_interval", "250"), Ok(Parsed::Int(250)));
        assert_eq!(parse("outbox.poll_interval", "2s"), Ok(Parsed::Int(2000)));
        assert_eq!(parse("outbox.poll_interval", " 1 min "), Ok(Parsed::Int(60_000)));
        assert_eq!(parse("outbox.poll_interval", "10.6"), Ok(Parsed::Int(11)));
        assert_eq!(parse("outbox.retention", "2d"), Ok(Parsed::Int(172_800)));
        assert_eq!(parse("outbox.retention", "1500ms"), Ok(Parsed::Int(2)));
        assert_eq!(parse("outbox.max_batch_bytes", "8MB"), Ok(Parsed::Int(8192)));
        assert_eq!(parse("outbox.max_payload_bytes", "1kB"), Ok(Parsed::Int(1024)));
        assert_eq!(parse("outbox.batch_size", "1e3"), Ok(Parsed::Int(1000)));
    }

    #[test]
    fn a_refused_integer_says_why_naming_the_setting() {
        let e = parse("outbox.batch_size", "0").unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid value for parameter \"outbox.batch_size\": \"0\": outside the valid range 1 .. 100000"
        );
        let e = parse("outbox.poll_interval", "5").unwrap_err();
        assert!(e.why.contains("10ms .. 86400000ms"), "{e}");
        assert!(parse("outbox.poll_interval", "2 seconds")
            .unwrap_err()
            .why
            .contains("valid units are us, ms"));
        assert!(parse("outbox.max_batch_bytes", "2s").is_err(), "a time for a size");
        assert!(parse("outbox.batch_size", "10kB").unwrap_err().why.contains("no unit"));
        assert!(parse("outbox.batch_size", "many").unwrap_err().why.contains("not a number"));
        assert!(parse("outbox.batch_size", "").is_err());
        assert!(parse("outbox.max_payload_bytes", "4GB").is_err(), "beyond an int4");
        assert!(parse("outbox.batch_size", "1e400").is_err());
    }

    #[test]
    fn booleans_and_choices_read_as_postgresql_reads_them() {
        for on in ["on", "ON", "true", "t", "yes", "y", "1"] {
            assert_eq!(parse("outbox.enabled", on), Ok(Parsed::Bool(true)), "{on}");
        }
        for off in ["off", "of", "false", "F", "no", "n", "0"] {
            assert_eq!(parse("outbox.enabled", off), Ok(Parsed::Bool(false)), "{off}");
        }
        for bad in ["o", "2", "onn", ""] {
            assert!(parse("outbox.enabled", bad).is_err(), "{bad}");
        }
        assert_eq!(parse("outbox.key_on_failure", "Continue"), Ok(Parsed::Choice(1)));
        assert_eq!(
            parse("outbox.amqp_queue_type", "stream").unwrap_err().why,
            "available values: classic, quorum"
        );
    }

    #[test]
    fn every_default_is_within_its_range() {
        for d in DECLARED {
            if let Kind::Int { default, min, max, .. } = d.kind {
                assert!((min..=max).contains(&default), "{}", d.name);
            }
            assert_eq!(DECLARED.iter().filter(|o| o.name == d.name).count(), 1, "{}", d.name);
        }
    }
}
