//! What goes wrong at the broker: the server's own conditions (OOM,
//! READONLY, …) told from a message's error, and [`SinkError`], the
//! broker's failure with the reason logs and metrics give it.

use std::fmt;

use crate::link::LinkError;

crate::named! {
    /// Answers that describe the server, not the message: Redis error
    /// replies (the name is the reply's kind, its first word, in lower
    /// case) and RabbitMQ's own refusals. A push refused with one of these
    /// goes back to pending without spending a retry.
    pub enum Condition {
        Oom = "oom",
        ReadOnly = "readonly",
        MasterDown = "masterdown",
        Loading = "loading",
        Busy = "busy",
        Misconf = "misconf",
        NoAuth = "noauth",
        NoPerm = "noperm",
        TryAgain = "tryagain",
        ClusterDown = "clusterdown",
        /// Fewer replicas than `outbox.redis_wait_replicas` confirmed.
        NoReplicas = "noreplicas",
        /// RabbitMQ blocked the connection (a memory or disk alarm).
        Blocked = "blocked",
        /// RabbitMQ would not take a message (`basic.nack`).
        Nacked = "nacked",
        /// RabbitMQ closed the channel: a declaration that does not match
        /// the queue as it is, a permission, a queue that went away.
        ChannelClosed = "channel_closed",
        /// Kafka: the partition's leader moved or is being elected
        /// (NOT_LEADER_OR_FOLLOWER, LEADER_NOT_AVAILABLE, …); the metadata
        /// is asked again.
        LeaderMoved = "leader_moved",
        /// Kafka: fewer in-sync replicas than the topic's
        /// `min.insync.replicas` (NOT_ENOUGH_REPLICAS…).
        NotEnoughReplicas = "not_enough_replicas",
        /// Kafka: any other condition of the broker (a timeout, a storage
        /// error, an unknown error code).
        Unavailable = "unavailable",
    }
}

impl Condition {
    /// The server condition an error reply reports, if it reports one. Any
    /// other error (WRONGTYPE, or a kind this list does not know) is the
    /// message's own: it spends one of the event's retries.
    pub fn of(error: &str) -> Option<Condition> {
        let kind = error.split_whitespace().next().unwrap_or("");
        Condition::ALL[..=Condition::NoReplicas.index()]
            .iter()
            .copied()
            .find(|c| c.name().eq_ignore_ascii_case(kind))
    }
}

crate::named! {
    /// Why the broker could not be used, as logs and metric labels say it.
    pub enum Reason {
        InvalidConfig = "invalid_config",
        ConnectFailed = "connect_failed",
        Timeout = "timeout",
        ConnectionLost = "connection_lost",
        Refused = "refused",
        Failover = "failover",
        Interrupted = "interrupted",
    }
}

/// Why the broker could not be used. Whatever was in flight is not the
/// events' fault: it goes back to pending without spending retries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SinkError {
    /// `outbox.broker_url` does not parse, or a file it needs cannot be used.
    InvalidConfig(String),
    /// Connecting, TLS or authenticating failed.
    Connect(String),
    /// The broker did not answer within the timeout.
    Timeout,
    /// An established connection broke.
    ConnectionLost(String),
    /// The server answered with a condition of its own (OOM, READONLY, …),
    /// and the reply.
    Refused(Condition, String),
    /// The sentinels' master is one no longer (READONLY), or not yet (ROLE).
    Failover(String),
    /// The caller's wait gave up (a signal): the outcome is unknown.
    Interrupted,
}

impl SinkError {
    pub fn reason(&self) -> Reason {
        match self {
            SinkError::InvalidConfig(_) => Reason::InvalidConfig,
            SinkError::Connect(_) => Reason::ConnectFailed,
            SinkError::Timeout => Reason::Timeout,
            SinkError::ConnectionLost(_) => Reason::ConnectionLost,
            SinkError::Refused(..) => Reason::Refused,
            SinkError::Failover(_) => Reason::Failover,
            SinkError::Interrupted => Reason::Interrupted,
        }
    }

    pub(super) fn from_link(error: LinkError, connected: bool) -> SinkError {
        match error {
            LinkError::Timeout => SinkError::Timeout,
            LinkError::Interrupted => SinkError::Interrupted,
            e if connected => SinkError::ConnectionLost(link_message(&e)),
            e => SinkError::Connect(link_message(&e)),
        }
    }

    /// An error reply to a command that must succeed.
    pub(super) fn from_reply(error: &str, connected: bool) -> SinkError {
        match Condition::of(error) {
            Some(condition) => SinkError::Refused(condition, error.to_string()),
            None if connected => SinkError::ConnectionLost(format!("unexpected reply: {error}")),
            None => SinkError::Connect(error.to_string()),
        }
    }
}

fn link_message(error: &LinkError) -> String {
    match error {
        LinkError::Timeout => "timed out".into(),
        LinkError::Interrupted => "interrupted".into(),
        LinkError::Resolve(e) | LinkError::Io(e) => e.clone(),
        LinkError::Tls(e) => format!("TLS: {e}"),
        LinkError::Protocol(e) => e.to_string(),
    }
}

impl fmt::Display for SinkError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SinkError::InvalidConfig(e) => write!(f, "{e}"),
            SinkError::Connect(e) => write!(f, "cannot connect to the broker: {e}"),
            SinkError::Timeout => write!(f, "the broker did not answer within outbox.broker_timeout"),
            SinkError::ConnectionLost(e) => write!(f, "lost the broker connection: {e}"),
            SinkError::Refused(_, e) => write!(f, "the broker refused the push for a reason of its own: {e}"),
            SinkError::Failover(e) => write!(f, "the Redis master changed (failover): {e}"),
            SinkError::Interrupted => write!(f, "the broker operation was interrupted"),
        }
    }
}

impl std::error::Error for SinkError {}

/// A server whose reply fits no command of ours: not Redis, or not one to
/// trust. The connection is dropped like a lost one (nothing it said
/// counts).
pub(super) fn not_redis(what: &str) -> SinkError {
    SinkError::ConnectionLost(format!("Redis protocol error: {what}"))
}

/// `text` with every secret given replaced by `***`: a server's error text
/// may quote a command's arguments (an unknown command's does).
pub(super) fn scrub(text: &str, secrets: &[Option<&str>]) -> String {
    secrets.iter().flatten().filter(|s| !s.is_empty()).fold(text.to_string(), |t, s| t.replace(s, "***"))
}

/// The most characters of a peer's text a message quotes.
const BROKER_TEXT_MAX: usize = 300;

/// Text the broker chose (a close's `reply_text`, an alarm's reason, a
/// return's), as logs and `outbox.workers.last_error` may quote it: control
/// characters escaped (no forged log line), at most [`BROKER_TEXT_MAX`]
/// characters.
pub(super) fn broker_text(text: &str) -> String {
    let mut quoted = String::new();
    for (n, c) in text.chars().enumerate() {
        if n == BROKER_TEXT_MAX {
            quoted.push_str("[…]");
            break;
        }
        if c.is_control() || c == '\\' {
            quoted.extend(c.escape_default());
        } else {
            quoted.push(c);
        }
    }
    quoted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_brokers_text_cannot_forge_a_log_line() {
        let forged = broker_text("fine\n2026-12-01 LOG:  forged\r\u{1b}[2J\\n");
        assert_eq!(forged, "fine\\n2026-12-01 LOG:  forged\\r\\u{1b}[2J\\\\n");
        assert!(!forged.chars().any(char::is_control));
        let long = broker_text(&"\u{7}".repeat(10_000));
        assert!(long.len() < 3000 && long.ends_with("[…]"), "{}", long.len());
    }

    #[test]
    fn server_conditions_are_told_from_message_errors() {
        let of = |e| Condition::of(e).map(Condition::name);
        assert_eq!(of("OOM command not allowed when used memory > 'maxmemory'."), Some("oom"));
        assert_eq!(of("READONLY You can't write against a read only replica."), Some("readonly"));
        assert_eq!(of("NOPERM this user has no permissions"), Some("noperm"));
        assert_eq!(of("WRONGTYPE Operation against a key holding the wrong kind of value"), None);
        assert_eq!(of("ERR something new"), None);
        // RabbitMQ's conditions are its own: no Redis reply names them.
        assert_eq!(of("BLOCKED x"), None);
        assert_eq!(of("NACKED x"), None);
        assert_eq!(of(""), None);
    }

    #[test]
    fn every_reason_is_listed() {
        let errors = [
            SinkError::InvalidConfig(String::new()),
            SinkError::Connect(String::new()),
            SinkError::Timeout,
            SinkError::ConnectionLost(String::new()),
            SinkError::Refused(Condition::Oom, String::new()),
            SinkError::Failover(String::new()),
            SinkError::Interrupted,
        ];
        let reasons: Vec<_> = errors.iter().map(SinkError::reason).collect();
        assert_eq!(reasons, Reason::ALL);
    }
}
