//! Every `outbox.*` setting, and [`Settings`], the plain snapshot of them a
//! dispatcher works from between two reloads.
//!
//! Ranges are enforced by PostgreSQL itself, which names the setting and
//! its limits when a value is refused. Values that cannot be checked by a
//! range (the broker URL, the database) are checked where they are used,
//! and a bad one shows in `outbox.workers.last_error` instead of taking the
//! server down.

use std::ffi::{CStr, CString};
use std::time::Duration;

use outbox_core::databases::Served;
use outbox_core::guc;
use pgrx::guc::{GucContext, GucFlags, GucRegistry, GucSetting, PostgresGucEnum};

/// Upper bound of `outbox.workers`: the dispatcher slots in shared memory
/// per database.
pub const MAX_WORKERS: usize = 32;

/// The most databases served at once: groups of slots in shared memory.
pub const MAX_DATABASES: usize = 32;

pub static DATABASE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.database")));
pub static WORKERS: GucSetting<i32> = GucSetting::<i32>::new(guc::int_default("outbox.workers"));
pub static ENABLED: GucSetting<bool> = GucSetting::<bool>::new(guc::flag_default("outbox.enabled"));
pub static BROKER_URL: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.broker_url")));
/// `outbox.redis_url`, the former name of `outbox.broker_url`.
pub static REDIS_URL: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.redis_url")));
pub static AMQP_QUEUE_TYPE: GucSetting<AmqpQueueType> =
    GucSetting::<AmqpQueueType>::new(AmqpQueueType::Classic);
pub static AMQP_MAX_PRIORITY: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.amqp_max_priority"));
pub static BROKER_PASSWORD_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.broker_password_file")));
pub static BROKER_TLS_CA_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.broker_tls_ca_file")));
pub static BROKER_TLS_CERT_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.broker_tls_cert_file")));
pub static BROKER_TLS_KEY_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.broker_tls_key_file")));
pub static DEFAULT_QUEUE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.default_queue")));
pub static BATCH_SIZE: GucSetting<i32> = GucSetting::<i32>::new(guc::int_default("outbox.batch_size"));
pub static POLL_INTERVAL_MS: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.poll_interval"));
pub static LINGER_MS: GucSetting<i32> = GucSetting::<i32>::new(guc::int_default("outbox.linger"));
pub static MAX_RETRIES: GucSetting<i32> = GucSetting::<i32>::new(guc::int_default("outbox.max_retries"));
pub static RETRY_BACKOFF_MS: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.retry_backoff"));
pub static RECONNECT_DELAY_MIN_MS: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.reconnect_delay_min"));
pub static RECONNECT_DELAY_MAX_MS: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.reconnect_delay_max"));
pub static BROKER_TIMEOUT_MS: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.broker_timeout"));
/// The former names of `outbox.broker_timeout`, `outbox.broker_password_file`
/// and `outbox.broker_tls_ca_file` (`guc::RENAMED`), deprecated.
static REDIS_TIMEOUT_MS: GucSetting<i32> = GucSetting::<i32>::new(guc::int_default("outbox.redis_timeout"));
static REDIS_PASSWORD_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.redis_password_file")));
static REDIS_TLS_CA_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.redis_tls_ca_file")));
pub static PROCESSING_TIMEOUT_S: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.processing_timeout"));
pub static ACK_TIMEOUT_S: GucSetting<i32> = GucSetting::<i32>::new(guc::int_default("outbox.ack_timeout"));
pub static MAX_REDELIVERIES: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.max_redeliveries"));
pub static SWEEP_INTERVAL_S: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.sweep_interval"));
pub static RETENTION_S: GucSetting<i32> = GucSetting::<i32>::new(guc::int_default("outbox.retention"));
pub static LIFECYCLE_INTERVAL_S: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.lifecycle_interval"));
pub static HEARTBEAT_INTERVAL_S: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.heartbeat_interval"));
pub static NOTIFY: GucSetting<bool> = GucSetting::<bool>::new(guc::flag_default("outbox.notify"));
/// Read by the insert triggers' WHEN clauses alone (sql/rotation.sql).
static MOVING: GucSetting<bool> = GucSetting::<bool>::new(guc::flag_default("outbox.moving"));
pub static NOTIFY_CHANNEL: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.notify_channel")));
pub static MAX_PAYLOAD_BYTES: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.max_payload_bytes"));
pub static REDIS_SENTINEL_MASTER: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.redis_sentinel_master")));
pub static REDIS_SENTINEL_PASSWORD_FILE: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.redis_sentinel_password_file")));
pub static REDIS_WAIT_REPLICAS: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.redis_wait_replicas"));
pub static REDIS_KEY_PREFIX: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.redis_key_prefix")));
pub static PRIORITY_STEPS: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.priority_steps")));
pub static PRIORITY_SEPARATOR: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.priority_separator")));
pub static REPORT_KEY: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.report_key")));
pub static MAX_BATCH_BYTES_KB: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.max_batch_bytes"));
pub static STATEMENT_TIMEOUT_MS: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.statement_timeout"));
pub static REPORT_TIMEOUT_S: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.report_timeout"));
pub static INBOX_RETENTION_S: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.inbox_retention"));
pub static KEY_ON_FAILURE: GucSetting<KeyOnFailure> = GucSetting::<KeyOnFailure>::new(KeyOnFailure::Block);
pub static KAFKA_TOPIC: GucSetting<Option<CString>> =
    GucSetting::<Option<CString>>::new(Some(guc::text_default("outbox.kafka_topic")));
pub static KAFKA_TOMBSTONES: GucSetting<bool> =
    GucSetting::<bool>::new(guc::flag_default("outbox.kafka_tombstones"));
pub static KAFKA_SASL_MECHANISM: GucSetting<SaslMechanism> =
    GucSetting::<SaslMechanism>::new(SaslMechanism::ScramSha512);
pub static KAFKA_SASL_PLAIN_CLEARTEXT: GucSetting<bool> =
    GucSetting::<bool>::new(guc::flag_default("outbox.kafka_sasl_plain_cleartext"));
pub static KAFKA_REQUEST_TIMEOUT_MS: GucSetting<i32> =
    GucSetting::<i32>::new(guc::int_default("outbox.kafka_request_timeout"));
pub static KAFKA_COMPRESSION: GucSetting<KafkaCompression> =
    GucSetting::<KafkaCompression>::new(KafkaCompression::None);
pub static KAFKA_KEY_FORMAT: GucSetting<KafkaKeyFormat> =
    GucSetting::<KafkaKeyFormat>::new(KafkaKeyFormat::String);

/// `outbox.key_on_failure`: what a dead-lettered head does to its key.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum KeyOnFailure {
    /// It holds the key until `outbox_retry()` or `outbox_skip()`.
    #[name = c"block"]
    Block,
    /// It lets the key go, as a finished event does.
    #[name = c"continue"]
    Continue,
}

/// `outbox.amqp_queue_type`: the kind of queue declared on RabbitMQ.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum AmqpQueueType {
    #[name = c"classic"]
    Classic,
    #[name = c"quorum"]
    Quorum,
}

/// `outbox.kafka_sasl_mechanism`: how a user the Kafka URL names
/// authenticates.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum SaslMechanism {
    #[name = c"scram-sha-512"]
    ScramSha512,
    #[name = c"scram-sha-256"]
    ScramSha256,
    #[name = c"plain"]
    Plain,
}

/// `outbox.kafka_compression`: the codec of the record batches produced.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum KafkaCompression {
    #[name = c"none"]
    None,
    #[name = c"lz4"]
    Lz4,
    #[name = c"zstd"]
    Zstd,
}

/// `outbox.kafka_key_format`: the bytes of a record's key.
#[derive(PostgresGucEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum KafkaKeyFormat {
    #[name = c"string"]
    String,
    #[name = c"json"]
    Json,
}

/// The kind of a setting and its storage (whose default is the static's,
/// taken from `outbox_core::guc`, as are the ranges and units).
enum Value {
    Bool(&'static GucSetting<bool>),
    Int(&'static GucSetting<i32>),
    Text(&'static GucSetting<Option<CString>>),
    /// `outbox.database`: text whose value is checked as it is set.
    Databases(&'static GucSetting<Option<CString>>),
    OnFailure(&'static GucSetting<KeyOnFailure>),
    QueueType(&'static GucSetting<AmqpQueueType>),
    Mechanism(&'static GucSetting<SaslMechanism>),
    Codec(&'static GucSetting<KafkaCompression>),
    KeyFormat(&'static GucSetting<KafkaKeyFormat>),
}

/// One setting: name, context, flags, value, description.
struct Declaration(&'static CStr, GucContext, GucFlags, Value, &'static CStr);

use GucContext::{Postmaster, Sighup, Suset, Userset};
use Value::{Bool, Codec, Databases, Int, KeyFormat, Mechanism, OnFailure, QueueType, Text};

const NONE: GucFlags = GucFlags::empty();
const SECRET: GucFlags = GucFlags::SUPERUSER_ONLY;

/// Every setting, one line each; the settings table of
/// docs/reference/settings.md is checked against them
/// (tests/test_settings.py).
#[rustfmt::skip]
const DECLARATIONS: [Declaration; 53] = [
    Declaration(c"outbox.workers", Sighup, NONE, Int(&WORKERS),
        c"Dispatchers per database served (each takes a max_worker_processes slot, as does the launcher)."),
    Declaration(c"outbox.database", Sighup, NONE, Databases(&DATABASE),
        c"Databases served: one name, a comma-separated list, or * for every database that has the extension."),
    Declaration(c"outbox.enabled", Sighup, NONE, Bool(&ENABLED),
        c"Dispatch events; off pauses the dispatchers without a restart."),
    Declaration(c"outbox.broker_url", Sighup, SECRET, Text(&BROKER_URL),
        c"Broker URL: redis://, rediss://, sentinel://, amqp://, amqps://, kafka:// or kafkas://; empty: outbox.redis_url. May hold a password: superusers only."),
    Declaration(c"outbox.redis_url", Sighup, SECRET, Text(&REDIS_URL),
        c"The former name of outbox.broker_url, used while that is empty."),
    Declaration(c"outbox.broker_password_file", Sighup, SECRET, Text(&BROKER_PASSWORD_FILE),
        c"File holding the broker password (first line); keeps it out of outbox.broker_url and the server log."),
    Declaration(c"outbox.broker_tls_ca_file", Sighup, NONE, Text(&BROKER_TLS_CA_FILE),
        c"PEM file of the certificate authorities trusted for rediss://, amqps:// and kafkas:// URLs; empty: the system's."),
    Declaration(c"outbox.broker_tls_cert_file", Sighup, NONE, Text(&BROKER_TLS_CERT_FILE),
        c"PEM file of the client certificate (its chain) sent to a TLS broker that asks for one; with outbox.broker_tls_key_file."),
    Declaration(c"outbox.broker_tls_key_file", Sighup, NONE, Text(&BROKER_TLS_KEY_FILE),
        c"PEM file of the private key of outbox.broker_tls_cert_file (unencrypted)."),
    Declaration(c"outbox.redis_sentinel_master", Sighup, NONE, Text(&REDIS_SENTINEL_MASTER),
        c"For sentinel:// URLs: the name of the master at the sentinels (kombu's master_name)."),
    Declaration(c"outbox.redis_sentinel_password_file", Sighup, SECRET, Text(&REDIS_SENTINEL_PASSWORD_FILE),
        c"File holding the sentinels' own password (first line), when they require one."),
    Declaration(c"outbox.redis_wait_replicas", Sighup, NONE, Int(&REDIS_WAIT_REPLICAS),
        c"Replicas that must confirm each push (WAIT) before its events count as dispatched; 0: none."),
    Declaration(c"outbox.redis_key_prefix", Sighup, NONE, Text(&REDIS_KEY_PREFIX),
        c"Prefix of every Redis key (kombu's global_keyprefix)."),
    Declaration(c"outbox.priority_steps", Sighup, NONE, Text(&PRIORITY_STEPS),
        c"Priority lists, comma-separated, starting at 0 (kombu's priority_steps)."),
    Declaration(c"outbox.priority_separator", Sighup, NONE, Text(&PRIORITY_SEPARATOR),
        c"Between a queue's name and its priority step (kombu's sep); empty: kombu's \\x06\\x16."),
    Declaration(c"outbox.default_queue", Userset, NONE, Text(&DEFAULT_QUEUE),
        c"Queue of events enqueued without one."),
    Declaration(c"outbox.batch_size", Sighup, NONE, Int(&BATCH_SIZE),
        c"Events claimed per batch."),
    Declaration(c"outbox.max_batch_bytes", Sighup, NONE, Int(&MAX_BATCH_BYTES_KB),
        c"Most bytes of messages pushed in one round trip; larger batches take several."),
    Declaration(c"outbox.poll_interval", Sighup, NONE, Int(&POLL_INTERVAL_MS),
        c"Safety poll: the longest a dispatcher sleeps without a wake."),
    Declaration(c"outbox.linger", Sighup, NONE, Int(&LINGER_MS),
        c"After a claim that took every event in line, the next waits this long from its start, so that the events of commits in a stream go in one claim and push; 0: a claim per wake."),
    Declaration(c"outbox.max_retries", Sighup, NONE, Int(&MAX_RETRIES),
        c"Failed pushes of one event before it is dead-lettered."),
    Declaration(c"outbox.retry_backoff", Sighup, NONE, Int(&RETRY_BACKOFF_MS),
        c"Base of the exponential backoff between retries of one event."),
    Declaration(c"outbox.reconnect_delay_min", Sighup, NONE, Int(&RECONNECT_DELAY_MIN_MS),
        c"Shortest wait before reconnecting to the broker."),
    Declaration(c"outbox.reconnect_delay_max", Sighup, NONE, Int(&RECONNECT_DELAY_MAX_MS),
        c"Longest wait before reconnecting to the broker."),
    Declaration(c"outbox.broker_timeout", Sighup, NONE, Int(&BROKER_TIMEOUT_MS),
        c"Deadline of each broker operation: a connect, one round trip of a push, a PING."),
    Declaration(c"outbox.processing_timeout", Sighup, NONE, Int(&PROCESSING_TIMEOUT_S),
        c"Claims older than this are stuck: the sweeper returns them to pending."),
    Declaration(c"outbox.ack_timeout", Sighup, NONE, Int(&ACK_TIMEOUT_S),
        c"Dispatched events not acknowledged within this are sent again; 0 (the default) turns acknowledgements off."),
    Declaration(c"outbox.max_redeliveries", Sighup, NONE, Int(&MAX_REDELIVERIES),
        c"Re-sends of an unacknowledged event before it is failed."),
    Declaration(c"outbox.statement_timeout", Sighup, NONE, Int(&STATEMENT_TIMEOUT_MS),
        c"Longest a dispatcher's statement may run; it is then cancelled and tried again later."),
    Declaration(c"outbox.sweep_interval", Sighup, NONE, Int(&SWEEP_INTERVAL_S),
        c"Period of the stuck and unacknowledged sweepers."),
    Declaration(c"outbox.retention", Sighup, NONE, Int(&RETENTION_S),
        c"Finished events are kept at least this long after their generation ended: each is current for half of it, then truncated once it ended this long ago."),
    Declaration(c"outbox.lifecycle_interval", Sighup, NONE, Int(&LIFECYCLE_INTERVAL_S),
        c"Period of the rotation's steps (advance, moves, truncation) and of the inbox's purge."),
    Declaration(c"outbox.heartbeat_interval", Sighup, NONE, Int(&HEARTBEAT_INTERVAL_S),
        c"Period of the broker PING while idle."),
    Declaration(c"outbox.report_key", Sighup, NONE, Text(&REPORT_KEY),
        c"Redis list or AMQP queue Celery workers running outbox_dispatch.celery report outcomes to; empty: none asked for or read."),
    Declaration(c"outbox.report_timeout", Sighup, NONE, Int(&REPORT_TIMEOUT_S),
        c"A dispatched event not reported by a worker within this is listed in outbox.unreported; 0: never."),
    Declaration(c"outbox.notify", Userset, NONE, Bool(&NOTIFY),
        c"Inserts into outbox.events also NOTIFY outbox.notify_channel (serializes commits on one lock)."),
    Declaration(c"outbox.notify_channel", Userset, NONE, Text(&NOTIFY_CHANNEL),
        c"Channel of that NOTIFY."),
    Declaration(c"outbox.max_payload_bytes", Suset, NONE, Int(&MAX_PAYLOAD_BYTES),
        c"Largest payload outbox_enqueue() accepts (its jsonb size); dispatchers do not check it again."),
    Declaration(c"outbox.inbox_retention", Sighup, NONE, Int(&INBOX_RETENTION_S),
        c"Messages claimed with outbox_inbox_claim() are remembered this long: longer than any may come again."),
    Declaration(c"outbox.amqp_queue_type", Sighup, NONE, QueueType(&AMQP_QUEUE_TYPE),
        c"RabbitMQ: queues declared as classic or quorum (Celery's task_default_queue_type)."),
    Declaration(c"outbox.amqp_max_priority", Sighup, NONE, Int(&AMQP_MAX_PRIORITY),
        c"RabbitMQ: x-max-priority of the queues declared (Celery's task_queue_max_priority); 0: none."),
    Declaration(c"outbox.moving", Suset, NONE, Bool(&MOVING),
        c"Set by the rotation, for its own transaction, while it moves events to the current generation: the insert triggers leave them as they are. Not for use."),
    Declaration(c"outbox.key_on_failure", Sighup, NONE, OnFailure(&KEY_ON_FAILURE),
        c"A dead-lettered event with an ordering_key: block its key until outbox_retry() or outbox_skip(), or continue."),
    Declaration(c"outbox.kafka_topic", Sighup, NONE, Text(&KAFKA_TOPIC),
        c"Kafka: the topic of an event, a name with {event_type} and {queue} in it as wanted (Debezium's route.topic.replacement)."),
    Declaration(c"outbox.kafka_tombstones", Sighup, NONE, Bool(&KAFKA_TOMBSTONES),
        c"Kafka: an event with an ordering_key and a null payload is sent as a tombstone (a record without a value)."),
    Declaration(c"outbox.kafka_sasl_mechanism", Sighup, NONE, Mechanism(&KAFKA_SASL_MECHANISM),
        c"Kafka: how the user named in outbox.broker_url authenticates: scram-sha-512, scram-sha-256 or plain."),
    Declaration(c"outbox.kafka_sasl_plain_cleartext", Sighup, NONE, Bool(&KAFKA_SASL_PLAIN_CLEARTEXT),
        c"Kafka: SASL PLAIN may send the password over kafka:// in clear text; off refuses it (use kafkas:// or SCRAM)."),
    Declaration(c"outbox.kafka_request_timeout", Sighup, NONE, Int(&KAFKA_REQUEST_TIMEOUT_MS),
        c"Kafka: how long the broker may take to answer a produce request (acks=all waiting for its replicas)."),
    Declaration(c"outbox.kafka_compression", Sighup, NONE, Codec(&KAFKA_COMPRESSION),
        c"Kafka: the codec of the record batches produced: none, lz4 or zstd (zstd needs Kafka 2.1 or later)."),
    Declaration(c"outbox.kafka_key_format", Sighup, NONE, KeyFormat(&KAFKA_KEY_FORMAT),
        c"Kafka: a record's key as Kafka Connect's StringConverter writes it (string) or JsonConverter without schemas (json)."),
    Declaration(c"outbox.redis_timeout", Sighup, NONE, Int(&REDIS_TIMEOUT_MS),
        c"Deprecated: the former name of outbox.broker_timeout, read while that is at its default."),
    Declaration(c"outbox.redis_password_file", Sighup, SECRET, Text(&REDIS_PASSWORD_FILE),
        c"Deprecated: the former name of outbox.broker_password_file, read while that is empty."),
    Declaration(c"outbox.redis_tls_ca_file", Sighup, NONE, Text(&REDIS_TLS_CA_FILE),
        c"Deprecated: the former name of outbox.broker_tls_ca_file, read while that is empty."),
];

/// Defines the settings. The postmaster-only ones only while preloading
/// (PostgreSQL refuses them once the server runs); the others in every
/// process that loads the library, so that `SET`, `SHOW` and the trigger
/// see them. Then reserves the `outbox.` prefix (when preloading): a
/// misspelled `outbox.*` line in postgresql.conf is reported, not silently
/// kept as a placeholder.
pub fn register(preloading: bool) {
    for Declaration(name, context, flags, value, description) in DECLARATIONS {
        if matches!(context, Postmaster) && !preloading {
            continue;
        }
        match value {
            Bool(setting) => GucRegistry::define_bool_guc(name, description, c"", setting, context, flags),
            Int(setting) => {
                let (min, max, unit) = range(name);
                GucRegistry::define_int_guc(name, description, c"", setting, min, max, context, flags | unit)
            }
            Text(setting) => GucRegistry::define_string_guc(name, description, c"", setting, context, flags),
            OnFailure(setting) => {
                GucRegistry::define_enum_guc(name, description, c"", setting, context, flags)
            }
            QueueType(setting) => {
                GucRegistry::define_enum_guc(name, description, c"", setting, context, flags)
            }
            Mechanism(setting) => {
                GucRegistry::define_enum_guc(name, description, c"", setting, context, flags)
            }
            Codec(setting) => GucRegistry::define_enum_guc(name, description, c"", setting, context, flags),
            KeyFormat(setting) => {
                GucRegistry::define_enum_guc(name, description, c"", setting, context, flags)
            }
            // SAFETY: a check hook that only parses the value.
            Databases(setting) => unsafe {
                GucRegistry::define_string_guc_with_hooks(
                    name,
                    description,
                    c"",
                    setting,
                    context,
                    flags,
                    Some(check_databases),
                    None,
                    None,
                )
            },
        }
    }
    if preloading {
        // SAFETY: called once every setting is defined.
        unsafe { pgrx::pg_sys::MarkGUCPrefixReserved(c"outbox".as_ptr()) };
    }
}

/// The range and unit `outbox_core::guc` declares of the integer setting
/// `name`.
fn range(name: &CStr) -> (i32, i32, GucFlags) {
    let declared = name.to_str().ok().and_then(guc::declared);
    let Some(&guc::Declared { kind: guc::Kind::Int { min, max, unit, .. }, .. }) = declared else {
        panic!("{name:?} is not an integer setting of outbox_core::guc");
    };
    let unit = match unit {
        guc::Unit::None => NONE,
        guc::Unit::Bytes => GucFlags::UNIT_BYTE,
        guc::Unit::Kb => GucFlags::UNIT_KB,
        guc::Unit::Ms => GucFlags::UNIT_MS,
        guc::Unit::S => GucFlags::UNIT_S,
    };
    (min, max, unit)
}

/// Refuses a value of `outbox.database` that does not parse, saying why.
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn check_databases(
    value: *mut *mut std::ffi::c_char,
    _extra: *mut *mut std::ffi::c_void,
    _source: pgrx::pg_sys::GucSource::Type,
) -> bool {
    let text = if value.is_null() || (*value).is_null() {
        String::new()
    } else {
        CStr::from_ptr(*value).to_string_lossy().into_owned()
    };
    match Served::parse(&text) {
        Ok(_) => true,
        Err(e) => {
            let detail = CString::new(e).unwrap_or_default();
            pgrx::pg_sys::GUC_check_errdetail_string = pgrx::pg_sys::pstrdup(detail.as_ptr());
            false
        }
    }
}

/// Both `outbox.broker_url` and `outbox.redis_url` are set, and differ.
pub fn broker_url_conflict() -> bool {
    let (broker, redis) = (text(&BROKER_URL), text(&REDIS_URL));
    !broker.is_empty()
        && redis != broker
        && redis.as_bytes() != guc::text_default("outbox.redis_url").to_bytes()
}

/// The settings that hold a broker URL, with their values: what the server
/// log must show only redacted (`secrets.rs`).
pub fn url_settings() -> [(&'static str, String); 2] {
    [("outbox.broker_url", text(&BROKER_URL)), ("outbox.redis_url", text(&REDIS_URL))]
}

fn text(setting: &GucSetting<Option<CString>>) -> String {
    setting.get().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()
}

fn seconds(setting: &GucSetting<i32>) -> Duration {
    Duration::from_secs(setting.get().max(0) as u64)
}

/// The value of `outbox.database`.
pub fn database() -> String {
    text(&DATABASE)
}

/// The number of dispatchers `outbox.workers` asks for.
pub fn workers() -> usize {
    WORKERS.get().clamp(0, MAX_WORKERS as i32) as usize
}

/// How long a sent event may wait for its report before it counts as
/// unreported; `None` while reports are off or the timeout is 0.
pub fn report_timeout() -> Option<Duration> {
    let timeout = seconds(&REPORT_TIMEOUT_S);
    (!text(&REPORT_KEY).is_empty() && !timeout.is_zero()).then_some(timeout)
}

pub fn notify_channel() -> Option<CString> {
    NOTIFY.get().then(|| NOTIFY_CHANNEL.get()).flatten()
}

pub use outbox_core::engine::Settings;
pub use outbox_core::store::KeyPolicy;

/// The settings as they are now; values PostgreSQL took are valid.
pub fn current() -> Settings {
    // SAFETY: a process global, set once connected.
    let database = unsafe { pgrx::pg_sys::MyDatabaseId }.to_u32();
    Settings::read(&value, database).0
}

/// The value of the setting `name` as text, in its unit.
fn value(name: &str) -> Option<String> {
    let name = CString::new(name).ok()?;
    // SAFETY: a declared setting's name; the value is copied before any
    // other GUC call.
    unsafe {
        let value = pgrx::pg_sys::GetConfigOption(name.as_ptr(), true, false);
        (!value.is_null()).then(|| CStr::from_ptr(value).to_string_lossy().into_owned())
    }
}
