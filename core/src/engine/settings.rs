//! What a dispatcher needs of the settings, read at start and after each
//! reload: plain data, so that nothing below the main loop reads a setting
//! itself (the server's GUCs, the sidecar's configuration).

use std::path::PathBuf;
use std::time::Duration;

use crate::broker_url::BrokerUrl;
use crate::guc::{self, Invalid, Parsed};
use crate::sink::{
    BrokerConfig, Compression, Form, KafkaShape, KeyForm, Mechanism, QueueKind, QueueShape, KOMBU_SEPARATOR,
};
use crate::store::KeyPolicy;

/// What a dispatcher needs of the settings, read at start and after each
/// SIGHUP; plain data, so that nothing below the main loop touches a GUC.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub enabled: bool,
    pub broker: BrokerConfig,
    pub batch_size: usize,
    pub poll_interval: Duration,
    /// `outbox.linger`: the least time from a claim that left nothing in
    /// line to the next.
    pub linger: Duration,
    pub max_retries: i32,
    pub retry_backoff: Duration,
    pub reconnect_delay_min: Duration,
    pub reconnect_delay_max: Duration,
    /// `outbox.processing_timeout`, raised to the longest a push may take.
    pub processing_timeout: Duration,
    /// The value set, when it was raised.
    pub processing_timeout_set: Option<Duration>,
    /// How long after its claim a push paused by the broker (an alarm:
    /// `connection.blocked`) may wait for it, at most: the claim's
    /// timeout less the longest push. Not a setting of the connection: a
    /// reload that changes it abandons no push.
    pub pause_limit: Duration,
    /// Zero: acknowledgements are off.
    pub ack_timeout: Duration,
    pub max_redeliveries: i32,
    /// The deadline of every statement a dispatcher runs.
    pub statement_timeout: Duration,
    pub sweep_interval: Duration,
    pub retention: Duration,
    pub inbox_retention: Duration,
    pub lifecycle_interval: Duration,
    pub heartbeat_interval: Duration,
    /// The list workers report this database's outcomes to: see
    /// the host (`outbox.report_key`, a colon and the database's OID); `None`: reports are off.
    pub report_key: Option<String>,
    /// The most bytes of members' JSON one batch of an accumulated
    /// subscription carries.
    pub batch_budget: i64,
    /// When a head lets its key go.
    pub keys: KeyPolicy,
    /// The former names of renamed settings read in place of their new
    /// ones ([`guc::RENAMED`]).
    pub deprecated: Vec<&'static str>,
}

impl Settings {
    /// Whether reports or acknowledgements are awaited of what is sent,
    /// and whether acknowledgements are.
    pub fn awaiting(&self) -> (bool, bool) {
        (!self.keys.dispatched, !self.ack_timeout.is_zero())
    }
}

/// The values of the settings as their host has them: by name, as text.
/// `None`, or a value that does not parse: the default (and for the
/// latter, an [`Invalid`] to show).
struct Values<'a> {
    text: &'a dyn Fn(&str) -> Option<String>,
    invalid: Vec<Invalid>,
    deprecated: Vec<&'static str>,
}

impl Values<'_> {
    /// The value of `name`; for a renamed one at its default, its former
    /// name's while that is not.
    fn get(&mut self, name: &str) -> Parsed {
        let refused = self.invalid.len();
        let value = self.parse(name);
        let Some(&(former, _)) = guc::RENAMED.iter().find(|(_, new)| *new == name) else {
            return value;
        };
        // A value refused under the new name is its default, shown as
        // such: not the former name's.
        let default = guc::declared(name).map(|d| d.default());
        if Some(&value) != default.as_ref() || self.invalid.len() > refused {
            return value;
        }
        let earlier = self.parse(former);
        if Some(&earlier) == default.as_ref() {
            return value;
        }
        self.deprecated.push(former);
        earlier
    }

    fn parse(&mut self, name: &str) -> Parsed {
        let declared = guc::declared(name).unwrap_or_else(|| panic!("{name} is not declared"));
        match (self.text)(name) {
            None => declared.default(),
            Some(text) => declared.parse(&text).unwrap_or_else(|invalid| {
                self.invalid.push(invalid);
                declared.default()
            }),
        }
    }

    fn int(&mut self, name: &str) -> i32 {
        match self.get(name) {
            Parsed::Int(n) => n,
            other => panic!("{name} is not an integer: {other:?}"),
        }
    }

    fn flag(&mut self, name: &str) -> bool {
        match self.get(name) {
            Parsed::Bool(b) => b,
            other => panic!("{name} is not a Boolean: {other:?}"),
        }
    }

    fn text(&mut self, name: &str) -> String {
        match self.get(name) {
            Parsed::Text(t) => t,
            other => panic!("{name} is not text: {other:?}"),
        }
    }

    fn choice(&mut self, name: &str) -> usize {
        match self.get(name) {
            Parsed::Choice(i) => i,
            other => panic!("{name} is not a choice: {other:?}"),
        }
    }

    /// A file setting; empty means none.
    fn path(&mut self, name: &str) -> Option<PathBuf> {
        Some(self.text(name)).filter(|f| !f.is_empty()).map(PathBuf::from)
    }

    fn millis(&mut self, name: &str) -> Duration {
        Duration::from_millis(self.int(name).max(0) as u64)
    }

    fn seconds(&mut self, name: &str) -> Duration {
        Duration::from_secs(self.int(name).max(0) as u64)
    }
}

impl Settings {
    /// The settings from their values as text (`text(name)`, `None` when
    /// not set), for the database of OID `database_oid`; with the values
    /// refused, each replaced by its default.
    pub fn read(text: &dyn Fn(&str) -> Option<String>, database_oid: u32) -> (Settings, Vec<Invalid>) {
        let mut v = Values { text, invalid: Vec::new(), deprecated: Vec::new() };
        let url = Some(v.text("outbox.broker_url"))
            .filter(|url| !url.is_empty())
            .unwrap_or_else(|| v.text("outbox.redis_url"));
        // -1, the default: 1 with sentinels, where a failover loses what its
        // replicas had not got; 0 without.
        let wait_replicas = match v.int("outbox.redis_wait_replicas") {
            -1 => u32::from(url.starts_with("sentinel://")),
            n => n.max(0) as u32,
        };
        let broker = BrokerConfig {
            url,
            timeout: v.millis("outbox.broker_timeout"),
            tls_ca_file: v.path("outbox.broker_tls_ca_file"),
            tls_cert_file: v.path("outbox.broker_tls_cert_file"),
            tls_key_file: v.path("outbox.broker_tls_key_file"),
            password_file: v.path("outbox.broker_password_file"),
            max_batch_bytes: v.int("outbox.max_batch_bytes").max(1) as usize * 1024,
            sentinel_master: v.text("outbox.redis_sentinel_master"),
            sentinel_password_file: v.path("outbox.redis_sentinel_password_file"),
            wait_replicas,
            key_prefix: v.text("outbox.redis_key_prefix"),
            priority_steps: v.text("outbox.priority_steps"),
            priority_separator: Some(v.text("outbox.priority_separator"))
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| KOMBU_SEPARATOR.to_string()),
            queues: QueueShape {
                kind: [QueueKind::Classic, QueueKind::Quorum][v.choice("outbox.amqp_queue_type")],
                max_priority: v.int("outbox.amqp_max_priority").clamp(0, 255) as u8,
            },
            // The broker closes a connection it heard nothing on for two
            // heartbeats; the dispatcher PINGs every heartbeat_interval.
            heartbeat: v.seconds("outbox.heartbeat_interval") + Duration::from_secs(10),
            kafka: KafkaShape {
                topic: v.text("outbox.kafka_topic"),
                mechanism: Mechanism::ALL[v.choice("outbox.kafka_sasl_mechanism")],
                plain_cleartext: v.flag("outbox.kafka_sasl_plain_cleartext"),
                form: Form {
                    tombstones: v.flag("outbox.kafka_tombstones"),
                    key: KeyForm::ALL[v.choice("outbox.kafka_key_format")],
                },
                request_timeout: v.millis("outbox.kafka_request_timeout"),
                compression: [Compression::None, Compression::Lz4, Compression::Zstd]
                    [v.choice("outbox.kafka_compression")],
            },
        };
        // No Celery worker reads Kafka, so none reports back: a head is
        // finished once delivered, unless acknowledgements are asked.
        let kafka = BrokerUrl::parse(&broker.url).is_ok_and(|url| url.is_kafka());
        let batch_size = v.int("outbox.batch_size").max(1) as usize;
        let max_payload_bytes = v.int("outbox.max_payload_bytes").max(1) as usize;
        let longest = longest_push(&broker, batch_size, max_payload_bytes);
        let processing_timeout = v.seconds("outbox.processing_timeout");
        let report_key = Some(v.text("outbox.report_key")).filter(|_| !kafka).unwrap_or_default();
        let ack_timeout = v.seconds("outbox.ack_timeout");
        let settings = Settings {
            enabled: v.flag("outbox.enabled"),
            batch_size,
            poll_interval: v.millis("outbox.poll_interval"),
            linger: v.millis("outbox.linger"),
            max_retries: v.int("outbox.max_retries"),
            retry_backoff: v.millis("outbox.retry_backoff"),
            reconnect_delay_min: v.millis("outbox.reconnect_delay_min"),
            reconnect_delay_max: v.millis("outbox.reconnect_delay_max"),
            processing_timeout: processing_timeout.max(longest),
            processing_timeout_set: (processing_timeout < longest).then_some(processing_timeout),
            // A push paused by the broker (an alarm) may wait, from its
            // claim, as long as the claim's timeout leaves beyond the
            // longest push: the sweeper must not hand it to another
            // dispatcher meanwhile.
            pause_limit: processing_timeout.saturating_sub(longest),
            ack_timeout,
            max_redeliveries: v.int("outbox.max_redeliveries"),
            statement_timeout: v.millis("outbox.statement_timeout"),
            sweep_interval: v.seconds("outbox.sweep_interval"),
            retention: v.seconds("outbox.retention"),
            inbox_retention: v.seconds("outbox.inbox_retention"),
            lifecycle_interval: v.seconds("outbox.lifecycle_interval"),
            heartbeat_interval: v.seconds("outbox.heartbeat_interval"),
            // One list per database, because a dispatcher trims what it
            // reads: one database's dispatchers would drop another's
            // reports as stale. By OID, so that a rename loses none in
            // flight.
            report_key: Some(report_key.as_str())
                .filter(|k| !k.is_empty())
                .map(|k| format!("{k}:{database_oid}")),
            batch_budget: batch_budget(broker.max_batch_bytes, max_payload_bytes),
            keys: KeyPolicy {
                dispatched: report_key.is_empty() && ack_timeout.is_zero(),
                failed: v.choice("outbox.key_on_failure") == 1,
            },
            broker,
            deprecated: v.deprecated,
        };
        (settings, v.invalid)
    }
}

/// The most bytes of members' JSON (the size the routing trigger records)
/// one batch of an accumulated subscription carries: its message, that JSON
/// in base64 (4/3 of it) in an envelope, is no larger than an event's may be
/// (`outbox.max_payload_bytes`, so that `outbox.processing_timeout`'s floor
/// still holds) and fits in one round trip of `outbox.max_batch_bytes`. A
/// single larger member still goes, alone.
fn batch_budget(max_batch_bytes: usize, max_payload_bytes: usize) -> i64 {
    const ENVELOPE: usize = 4096;
    let message = max_batch_bytes.min(message_bytes(max_payload_bytes));
    (message.saturating_sub(ENVELOPE) / 4 * 3).max(1) as i64
}

/// The largest message an event of `max_payload_bytes` makes: the payload
/// in base64 (4/3) plus the envelope.
fn message_bytes(max_payload_bytes: usize) -> usize {
    max_payload_bytes.saturating_mul(4) / 3 + 2048
}

/// The longest a claim may stay in processing while its dispatcher is
/// alive: a connect (a timeout per RabbitMQ node the URL lists), and one
/// timeout per round trip of a batch of the largest messages, with a
/// margin of one more, and for Kafka its request timeout. A shorter
/// `outbox.processing_timeout` would let the sweeper hand a live claim to
/// another dispatcher and send its events twice.
fn longest_push(broker: &BrokerConfig, batch_size: usize, max_payload_bytes: usize) -> Duration {
    let message = message_bytes(max_payload_bytes);
    let round_trips = batch_size.saturating_mul(message).div_ceil(broker.max_batch_bytes.max(1));
    let connect = if broker.url.starts_with("amqp") { broker.url.split(';').count() } else { 1 };
    // Kafka's produce requests in flight wait for their replicas together,
    // up to its own request timeout.
    let replicas =
        if broker.url.starts_with("kafka") { broker.kafka.request_timeout } else { Duration::ZERO };
    let seconds =
        broker.timeout.as_secs_f64() * ((round_trips + connect) as f64 + 1.0) + replicas.as_secs_f64();
    Duration::from_secs(seconds.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(values: &[(&str, &str)]) -> (Settings, Vec<Invalid>) {
        let values: Vec<(String, String)> =
            values.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Settings::read(&|name| values.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()), 42)
    }

    #[test]
    fn settings_not_set_take_their_defaults() {
        let (s, invalid) = read(&[]);
        assert!(invalid.is_empty());
        assert!(s.enabled);
        assert_eq!(s.broker.url, "redis://127.0.0.1:6379/0");
        assert_eq!(s.poll_interval, Duration::from_secs(60));
        assert_eq!(s.batch_size, 100);
        assert_eq!(s.report_key.as_deref(), Some("outbox_dispatch.reports:42"));
        assert_eq!(s.broker.priority_separator, KOMBU_SEPARATOR);
        assert!(!s.keys.dispatched && !s.keys.failed);
    }

    #[test]
    fn values_are_read_in_their_units_and_refused_ones_named() {
        let (s, invalid) = read(&[
            ("outbox.poll_interval", "250ms"),
            ("outbox.max_batch_bytes", "1MB"),
            ("outbox.batch_size", "lots"),
            ("outbox.report_key", ""),
            ("outbox.key_on_failure", "continue"),
            ("outbox.broker_url", "amqp://a;amqp://b"),
        ]);
        assert_eq!(s.poll_interval, Duration::from_millis(250));
        assert_eq!(s.broker.max_batch_bytes, 1024 * 1024);
        assert_eq!(s.batch_size, 100, "a refused value is the default");
        assert_eq!(invalid.len(), 1);
        assert_eq!(invalid[0].name, "outbox.batch_size");
        assert_eq!(s.report_key, None);
        assert!(s.keys.dispatched && s.keys.failed);
        assert_eq!(s.broker.url, "amqp://a;amqp://b");
    }

    #[test]
    fn a_processing_timeout_below_the_longest_push_is_raised() {
        let (s, _) = read(&[("outbox.processing_timeout", "1s"), ("outbox.batch_size", "10000")]);
        assert_eq!(s.processing_timeout_set, Some(Duration::from_secs(1)));
        assert!(s.processing_timeout > Duration::from_secs(1));
        assert_eq!(s.pause_limit, Duration::ZERO);
    }

    #[test]
    fn kafka_waits_for_its_replicas_by_its_own_timeout() {
        let (s, _) = read(&[("outbox.broker_url", "kafka://k:9092")]);
        assert_eq!(s.broker.kafka.request_timeout, Duration::from_secs(30));
        assert_eq!(s.broker.kafka.mechanism, Mechanism::ScramSha512);
        assert!(!s.broker.kafka.plain_cleartext);
        let (redis, _) = read(&[]);
        assert_eq!(
            longest_push(&s.broker, 100, 1024 * 1024),
            longest_push(&redis.broker, 100, 1024 * 1024) + Duration::from_secs(30)
        );
        let (s, _) = read(&[("outbox.broker_url", "kafka://k"), ("outbox.kafka_request_timeout", "2min")]);
        assert_eq!(s.broker.kafka.request_timeout, Duration::from_secs(120));
    }

    #[test]
    fn kafkas_choices_are_read_by_name() {
        let (s, _) = read(&[("outbox.broker_url", "kafka://k")]);
        assert_eq!(s.broker.kafka.compression, Compression::None);
        assert_eq!(s.broker.kafka.form, Form::default());
        for (name, codec) in
            [("lz4", Compression::Lz4), ("zstd", Compression::Zstd), ("none", Compression::None)]
        {
            let (s, _) = read(&[("outbox.broker_url", "kafka://k"), ("outbox.kafka_compression", name)]);
            assert_eq!(s.broker.kafka.compression, codec, "{name}");
        }
        for (name, key) in [("json", KeyForm::Json), ("string", KeyForm::String)] {
            let (s, _) = read(&[("outbox.broker_url", "kafka://k"), ("outbox.kafka_key_format", name)]);
            assert_eq!(s.broker.kafka.form.key, key, "{name}");
        }
    }

    #[test]
    fn a_former_name_is_read_while_the_new_one_is_at_its_default() {
        let (s, _) = read(&[("outbox.redis_timeout", "9s"), ("outbox.redis_tls_ca_file", "/ca.pem")]);
        assert_eq!(s.broker.timeout, Duration::from_secs(9));
        assert_eq!(s.broker.tls_ca_file, Some(PathBuf::from("/ca.pem")));
        assert_eq!(s.broker.password_file, None);
        assert_eq!(s.deprecated, ["outbox.redis_timeout", "outbox.redis_tls_ca_file"]);

        let (s, _) = read(&[("outbox.redis_timeout", "9s"), ("outbox.broker_timeout", "2s")]);
        assert_eq!(s.broker.timeout, Duration::from_secs(2), "the new name wins");
        assert!(s.deprecated.is_empty());

        let (s, _) = read(&[("outbox.redis_timeout", "5s"), ("outbox.broker_password_file", "")]);
        assert!(s.deprecated.is_empty(), "a former name at its default is not read");

        let (s, invalid) = read(&[("outbox.redis_timeout", "9s"), ("outbox.broker_timeout", "soon")]);
        assert_eq!(s.broker.timeout, Duration::from_secs(5), "a refused new name is its default");
        assert_eq!(invalid.len(), 1);
        assert!(s.deprecated.is_empty());
    }
}
