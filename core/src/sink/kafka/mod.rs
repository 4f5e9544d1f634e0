//! Kafka: committed events as records of Kafka topics, routed as
//! Debezium's outbox event router routes them (`route.rs`, `record.rs`),
//! produced by an idempotent producer with `acks=all`.
//!
//! A push asks the bootstrap connection for the metadata of topics it has
//! not seen (or saw change), puts each record in the partition its key
//! hashes to, cuts each partition's records into record batches of at most
//! `outbox.max_batch_bytes`, and sends each partition leader its batches,
//! up to five produce requests in flight on a connection, as Kafka's
//! idempotent producer allows without losing order. An event is delivered
//! when its partition's answer says so, and only then.
//!
//! Sequence numbers are kept per partition from the producer id given at
//! connect. When a batch fails, the next push starts with a fresh producer
//! id (so that its sequences start again at 0), and the partition's later
//! batches of the same push, which the broker must then refuse as out of
//! order, go back to pending as unsent.

mod record;
mod route;
mod sasl;
mod wire;

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use bytes::BytesMut;
use kafka_protocol::indexmap::IndexMap;
use kafka_protocol::messages::metadata_request::MetadataRequestTopic;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::{
    ApiKey, ApiVersionsRequest, InitProducerIdRequest, MetadataRequest, MetadataResponse, ProduceRequest,
    ProduceResponse, TopicName,
};
use kafka_protocol::protocol::StrBytes;
use kafka_protocol::records::{Compression, RecordBatchEncoder, RecordEncodeOptions, TimestampType};

pub use record::{Event, Record};
pub use route::Topics;
pub use sasl::Mechanism;

use super::errors::{broker_text, scrub};
use super::secrets::password_from_file;
use super::{tls_config, BrokerConfig, Condition, Delivery, KeyBatch, Persistence, Pushed, SinkError};
use crate::broker_url::{BrokerUrl, Endpoints};
use crate::link::Wait;
use wire::{failed, Conn};

/// How events become Kafka records: `outbox.kafka_*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaShape {
    /// `outbox.kafka_topic`: the topic template.
    pub topic: String,
    /// `outbox.kafka_sasl_mechanism`, when the URL names a user.
    pub mechanism: Mechanism,
    /// `outbox.kafka_tombstones`: a keyed event with a `null` payload is
    /// sent as a tombstone.
    pub tombstones: bool,
}

impl Default for KafkaShape {
    fn default() -> KafkaShape {
        KafkaShape {
            topic: "outbox.event.{event_type}".into(),
            mechanism: Mechanism::Plain,
            tombstones: false,
        }
    }
}

/// Requests on a connection awaiting their answers, at most: what Kafka's
/// idempotent producer keeps in order (`max.in.flight.requests.per.connection`).
const IN_FLIGHT: usize = 5;

/// The partitions of a topic: each one's leader (`None`: none now).
type Leaders = Vec<Option<i32>>;

/// A connection's worth of state: the bootstrap connection, the leaders'
/// connections, what the metadata said, the producer's id and sequences.
struct Session {
    bootstrap: Conn,
    leaders: HashMap<i32, Conn>,
    brokers: HashMap<i32, (String, u16)>,
    topics: HashMap<String, Leaders>,
    producer: (i64, i16),
    /// The next sequence number of each partition.
    sequences: HashMap<(String, i32), i32>,
    /// A batch failed: the next push takes a fresh producer id.
    stale_producer: bool,
    /// Partitions whose last batch of several records was refused for
    /// one record's fault: their records go one per batch until one is
    /// delivered, so that only the faulty record pays for it.
    one_by_one: HashSet<(String, i32)>,
}

pub struct KafkaSink {
    config: BrokerConfig,
    url: BrokerUrl,
    display_url: String,
    topics: Topics,
    session: Option<Session>,
    /// The bootstrap server of the current or last connection.
    node: Option<String>,
    first_server: usize,
    user: Option<(String, String)>,
}

/// Whose fault a Kafka error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// The broker's or the cluster's: no retry spent.
    Broker(Condition),
    /// The record's own, or its topic's: a retry spent, then the dead
    /// letter. `split`: one record of a batch may be the cause.
    Message { split: bool },
}

/// Whose fault an error code of a produce answer is: Kafka's documented
/// meaning of each (its `Errors` table), not any one broker's habits.
fn fault(code: i16) -> Fault {
    use kafka_protocol::ResponseError as E;
    let Some(error) = E::try_from_code(code) else { return Fault::Broker(Condition::Unavailable) };
    match error {
        E::NotLeaderOrFollower
        | E::LeaderNotAvailable
        | E::FencedLeaderEpoch
        | E::UnknownLeaderEpoch
        | E::ReplicaNotAvailable
        | E::NotController
        // After a metadata answer that knew the topic: the metadata is stale.
        | E::UnknownTopicOrPartition => Fault::Broker(Condition::LeaderMoved),
        E::NotEnoughReplicas | E::NotEnoughReplicasAfterAppend => Fault::Broker(Condition::NotEnoughReplicas),
        E::MessageTooLarge | E::RecordListTooLarge | E::InvalidRecord | E::InvalidTimestamp | E::CorruptMessage => {
            Fault::Message { split: true }
        }
        E::TopicAuthorizationFailed | E::InvalidTopicException | E::PolicyViolation => Fault::Message { split: false },
        // Anything else Kafka calls retriable is a condition of the broker;
        // what it does not (a bad request, a producer the broker forgot, an
        // unknown code) is too: it is no record's doing, so it must not
        // spend a record's retries.
        _ => Fault::Broker(Condition::Unavailable),
    }
}

/// What a topic's metadata said: its partitions' leaders, or the error
/// that fails its records.
enum TopicState {
    Known(Leaders),
    Failed(Fault, String),
}

/// One partition's records in one push, in order: their places among the
/// push's messages.
struct Run {
    topic: String,
    partition: i32,
    members: Vec<usize>,
}

/// One record batch: some of a run's members.
struct Chunk {
    run: usize,
    members: std::ops::Range<usize>,
}

impl KafkaSink {
    pub fn new(config: &BrokerConfig, url: BrokerUrl) -> Result<KafkaSink, SinkError> {
        let topics = Topics::parse(&config.kafka.topic).map_err(SinkError::InvalidConfig)?;
        Ok(KafkaSink {
            display_url: url.display(),
            config: config.clone(),
            url,
            topics,
            session: None,
            node: None,
            first_server: 0,
            user: None,
        })
    }

    /// The topic of an event, or why it has none (its own fault).
    pub fn topic(&self, event_type: &str, queue: &str) -> Result<String, String> {
        self.topics.topic(event_type, queue).map_err(|e| e.to_string())
    }

    pub fn tombstones(&self) -> bool {
        self.config.kafka.tombstones
    }

    pub fn master(&self) -> Option<&str> {
        self.node.as_deref()
    }

    pub fn refusal(&self, condition: Condition, reply: String) -> SinkError {
        SinkError::Refused(condition, reply)
    }

    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    pub fn is_connected(&self) -> bool {
        self.session.is_some()
    }

    pub fn disconnect(&mut self) {
        self.session = None;
    }

    /// Connects to the first bootstrap server that takes the connection,
    /// in the URL's order from the last one that took one: TCP, TLS, the
    /// versions, SASL when the URL names a user, and a producer id
    /// (InitProducerId), each server within one timeout.
    pub fn connect(&mut self, waiter: &mut dyn Wait) -> Result<Persistence, SinkError> {
        self.session = None;
        let password = match &self.config.password_file {
            Some(path) => Some(password_from_file("outbox.redis_password_file", path)?),
            None => self.url.password.clone(),
        };
        self.user = self.url.username.clone().map(|user| (user, password.unwrap_or_default()));
        let Endpoints::Kafka(servers) = &self.url.endpoints else {
            unreachable!("a Kafka sink has Kafka servers")
        };
        let servers = servers.clone();
        let mut failure = SinkError::Connect("no bootstrap server".into());
        for turn in 0..servers.len() {
            let index = (self.first_server + turn) % servers.len();
            let (host, port) = &servers[index];
            self.node = Some(format!("{host}:{port}"));
            match self.open(host, *port, waiter).and_then(|conn| self.start(conn, waiter)) {
                Ok(session) => {
                    self.session = Some(session);
                    self.first_server = index;
                    return Ok(Persistence::Durable);
                }
                Err(SinkError::Interrupted) => return Err(SinkError::Interrupted),
                Err(e) => failure = e,
            }
        }
        Err(failure)
    }

    /// A connection to one broker, authenticated.
    fn open(&self, host: &str, port: u16, waiter: &mut dyn Wait) -> Result<Conn, SinkError> {
        let tls = self.url.tls.then(|| tls_config(self.config.tls_ca_file.as_deref())).transpose()?;
        let mut conn = Conn::open(host, port, tls, self.config.timeout, waiter)?;
        if let Some((user, password)) = &self.user {
            conn.authenticate(self.config.kafka.mechanism, user, password, waiter).map_err(|e| match e {
                SinkError::Connect(text) => SinkError::Connect(scrub(&text, &[Some(password)])),
                other => other,
            })?;
        }
        Ok(conn)
    }

    fn start(&self, mut bootstrap: Conn, waiter: &mut dyn Wait) -> Result<Session, SinkError> {
        let producer = init_producer(&mut bootstrap, waiter)?;
        Ok(Session {
            bootstrap,
            leaders: HashMap::new(),
            brokers: HashMap::new(),
            topics: HashMap::new(),
            producer,
            sequences: HashMap::new(),
            stale_producer: false,
            one_by_one: Default::default(),
        })
    }

    /// An ApiVersions round trip on every connection: any answer proves
    /// it. Drops the connections when one fails.
    pub fn ping(&mut self, waiter: &mut dyn Wait) -> Result<(), SinkError> {
        let Some(session) = self.session.as_mut() else {
            return Err(SinkError::ConnectionLost("not connected".into()));
        };
        let result = std::iter::once(&mut session.bootstrap)
            .chain(session.leaders.values_mut())
            .try_for_each(|conn| conn.call(&ApiVersionsRequest::default(), 0, waiter).map(drop));
        if result.is_err() {
            self.session = None;
        }
        result
    }

    /// Produces every batch (`key`: its topic) and says what became of each
    /// record, in order. A connection that fails part way loses only what
    /// it had not answered, and the session with it.
    pub fn push(&mut self, batches: &[KeyBatch<Record>], waiter: &mut dyn Wait) -> Pushed {
        let total = batches.iter().map(|b| b.messages.len()).sum();
        let mut deliveries = vec![Delivery::Unsent; total];
        let Some(mut session) = self.session.take() else {
            return Pushed { deliveries, failure: Some(SinkError::ConnectionLost("not connected".into())) };
        };
        let failure = self.produce(&mut session, batches, &mut deliveries, waiter).err();
        let lost = matches!(
            failure,
            Some(
                SinkError::ConnectionLost(_)
                    | SinkError::Timeout
                    | SinkError::Interrupted
                    | SinkError::Connect(_)
            )
        );
        if !lost {
            self.session = Some(session);
        }
        Pushed { deliveries, failure }
    }

    fn produce(
        &self,
        session: &mut Session,
        batches: &[KeyBatch<Record>],
        deliveries: &mut [Delivery],
        waiter: &mut dyn Wait,
    ) -> Result<(), SinkError> {
        let timeout = self.config.timeout;
        if session.stale_producer {
            session.producer = init_producer(&mut session.bootstrap, waiter)?;
            session.sequences.clear();
            session.stale_producer = false;
        }
        let wanted: Vec<&str> = batches.iter().map(|b| b.key.as_str()).collect();
        let states = session.metadata(&wanted, timeout, waiter)?;

        // Each record to its partition; each partition's records in order.
        let mut runs: Vec<Run> = Vec::new();
        let mut run_of: HashMap<(usize, i32), usize> = HashMap::new();
        let mut place = 0;
        for (b, batch) in batches.iter().enumerate() {
            let state = &states[&batch.key];
            for record in &batch.messages {
                let here = place;
                place += 1;
                let leaders = match state {
                    TopicState::Failed(fault, error) => {
                        deliveries[here] = verdict(*fault, error);
                        continue;
                    }
                    TopicState::Known(leaders) => leaders,
                };
                let partition = route::partition(&record.key, leaders.len()) as i32;
                if leaders[partition as usize].is_none() {
                    let error = format!("LEADER_NOT_AVAILABLE: no leader for {}[{partition}]", batch.key);
                    deliveries[here] = Delivery::Refused(Condition::LeaderMoved, error);
                    continue;
                }
                let run = *run_of.entry((b, partition)).or_insert_with(|| {
                    runs.push(Run { topic: batch.key.clone(), partition, members: Vec::new() });
                    runs.len() - 1
                });
                runs[run].members.push(here);
            }
        }
        let records: Vec<&Record> = batches.iter().flat_map(|b| &b.messages).collect();

        // Each leader its runs, in the order they came.
        let mut by_leader: Vec<(i32, Vec<usize>)> = Vec::new();
        for (r, run) in runs.iter().enumerate() {
            let leader = match &states[&run.topic] {
                TopicState::Known(leaders) => leaders[run.partition as usize].expect("a leader"),
                TopicState::Failed(..) => unreachable!("no run of a failed topic"),
            };
            match by_leader.iter_mut().find(|(l, _)| *l == leader) {
                Some((_, list)) => list.push(r),
                None => by_leader.push((leader, vec![r])),
            }
        }
        let mut failure = None;
        for (leader, mine) in by_leader {
            let rounds = chunks_of(&runs, &mine, &records, self.config.max_batch_bytes, &session.one_by_one);
            if let Err(e) = session.send_to(leader, &runs, &rounds, &records, deliveries, self, waiter) {
                // A leader that cannot be reached or answered: its records
                // stay unsent, the other leaders' go on; the session is
                // dropped after the push (push).
                match e {
                    SinkError::Interrupted => return Err(e),
                    e => {
                        session.stale_producer = true;
                        failure.get_or_insert(e);
                    }
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }
}

/// What becomes of a record refused for `fault`.
fn verdict(fault: Fault, error: &str) -> Delivery {
    match fault {
        Fault::Broker(condition) => Delivery::Refused(condition, error.to_string()),
        Fault::Message { .. } => Delivery::Rejected(error.to_string()),
    }
}

/// A fresh producer id and epoch (InitProducerId, no transactional id):
/// the idempotent producer's, with its sequences starting at 0.
fn init_producer(conn: &mut Conn, waiter: &mut dyn Wait) -> Result<(i64, i16), SinkError> {
    let version = conn.versions.of(ApiKey::InitProducerId).map_err(|_| {
        SinkError::Connect(
            "the broker has no idempotent producer (InitProducerId); Kafka 0.11 or later is needed".into(),
        )
    })?;
    let request =
        InitProducerIdRequest::default().with_transactional_id(None).with_transaction_timeout_ms(i32::MAX);
    let answer = conn.call(&request, version, waiter)?;
    match failed(answer.error_code) {
        None => Ok((answer.producer_id.0, answer.producer_epoch)),
        Some(error) => Err(SinkError::Connect(format!(
            "the broker gave no producer id: {error} (an ACL must allow IdempotentWrite on the cluster)"
        ))),
    }
}

impl Session {
    /// The state of each of `wanted`: what the metadata said of it, asked
    /// of the bootstrap connection for those not known. A topic being
    /// created (LEADER_NOT_AVAILABLE, as auto-creation answers at first) is
    /// asked again until the timeout.
    fn metadata(
        &mut self,
        wanted: &[&str],
        timeout: std::time::Duration,
        waiter: &mut dyn Wait,
    ) -> Result<HashMap<String, TopicState>, SinkError> {
        let deadline = Instant::now() + timeout;
        let mut states = HashMap::new();
        let mut asked: Vec<String> = Vec::new();
        for topic in wanted {
            match self.topics.get(*topic) {
                Some(leaders) => {
                    states.insert(topic.to_string(), TopicState::Known(leaders.clone()));
                }
                None if !asked.iter().any(|a| a == topic) => asked.push(topic.to_string()),
                None => {}
            }
        }
        while !asked.is_empty() {
            let version = self.bootstrap.versions.of(ApiKey::Metadata)?;
            let request = MetadataRequest::default().with_topics(Some(
                asked
                    .iter()
                    .map(|t| {
                        MetadataRequestTopic::default()
                            .with_name(Some(TopicName(StrBytes::from_string(t.clone()))))
                    })
                    .collect(),
            ));
            let answer = self.bootstrap.call(&request, version, waiter)?;
            self.learn_brokers(&answer);
            let mut again = Vec::new();
            for topic in &answer.topics {
                let Some(name) = topic.name.as_ref().map(|n| n.0.to_string()).filter(|n| asked.contains(n))
                else {
                    continue;
                };
                let state = match failed(topic.error_code) {
                    None => match leaders(topic) {
                        Some(leaders) => {
                            self.topics.insert(name.clone(), leaders.clone());
                            TopicState::Known(leaders)
                        }
                        None => TopicState::Failed(
                            Fault::Broker(Condition::Unavailable),
                            format!("the metadata of {name} has no partitions, or not all of them"),
                        ),
                    },
                    Some(error) if error == "LEADER_NOT_AVAILABLE" && Instant::now() < deadline => {
                        again.push(name);
                        continue;
                    }
                    Some(error) => {
                        // A topic that does not exist (auto-creation off),
                        // may not be written, or cannot be named: its
                        // records' fault. Anything else: the cluster's.
                        let fault = match error.as_str() {
                            "UNKNOWN_TOPIC_OR_PARTITION" => Fault::Message { split: false },
                            _ => fault(topic.error_code),
                        };
                        TopicState::Failed(fault, format!("{error}: topic {name}"))
                    }
                };
                states.insert(name, state);
            }
            for name in &asked {
                if !states.contains_key(name) && !again.contains(name) {
                    return Err(SinkError::ConnectionLost(format!(
                        "Kafka protocol error: the metadata answer left out the topic {}",
                        broker_text(name)
                    )));
                }
            }
            if !again.is_empty() {
                let nap = (Instant::now() + std::time::Duration::from_millis(100)).min(deadline);
                while Instant::now() < nap {
                    waiter.wait(None, nap).map_err(|_| SinkError::Interrupted)?;
                }
            }
            asked = again;
        }
        Ok(states)
    }

    fn learn_brokers(&mut self, answer: &MetadataResponse) {
        for broker in &answer.brokers {
            if let Ok(port) = u16::try_from(broker.port) {
                self.brokers.insert(broker.node_id.0, (broker.host.to_string(), port));
            }
        }
    }

    /// Sends the rounds of batches to `leader`, up to [`IN_FLIGHT`]
    /// requests unanswered, and records what each answer says.
    #[allow(clippy::too_many_arguments)]
    fn send_to(
        &mut self,
        leader: i32,
        runs: &[Run],
        rounds: &[Vec<Chunk>],
        records: &[&Record],
        deliveries: &mut [Delivery],
        sink: &KafkaSink,
        waiter: &mut dyn Wait,
    ) -> Result<(), SinkError> {
        if !self.leaders.contains_key(&leader) {
            let (host, port) = self.brokers.get(&leader).cloned().ok_or_else(|| {
                SinkError::ConnectionLost(format!("the metadata names leader {leader} but not its address"))
            })?;
            let conn = sink.open(&host, port, waiter)?;
            self.leaders.insert(leader, conn);
        }
        let timeout = sink.config.timeout;
        let mut failed_runs = vec![false; runs.len()];
        let mut in_flight: VecDeque<(i32, usize)> = VecDeque::new();
        let version = self.leaders[&leader].versions.of(ApiKey::Produce)?;
        let mut next = 0;
        let deadline = Instant::now() + timeout;
        while next < rounds.len() || !in_flight.is_empty() {
            if next < rounds.len() && in_flight.len() < IN_FLIGHT {
                let request = self.request(runs, &rounds[next], records, timeout)?;
                let conn = self.leaders.get_mut(&leader).expect("opened");
                let correlation = conn.send(&request, version, waiter, deadline)?;
                in_flight.push_back((correlation, next));
                next += 1;
                continue;
            }
            let (correlation, round) = in_flight.pop_front().expect("a request in flight");
            let conn = self.leaders.get_mut(&leader).expect("opened");
            let answer = conn.receive::<ProduceRequest>(correlation, version, waiter, deadline)?;
            self.settle(runs, &rounds[round], &answer, deliveries, &mut failed_runs)?;
        }
        Ok(())
    }

    /// One produce request: a record batch per chunk, each with the next
    /// sequence numbers of its partition.
    fn request(
        &mut self,
        runs: &[Run],
        round: &[Chunk],
        records: &[&Record],
        timeout: std::time::Duration,
    ) -> Result<ProduceRequest, SinkError> {
        let (producer_id, producer_epoch) = self.producer;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let mut topics: Vec<TopicProduceData> = Vec::new();
        for chunk in round {
            let run = &runs[chunk.run];
            let sequence = self.sequences.entry((run.topic.clone(), run.partition)).or_insert(0);
            let batch: Vec<kafka_protocol::records::Record> = run.members[chunk.members.clone()]
                .iter()
                .enumerate()
                .map(|(i, &m)| {
                    let record = records[m];
                    kafka_protocol::records::Record {
                        transactional: false,
                        control: false,
                        delete_horizon: false,
                        partition_leader_epoch: -1,
                        producer_id,
                        producer_epoch,
                        timestamp_type: TimestampType::Creation,
                        offset: i as i64,
                        sequence: next_sequence(*sequence, i),
                        timestamp: now,
                        key: Some(record.key.clone()),
                        value: record.value.clone(),
                        headers: record
                            .headers
                            .iter()
                            .map(|(name, value)| (StrBytes::from_string(name.clone()), Some(value.clone())))
                            .collect::<IndexMap<_, _>>(),
                    }
                })
                .collect();
            *sequence = next_sequence(*sequence, batch.len());
            let mut bytes = BytesMut::new();
            RecordBatchEncoder::encode(
                &mut bytes,
                &batch,
                &RecordEncodeOptions { version: 2, compression: Compression::None },
            )
            .map_err(|e| SinkError::ConnectionLost(format!("cannot encode a record batch: {e}")))?;
            let data =
                PartitionProduceData::default().with_index(run.partition).with_records(Some(bytes.freeze()));
            match topics.iter_mut().find(|t| t.name.0.as_str() == run.topic) {
                Some(topic) => topic.partition_data.push(data),
                None => topics.push(
                    TopicProduceData::default()
                        .with_name(TopicName(StrBytes::from_string(run.topic.clone())))
                        .with_partition_data(vec![data]),
                ),
            }
        }
        Ok(ProduceRequest::default()
            .with_transactional_id(None)
            .with_acks(-1)
            .with_timeout_ms(timeout.as_millis().min(i32::MAX as u128) as i32)
            .with_topic_data(topics))
    }

    /// What the answer to one round says of each of its batches.
    fn settle(
        &mut self,
        runs: &[Run],
        round: &[Chunk],
        answer: &ProduceResponse,
        deliveries: &mut [Delivery],
        failed_runs: &mut [bool],
    ) -> Result<(), SinkError> {
        for chunk in round {
            let run = &runs[chunk.run];
            let code = answer
                .responses
                .iter()
                .filter(|t| t.name.0.as_str() == run.topic)
                .flat_map(|t| &t.partition_responses)
                .find(|p| p.index == run.partition)
                .map(|p| (p.error_code, p.error_message.as_ref().map(|m| m.to_string())))
                .ok_or_else(|| {
                    SinkError::ConnectionLost(format!(
                        "Kafka protocol error: the produce answer left out {}[{}]",
                        broker_text(&run.topic),
                        run.partition
                    ))
                })?;
            let members = &run.members[chunk.members.clone()];
            let key = (run.topic.clone(), run.partition);
            let (code, message) = code;
            let delivered =
                code == 0 || code == kafka_protocol::ResponseError::DuplicateSequenceNumber.code();
            if delivered && !failed_runs[chunk.run] {
                if members.len() == 1 {
                    self.one_by_one.remove(&key);
                }
                members.iter().for_each(|&m| deliveries[m] = Delivery::Delivered);
                continue;
            }
            self.stale_producer = true;
            if failed_runs[chunk.run] {
                // Behind a batch that failed: refused as out of order, or
                // taken by a broker that should not have (a new producer
                // id starts from scratch either way): not this record's
                // doing, and not known to be delivered.
                continue;
            }
            failed_runs[chunk.run] = true;
            let name = failed(code).unwrap_or_default();
            let error = format!(
                "{name}: {}[{}]{}",
                run.topic,
                run.partition,
                message.map(|m| format!(": {}", broker_text(&m))).unwrap_or_default()
            );
            let fault = fault(code);
            match fault {
                Fault::Message { split: true } if members.len() > 1 => {
                    self.one_by_one.insert(key);
                }
                Fault::Broker(_) => {
                    self.topics.remove(&run.topic);
                    members.iter().for_each(|&m| deliveries[m] = verdict(fault, &error));
                }
                Fault::Message { .. } => members.iter().for_each(|&m| deliveries[m] = verdict(fault, &error)),
            }
        }
        Ok(())
    }
}

/// The record batches of `mine` (runs of one leader), each at most
/// `budget` bytes (or one record, which may be larger; one record only in
/// the partitions `one_by_one` names), in the order they are sent: the
/// first batch of every run, then the second, …
fn chunks_of(
    runs: &[Run],
    mine: &[usize],
    records: &[&Record],
    budget: usize,
    one_by_one: &HashSet<(String, i32)>,
) -> Vec<Vec<Chunk>> {
    let mut rounds: Vec<Vec<Chunk>> = Vec::new();
    for &r in mine {
        let run = &runs[r];
        let alone = one_by_one.contains(&(run.topic.clone(), run.partition));
        let (mut start, mut round) = (0, 0);
        while start < run.members.len() {
            let mut bytes = records[run.members[start]].size();
            let mut end = start + 1;
            while !alone && end < run.members.len() && bytes + records[run.members[end]].size() <= budget {
                bytes += records[run.members[end]].size();
                end += 1;
            }
            if rounds.len() == round {
                rounds.push(Vec::new());
            }
            rounds[round].push(Chunk { run: r, members: start..end });
            start = end;
            round += 1;
        }
    }
    rounds
}

/// The leaders of a topic's partitions, by partition index; `None` when
/// the answer does not describe partitions 0 to n-1 exactly once.
fn leaders(topic: &kafka_protocol::messages::metadata_response::MetadataResponseTopic) -> Option<Leaders> {
    let count = topic.partitions.len();
    if count == 0 {
        return None;
    }
    let mut leaders = vec![None; count];
    let mut seen = vec![false; count];
    for partition in &topic.partitions {
        let index = usize::try_from(partition.partition_index).ok().filter(|i| *i < count)?;
        if std::mem::replace(&mut seen[index], true) {
            return None;
        }
        let leader = partition.leader_id.0;
        leaders[index] = (partition.error_code == 0 && leader >= 0).then_some(leader);
    }
    Some(leaders)
}

/// The sequence number `n` after `sequence`: Kafka's wrap to 0 after
/// `i32::MAX`.
fn next_sequence(sequence: i32, n: usize) -> i32 {
    ((i64::from(sequence) + n as i64) % (i64::from(i32::MAX) + 1)) as i32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_brokers_faults_never_spend_a_retry() {
        for code in [5, 6, 7, 8, 9, 13, 19, 20, 45, 47, 56, 59, 74, 75, -1, 31000, 3] {
            assert!(matches!(fault(code), Fault::Broker(_)), "{code}: {:?}", failed(code));
        }
        for code in [10, 18, 87, 32, 2] {
            assert_eq!(fault(code), Fault::Message { split: true }, "{:?}", failed(code));
        }
        for code in [29, 17, 44] {
            assert_eq!(fault(code), Fault::Message { split: false }, "{:?}", failed(code));
        }
        assert_eq!(fault(6), Fault::Broker(Condition::LeaderMoved));
        assert_eq!(fault(19), Fault::Broker(Condition::NotEnoughReplicas));
    }

    #[test]
    fn sequences_wrap_as_kafkas_do() {
        assert_eq!(next_sequence(0, 5), 5);
        assert_eq!(next_sequence(i32::MAX, 1), 0);
        assert_eq!(next_sequence(i32::MAX - 1, 3), 1);
    }

    fn run(members: usize) -> Run {
        Run { topic: "t".into(), partition: 0, members: (0..members).collect() }
    }

    #[test]
    fn batches_are_cut_by_bytes_and_sent_in_rounds() {
        let record = Record { key: "k".into(), value: Some(vec![b'x'; 75].into()), headers: Vec::new() };
        assert_eq!(record.size(), 100);
        let records = vec![&record; 5];
        let session_chunks = |one_by_one: bool| {
            let mut alone = HashSet::new();
            if one_by_one {
                alone.insert(("t".to_string(), 0));
            }
            plan(&[run(5), Run { topic: "u".into(), partition: 0, members: vec![0] }], &records, 250, &alone)
        };
        assert_eq!(session_chunks(false), vec![vec![(0, 0..2), (1, 0..1)], vec![(0, 2..4)], vec![(0, 4..5)]]);
        assert_eq!(session_chunks(true).len(), 5);
    }

    /// [`Session::chunks`] without a session.
    fn plan(
        runs: &[Run],
        records: &[&Record],
        budget: usize,
        alone: &HashSet<(String, i32)>,
    ) -> Vec<Vec<(usize, std::ops::Range<usize>)>> {
        chunks_of(runs, &(0..runs.len()).collect::<Vec<_>>(), records, budget, alone)
            .into_iter()
            .map(|round| round.into_iter().map(|c| (c.run, c.members)).collect())
            .collect()
    }
}
