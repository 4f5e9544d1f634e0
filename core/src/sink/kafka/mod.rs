//! Kafka: committed events as records of Kafka topics, routed as
//! Debezium's outbox event router routes them (`route.rs`, `record.rs`),
//! produced by an idempotent producer with `acks=all` (`produce.rs`) to
//! the partitions' leaders the cluster's metadata names (`metadata.rs`),
//! over connections of our own (`wire.rs`, SASL in `sasl.rs`). An event is
//! delivered when its partition's answer says so, and only then; whose
//! fault a refusal is, `faults.rs` says.

mod faults;
mod metadata;
mod produce;
mod record;
mod route;
mod sasl;
mod wire;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kafka_protocol::messages::{ApiKey, ApiVersionsRequest};

pub use kafka_protocol::records::Compression;
pub use record::{Event, Form, KeyForm, Record, Routing};
pub use route::Topics;
pub use sasl::Mechanism;

use super::errors::scrub;
use super::secrets::password_from_file;
use super::{tls_config, BrokerConfig, Delivery, KeyBatch, Persistence, Pushed, SinkError};
use crate::broker_url::{BrokerUrl, Endpoints};
use crate::link::Wait;
use metadata::Cluster;
use produce::{Partitions, Producer};
use wire::Conn;

/// How events become Kafka records: `outbox.kafka_*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaShape {
    /// `outbox.kafka_topic`: the topic template.
    pub topic: String,
    /// `outbox.kafka_sasl_mechanism`, when the URL names a user.
    pub mechanism: Mechanism,
    /// `outbox.kafka_sasl_plain_cleartext`: PLAIN may send the password
    /// over `kafka://`, without TLS.
    pub plain_cleartext: bool,
    /// `outbox.kafka_tombstones` and `outbox.kafka_key_format`.
    pub form: Form,
    /// `outbox.kafka_request_timeout`: how long a produce request's answer
    /// may take (the broker's own deadline for `acks=all`, and ours).
    pub request_timeout: Duration,
    /// `outbox.kafka_compression`: the codec of the record batches.
    pub compression: Compression,
}

impl Default for KafkaShape {
    fn default() -> KafkaShape {
        KafkaShape {
            topic: "outbox.event.{event_type}".into(),
            mechanism: Mechanism::ScramSha512,
            plain_cleartext: false,
            form: Form::default(),
            request_timeout: Duration::from_secs(30),
            compression: Compression::None,
        }
    }
}

/// A connection's worth of state: the bootstrap connection, the leaders'
/// connections, what the metadata said, the producer (kept by the sink
/// between sessions).
struct Session {
    bootstrap: Conn,
    leaders: HashMap<i32, Conn>,
    cluster: Cluster,
    producer: Producer,
}

pub struct KafkaSink {
    config: BrokerConfig,
    url: BrokerUrl,
    display_url: String,
    topics: Topics,
    session: Option<Box<Session>>,
    /// The bootstrap server of the current or last connection.
    node: Option<String>,
    first_server: usize,
    user: Option<(String, String)>,
    /// What pushes learnt of partitions (those whose records go one per
    /// batch, those resting after refusals). Kept across connections: a
    /// push that fails otherwise must not forget them.
    partitions: Partitions,
    /// The producer of the last session, for the next: one producer id per
    /// sink, its epoch bumped for each session after the first, so that
    /// the broker refuses what an ended session left on its way.
    producer: Option<Producer>,
}

impl KafkaSink {
    pub fn new(config: &BrokerConfig, url: BrokerUrl) -> Result<KafkaSink, SinkError> {
        let topics = Topics::parse(&config.kafka.topic).map_err(SinkError::InvalidConfig)?;
        let cleartext = url.username.is_some() && config.kafka.mechanism == Mechanism::Plain && !url.tls;
        if cleartext && !config.kafka.plain_cleartext {
            return Err(SinkError::InvalidConfig(
                "SASL PLAIN over kafka:// would send the broker's password in clear text: connect with \
                 kafkas://, or take scram-sha-512 (outbox.kafka_sasl_mechanism), or allow it with \
                 outbox.kafka_sasl_plain_cleartext = on"
                    .into(),
            ));
        }
        Ok(KafkaSink {
            display_url: url.display(),
            config: config.clone(),
            url,
            topics,
            session: None,
            node: None,
            first_server: 0,
            user: None,
            partitions: Partitions::default(),
            producer: None,
        })
    }

    /// The topic of an event, or why it has none (its own fault).
    pub fn topic(&self, event_type: &str, queue: &str) -> Result<String, String> {
        self.topics.topic(event_type, queue).map_err(|e| e.to_string())
    }

    pub fn form(&self) -> Form {
        self.config.kafka.form
    }

    pub fn master(&self) -> Option<&str> {
        self.node.as_deref()
    }

    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    pub fn is_connected(&self) -> bool {
        self.session.is_some()
    }

    /// Ends the session, its producer kept for the next one.
    pub fn disconnect(&mut self) {
        if let Some(session) = self.session.take() {
            self.keep(session.producer);
        }
    }

    /// Keeps `producer` for the next session, which goes under its next
    /// epoch: whatever this one left unanswered may still arrive.
    fn keep(&mut self, mut producer: Producer) {
        producer.stale = true;
        self.producer = Some(producer);
    }

    /// Connects to the first bootstrap server that takes the connection,
    /// in the URL's order from the last one that took one: TCP, TLS, the
    /// versions, SASL when the URL names a user, and a producer id
    /// (InitProducerId) or the last session's under its next epoch, each
    /// server within one timeout.
    pub fn connect(&mut self, waiter: &mut dyn Wait) -> Result<Persistence, SinkError> {
        self.disconnect();
        let password = match &self.config.password_file {
            Some(path) => Some(password_from_file("outbox.broker_password_file", path)?),
            None => self.url.password.clone(),
        };
        self.user = self.url.username.clone().map(|user| (user, password.unwrap_or_default()));
        let servers = self.servers().to_vec();
        let mut failure = SinkError::Connect("no bootstrap server".into());
        for turn in 0..servers.len() {
            let index = (self.first_server + turn) % servers.len();
            let (host, port) = &servers[index];
            self.node = Some(format!("{host}:{port}"));
            let deadline = Instant::now() + self.config.timeout;
            match self.open(host, *port, waiter, deadline).and_then(|conn| self.start(conn, waiter, deadline))
            {
                Ok(session) => {
                    self.session = Some(Box::new(session));
                    self.first_server = index;
                    return Ok(Persistence::Durable);
                }
                Err(SinkError::Interrupted) => return Err(SinkError::Interrupted),
                Err(e) => failure = e,
            }
        }
        Err(failure)
    }

    /// The bootstrap servers, in the URL's order.
    fn servers(&self) -> &[(String, u16)] {
        let Endpoints::Kafka(servers) = &self.url.endpoints else {
            unreachable!("a Kafka sink has Kafka servers")
        };
        servers
    }

    /// Replaces the connections of `session` whose SASL session is near
    /// its end (KIP-368), before the broker closes them: a leader's is
    /// dropped (a push opens it again when it needs it), the bootstrap one
    /// opened again to the same server, authenticating anew. Between
    /// pushes nothing is in flight on them.
    fn refresh(&self, session: &mut Session, waiter: &mut dyn Wait) -> Result<(), SinkError> {
        session.leaders.retain(|_, conn| !conn.expiring());
        if session.bootstrap.expiring() {
            session.bootstrap = self.reopen(waiter, Instant::now() + self.config.timeout)?;
        }
        Ok(())
    }

    /// A new connection to the bootstrap server of the session, by
    /// `deadline`.
    fn reopen(&self, waiter: &mut dyn Wait, deadline: Instant) -> Result<Conn, SinkError> {
        let (host, port) = &self.servers()[self.first_server];
        self.open(host, *port, waiter, deadline)
    }

    /// A connection to one broker, authenticated, by `deadline`.
    fn open(
        &self,
        host: &str,
        port: u16,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Conn, SinkError> {
        let tls = self.url.tls.then(|| tls_config(&self.config)).transpose()?;
        let mut conn = Conn::open(host, port, tls, waiter, deadline)?;
        produce::codec_spoken(self.config.kafka.compression, conn.versions.of(ApiKey::Produce)?)?;
        if let Some((user, password)) = &self.user {
            conn.authenticate(self.config.kafka.mechanism, user, password, waiter, deadline).map_err(
                |e| match e {
                    SinkError::Connect(text) => SinkError::Connect(scrub(&text, &[Some(password)])),
                    other => other,
                },
            )?;
        }
        Ok(conn)
    }

    fn start(
        &mut self,
        mut bootstrap: Conn,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<Session, SinkError> {
        let mut producer = match self.producer.take() {
            Some(kept) => kept,
            None => Producer::fresh(&mut bootstrap, waiter, deadline)?,
        };
        if let Err(e) = producer.renew(&mut bootstrap, waiter, deadline) {
            self.producer = Some(producer);
            return Err(e);
        }
        Ok(Session { bootstrap, leaders: HashMap::new(), cluster: Cluster::default(), producer })
    }

    /// The deadline of one step of a push that must be done by `until`: a
    /// timeout from now, or `until`; a timeout when that has passed.
    fn step(&self, until: Instant) -> Result<Instant, SinkError> {
        self.due(Instant::now() + self.config.timeout, until)
    }

    /// The deadline of the answer to a produce request sent at `sent`, the
    /// answer before it on its connection having come at `last`, in a push
    /// that must be done by `until`: the broker may hold it
    /// `outbox.kafka_request_timeout` (`acks=all` waiting for the
    /// replicas), and its way back takes up to a timeout; and a timeout
    /// after the answer before it, as for any step.
    fn answer_due(&self, sent: Instant, last: Instant, until: Instant) -> Result<Instant, SinkError> {
        let held = sent + self.config.kafka.request_timeout + self.config.timeout;
        self.due(held.max(last + self.config.timeout), until)
    }

    fn due(&self, deadline: Instant, until: Instant) -> Result<Instant, SinkError> {
        let deadline = deadline.min(until);
        if Instant::now() >= deadline {
            return Err(SinkError::Timeout);
        }
        Ok(deadline)
    }

    /// An ApiVersions round trip on every connection: any answer proves
    /// it. Drops the connections when one fails.
    pub fn ping(&mut self, waiter: &mut dyn Wait) -> Result<(), SinkError> {
        let Some(mut session) = self.session.take() else {
            return Err(SinkError::ConnectionLost("not connected".into()));
        };
        let result = self.refresh(&mut session, waiter).and_then(|()| {
            std::iter::once(&mut session.bootstrap).chain(session.leaders.values_mut()).try_for_each(|conn| {
                let deadline = Instant::now() + self.config.timeout;
                conn.call(&ApiVersionsRequest::default(), 0, waiter, deadline).map(drop)
            })
        });
        match result {
            Ok(()) => self.session = Some(session),
            Err(_) => self.keep(session.producer),
        }
        result
    }

    /// Produces every batch (`key`: its topic) and says what became of each
    /// record, in order. A connection that fails part way loses only what
    /// it had not answered, and the session with it. The push as a whole
    /// takes less than `outbox.processing_timeout`'s floor counts for it: a
    /// timeout, one per `outbox.max_batch_bytes` of records, and
    /// `outbox.kafka_request_timeout` (the requests in flight wait for
    /// their replicas together); what is not sent by then goes back to
    /// pending, unsent.
    pub fn push(&mut self, batches: &[KeyBatch<Record>], waiter: &mut dyn Wait) -> Pushed {
        let total = batches.iter().map(|b| b.messages.len()).sum();
        let mut deliveries = vec![Delivery::Unsent; total];
        let Some(mut session) = self.session.take() else {
            return Pushed { deliveries, failure: Some(SinkError::ConnectionLost("not connected".into())) };
        };
        let bytes: usize = batches.iter().flat_map(|b| &b.messages).map(Record::size).sum();
        let trips = bytes.div_ceil(self.config.max_batch_bytes.max(1)).max(1);
        // A timeout fewer than the floor counts, for the claim before the
        // push and the marks after it.
        let until = Instant::now()
            + self.config.timeout.saturating_mul(1 + trips.min(u32::MAX as usize) as u32)
            + self.config.kafka.request_timeout;
        let mut partitions = std::mem::take(&mut self.partitions);
        let failure = self
            .refresh(&mut session, waiter)
            .and_then(|()| {
                produce::produce(self, &mut session, &mut partitions, batches, &mut deliveries, waiter, until)
            })
            .err();
        self.partitions = partitions;
        let lost = matches!(
            failure,
            Some(
                SinkError::ConnectionLost(_)
                    | SinkError::Timeout
                    | SinkError::Interrupted
                    | SinkError::Connect(_)
            )
        );
        if lost {
            self.keep(session.producer);
        } else {
            self.session = Some(session);
        }
        Pushed { deliveries, failure }
    }
}
