//! A push to Kafka: each record to the partition its key hashes to, each
//! partition's records in record batches, the batches to their leaders in
//! produce requests, up to [`IN_FLIGHT`] unanswered on a connection, and
//! what each answer says of each record.
//!
//! Sequence numbers are kept per partition from the producer id given at
//! connect: the broker refuses a batch out of order, so a partition's
//! records are never written out of order with several requests in flight.
//! Requests whose answers were lost with their connection are sent again,
//! unchanged, on a new one: the broker keeps what it had once. When a
//! batch is refused, the partition's later batches are not sent, or, sent
//! already, are refused as out of order (or written, by a broker that keeps
//! no state for the producer id): they go back to pending as unsent, and
//! the next push goes under the producer id's next epoch, its sequences at
//! 0 (see [`Producer::renew`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::time::Instant;

use bytes::BytesMut;
use kafka_protocol::indexmap::IndexMap;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::messages::{ApiKey, InitProducerIdRequest, ProduceRequest, ProduceResponse, TopicName};
use kafka_protocol::protocol::StrBytes;
use kafka_protocol::records::{Compression, RecordBatchEncoder, RecordEncodeOptions, TimestampType};
use kafka_protocol::ResponseError;

use super::faults::Fault;
use super::metadata::TopicState;
use super::wire::{failed, Conn};
use super::{route, KafkaSink, Record, Session};
use crate::link::Wait;
use crate::sink::errors::broker_text;
use crate::sink::{Condition, Delivery, KeyBatch, SinkError};

/// Requests on a connection awaiting their answers, at most: what Kafka's
/// idempotent producer keeps in order (`max.in.flight.requests.per.connection`).
const IN_FLIGHT: usize = 5;

/// How many times one leader's unanswered requests are sent again in one
/// push, each on a new connection: a lost answer is most often a
/// connection the broker or the network closed, and rarely twice.
const RESENDS: usize = 3;

/// The pause before a new connection sends them again: Kafka's own
/// `retry.backoff.ms`.
const RESEND_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);

/// The most bytes of records in one record batch: Kafka's default
/// `message.max.bytes` (a batch is one message to the broker), less room
/// for the batch's header and what [`Record::size`] leaves out, whatever
/// `outbox.max_batch_bytes` allows, so that a default broker takes it.
const BATCH_MAX: usize = 1024 * 1024 - 1024;

/// The most bytes of one produce request: below Kafka's default
/// `socket.request.max.bytes` (100 MiB), which a broker enforces by
/// closing the connection. A record larger than this is refused here.
pub const REQUEST_MAX: usize = 64 * 1024 * 1024;

/// The first version of Produce whose record batches may be zstd's
/// (KIP-110, Kafka 2.1): a broker refuses zstd in an older one.
const ZSTD_SINCE: i16 = 7;

/// Whether a connection whose Produce is at `version` takes record batches
/// of `compression`; a setting it cannot take is refused before anything
/// is sent, naming it.
pub fn codec_spoken(compression: Compression, version: i16) -> Result<(), SinkError> {
    if compression == Compression::Zstd && version < ZSTD_SINCE {
        return Err(SinkError::InvalidConfig(format!(
            "outbox.kafka_compression = zstd needs Produce version {ZSTD_SINCE} (Kafka 2.1 or later), and \
             the broker speaks up to version {version}: take lz4 or none"
        )));
    }
    Ok(())
}

/// The answers after which the producer takes a fresh id rather than its
/// next epoch: the broker forgot it (`UNKNOWN_PRODUCER_ID`), knows a later
/// epoch of it (`INVALID_PRODUCER_EPOCH`), or takes no epoch of an
/// idempotent producer but the one it gave (`PRODUCER_FENCED`, which
/// Kafka sends only to transactional producers and some brokers to any).
const FORGOTTEN: [ResponseError; 3] =
    [ResponseError::UnknownProducerId, ResponseError::InvalidProducerEpoch, ResponseError::ProducerFenced];

/// The idempotent producer: its id and epoch, and the next sequence number
/// of each partition. One per sink, kept across its connections, as
/// Kafka's own producer keeps it (`TransactionManager`).
pub struct Producer {
    id: i64,
    epoch: i16,
    sequences: HashMap<(String, i32), i32>,
    /// A batch failed, or a connection ended with requests unanswered:
    /// the next push goes under the next epoch.
    pub stale: bool,
    /// The broker refused the id or its epoch ([`FORGOTTEN`]): the next
    /// push takes a fresh one.
    pub forgotten: bool,
}

impl Producer {
    /// A fresh producer id and epoch (InitProducerId, no transactional id),
    /// its sequences starting at 0.
    pub fn fresh(conn: &mut Conn, waiter: &mut dyn Wait, deadline: Instant) -> Result<Producer, SinkError> {
        let version = conn.versions.of(ApiKey::InitProducerId).map_err(|_| {
            SinkError::Connect(
                "the broker has no idempotent producer (InitProducerId); Kafka 0.11 or later is needed"
                    .into(),
            )
        })?;
        let request = InitProducerIdRequest::default()
            .with_transactional_id(None)
            .with_transaction_timeout_ms(i32::MAX);
        let answer = conn.call(&request, version, waiter, deadline)?;
        match failed(answer.error_code) {
            None => Ok(Producer {
                id: answer.producer_id.0,
                epoch: answer.producer_epoch,
                sequences: HashMap::new(),
                stale: false,
                forgotten: false,
            }),
            Some(error) => Err(SinkError::Connect(format!(
                "the broker gave no producer id: {error} (an ACL must allow IdempotentWrite on the cluster)"
            ))),
        }
    }

    /// Goes on after `stale` with this id under its next epoch, its
    /// sequences at 0 again (KIP-360: an idempotent producer bumps its
    /// epoch itself, and the broker then refuses the old epoch's writes
    /// still on their way, `INVALID_PRODUCER_EPOCH`); or with a fresh id
    /// when the broker forgot this one or its epochs are spent.
    pub fn renew(
        &mut self,
        conn: &mut Conn,
        waiter: &mut dyn Wait,
        deadline: Instant,
    ) -> Result<(), SinkError> {
        if !self.stale {
            return Ok(());
        }
        if self.forgotten || self.epoch == i16::MAX {
            *self = Producer::fresh(conn, waiter, deadline)?;
            return Ok(());
        }
        self.epoch += 1;
        self.sequences.clear();
        self.stale = false;
        Ok(())
    }

    /// The first of `n` sequence numbers of `partition` of `topic`.
    fn take(&mut self, topic: &str, partition: i32, n: usize) -> i32 {
        let next = self.sequences.entry((topic.to_string(), partition)).or_insert(0);
        let first = *next;
        *next = next_sequence(first, n);
        first
    }
}

/// The sequence number `n` after `sequence`: Kafka's wrap to 0 after
/// `i32::MAX`.
fn next_sequence(sequence: i32, n: usize) -> i32 {
    ((i64::from(sequence) + n as i64) % (i64::from(i32::MAX) + 1)) as i32
}

/// One partition's records in one push, in order: their places among the
/// push's messages.
struct Run {
    topic: String,
    partition: i32,
    leader: i32,
    members: Vec<usize>,
}

/// One record batch: some of a run's members.
struct Chunk {
    run: usize,
    members: Range<usize>,
}

/// Produces `batches` (`key`: the topic), writing what became of each
/// record in `deliveries`, every step done by `until`. `alone` names the
/// partitions whose records go one per batch (see [`KafkaSink`]).
#[allow(clippy::too_many_arguments)]
pub fn produce(
    sink: &KafkaSink,
    session: &mut Session,
    alone: &mut HashSet<(String, i32)>,
    batches: &[KeyBatch<Record>],
    deliveries: &mut [Delivery],
    waiter: &mut dyn Wait,
    until: Instant,
) -> Result<(), SinkError> {
    session.producer.renew(&mut session.bootstrap, waiter, sink.step(until)?)?;
    let states = session.cluster.states(
        &mut session.bootstrap,
        batches.iter().map(|b| b.key.as_str()),
        waiter,
        sink.step(until)?,
    )?;
    let records: Vec<&Record> = batches.iter().flat_map(|b| &b.messages).collect();
    let runs = runs_of(batches, &states, &records, deliveries);

    let mut leaders: Vec<i32> = Vec::new();
    for run in &runs {
        if !leaders.contains(&run.leader) {
            leaders.push(run.leader);
        }
    }
    let budget = sink.config.max_batch_bytes.clamp(1, REQUEST_MAX);
    let mut failure = None;
    for leader in leaders {
        let mine: Vec<usize> = (0..runs.len()).filter(|&r| runs[r].leader == leader).collect();
        let rounds = chunks_of(&runs, &mine, &records, budget.min(BATCH_MAX), alone);
        let requests = requests_of(rounds, &runs, &records, budget);
        let sent = Leader { sink, session, runs: &runs, records: &records, alone: &mut *alone, broken: None }
            .send(leader, &requests, deliveries, waiter, until);
        match sent {
            Ok(()) => {}
            Err(SinkError::Interrupted) => return Err(SinkError::Interrupted),
            // A leader not reached or not answered in time: its records stay
            // unsent, the other leaders' go on; the session goes after the
            // push (KafkaSink::push).
            Err(e) => {
                session.producer.stale = true;
                failure.get_or_insert(e);
            }
        }
    }
    failure.map_or(Ok(()), Err)
}

/// Each record to its partition, in runs per partition; a record whose
/// topic failed, whose partition has no leader now, or that no request
/// could carry, gets its verdict at once.
fn runs_of(
    batches: &[KeyBatch<Record>],
    states: &HashMap<String, TopicState>,
    records: &[&Record],
    deliveries: &mut [Delivery],
) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut run_of: HashMap<(usize, i32), usize> = HashMap::new();
    let mut place = 0;
    for (b, batch) in batches.iter().enumerate() {
        for _ in &batch.messages {
            let here = place;
            place += 1;
            let leaders = match &states[&batch.key] {
                TopicState::Failed(fault, error) => {
                    deliveries[here] = fault.verdict(error);
                    continue;
                }
                TopicState::Known(leaders) => leaders,
            };
            if records[here].size() > REQUEST_MAX {
                deliveries[here] = Delivery::Rejected(format!(
                    "MESSAGE_TOO_LARGE: a record of {} bytes; a produce request carries at most {REQUEST_MAX}",
                    records[here].size()
                ));
                continue;
            }
            let partition = route::partition(&records[here].key, leaders.len()) as i32;
            let Some(leader) = leaders[partition as usize] else {
                let error = format!("LEADER_NOT_AVAILABLE: no leader for {}[{partition}]", batch.key);
                deliveries[here] = Delivery::Refused(Condition::LeaderMoved, error);
                continue;
            };
            let run = *run_of.entry((b, partition)).or_insert_with(|| {
                runs.push(Run { topic: batch.key.clone(), partition, leader, members: Vec::new() });
                runs.len() - 1
            });
            runs[run].members.push(here);
        }
    }
    runs
}

/// The record batches of `mine` (runs of one leader), each at most
/// `budget` bytes (or one record, which may be larger; one record only in
/// the partitions `alone` names), by rounds: the first batch of every run,
/// then the second, …
fn chunks_of(
    runs: &[Run],
    mine: &[usize],
    records: &[&Record],
    budget: usize,
    alone: &HashSet<(String, i32)>,
) -> Vec<Vec<Chunk>> {
    let mut rounds: Vec<Vec<Chunk>> = Vec::new();
    for &r in mine {
        let run = &runs[r];
        let one_by_one = alone.contains(&(run.topic.clone(), run.partition));
        let (mut start, mut round) = (0, 0);
        while start < run.members.len() {
            let mut bytes = records[run.members[start]].size();
            let mut end = start + 1;
            while !one_by_one && end < run.members.len() && bytes + records[run.members[end]].size() <= budget
            {
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

/// The rounds as produce requests of at most `budget` bytes each (or one
/// batch): a round in several requests where it is larger, in order, so a
/// partition's batches still go first to last.
fn requests_of(rounds: Vec<Vec<Chunk>>, runs: &[Run], records: &[&Record], budget: usize) -> Vec<Vec<Chunk>> {
    let size = |chunk: &Chunk| -> usize {
        runs[chunk.run].members[chunk.members.clone()].iter().map(|&m| records[m].size()).sum()
    };
    let mut requests: Vec<Vec<Chunk>> = Vec::new();
    for round in rounds {
        let mut bytes = 0;
        let mut request = Vec::new();
        for chunk in round {
            let chunk_bytes = size(&chunk);
            if !request.is_empty() && bytes + chunk_bytes > budget {
                requests.push(std::mem::take(&mut request));
                bytes = 0;
            }
            bytes += chunk_bytes;
            request.push(chunk);
        }
        requests.push(request);
    }
    requests
}

/// One leader's share of a push.
struct Leader<'a> {
    sink: &'a KafkaSink,
    session: &'a mut Session,
    runs: &'a [Run],
    records: &'a [&'a Record],
    alone: &'a mut HashSet<(String, i32)>,
    /// An answer that broke the protocol without losing the connection:
    /// the push's failure once the requests in flight are answered.
    broken: Option<SinkError>,
}

/// A produce request sent and not yet answered: its correlation id on its
/// connection, its batches, when it went, and the request itself, to be
/// sent again as it is.
struct Sent<'r> {
    correlation: i32,
    chunks: &'r [Chunk],
    at: Instant,
    request: ProduceRequest,
}

impl<'r> Leader<'_> {
    /// Sends `requests` to `leader`, up to [`IN_FLIGHT`] unanswered, each
    /// answer due a timeout after the one before it (and by `until`), and
    /// records what each answer says. A request is built as it goes, without
    /// the batches of partitions that failed meanwhile. A connection lost,
    /// or an answer not come in time, with requests unanswered: they are
    /// sent again on a new connection, as they were (the same producer id,
    /// epoch and sequences: the broker drops what it has already), up to
    /// [`RESENDS`] times, as Kafka's own producer retries them.
    fn send(
        mut self,
        leader: i32,
        requests: &'r [Vec<Chunk>],
        deliveries: &mut [Delivery],
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<(), SinkError> {
        if !self.session.leaders.contains_key(&leader) {
            self.connect(leader, waiter, until)?;
        }
        let version = self.session.leaders[&leader].versions.of(ApiKey::Produce)?;
        let mut failed_runs = vec![false; self.runs.len()];
        let mut in_flight: VecDeque<Sent<'r>> = VecDeque::new();
        let mut next = 0;
        let mut resends = 0;
        while next < requests.len() || !in_flight.is_empty() {
            let turn = if next < requests.len() && in_flight.len() < IN_FLIGHT {
                next += 1;
                self.dispatch(
                    leader,
                    version,
                    &requests[next - 1],
                    &failed_runs,
                    &mut in_flight,
                    waiter,
                    until,
                )
            } else {
                self.answer(leader, version, &mut in_flight, deliveries, &mut failed_runs, waiter, until)
            };
            match turn {
                Err(SinkError::ConnectionLost(_) | SinkError::Timeout)
                    if resends < RESENDS && !in_flight.is_empty() && Instant::now() < until =>
                {
                    resends += 1;
                    self.resend(leader, version, &mut in_flight, waiter, until)?;
                }
                turn => turn?,
            }
        }
        self.broken.map_or(Ok(()), Err)
    }

    /// A connection to `leader`, authenticated.
    fn connect(&mut self, leader: i32, waiter: &mut dyn Wait, until: Instant) -> Result<(), SinkError> {
        let (host, port) = self.session.cluster.address(leader).ok_or_else(|| {
            SinkError::ConnectionLost(format!("the metadata names leader {leader} but not its address"))
        })?;
        let conn = self.sink.open(&host, port, waiter, self.sink.step(until)?)?;
        self.session.leaders.insert(leader, conn);
        Ok(())
    }

    /// Builds and sends the request of `chunks`, if any of its partitions
    /// has not failed, once the broker's throttle of the connection is over.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        leader: i32,
        version: i16,
        chunks: &'r [Chunk],
        failed_runs: &[bool],
        in_flight: &mut VecDeque<Sent<'r>>,
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<(), SinkError> {
        self.session.leaders.get_mut(&leader).expect("opened").quiet(waiter, until)?;
        let deadline = self.sink.step(until)?;
        let Some(request) = self.request(chunks, failed_runs) else { return Ok(()) };
        let conn = self.session.leaders.get_mut(&leader).expect("opened");
        // Sent or not, it is in flight: a connection lost as it goes sends
        // it again.
        let sent = conn.send(&request, version, waiter, deadline);
        in_flight.push_back(Sent {
            correlation: *sent.as_ref().unwrap_or(&-1),
            chunks,
            at: Instant::now(),
            request,
        });
        sent.map(drop)
    }

    /// Waits for the oldest request's answer, and records what it says.
    #[allow(clippy::too_many_arguments)]
    fn answer(
        &mut self,
        leader: i32,
        version: i16,
        in_flight: &mut VecDeque<Sent<'r>>,
        deliveries: &mut [Delivery],
        failed_runs: &mut [bool],
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<(), SinkError> {
        // A broker answers a connection's requests one after another,
        // each once its replicas have it: an answer is due a request
        // timeout after its request went, or a timeout after the
        // answer before it came.
        let oldest = in_flight.front().expect("a request in flight");
        let deadline = self.sink.answer_due(oldest.at, until)?;
        let conn = self.session.leaders.get_mut(&leader).expect("opened");
        let answer = conn.receive::<ProduceRequest>(oldest.correlation, version, waiter, deadline)?;
        conn.throttled(answer.throttle_time_ms);
        let sent = in_flight.pop_front().expect("a request in flight");
        self.settle(sent.chunks, &answer, deliveries, failed_runs);
        Ok(())
    }

    /// The old connection to `leader` closed, a new one after
    /// [`RESEND_BACKOFF`], and every request still in flight sent on it
    /// again, in order, unchanged.
    fn resend(
        &mut self,
        leader: i32,
        version: i16,
        in_flight: &mut VecDeque<Sent<'r>>,
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<(), SinkError> {
        self.session.leaders.remove(&leader);
        let backoff = (Instant::now() + RESEND_BACKOFF).min(until);
        while Instant::now() < backoff {
            waiter.wait(None, backoff).map_err(|_| SinkError::Interrupted)?;
        }
        self.connect(leader, waiter, until)?;
        let conn = self.session.leaders.get_mut(&leader).expect("opened");
        if conn.versions.of(ApiKey::Produce)? != version {
            return Err(SinkError::ConnectionLost(
                "the leader came back speaking another version of Produce".into(),
            ));
        }
        for sent in in_flight.iter_mut() {
            sent.correlation = conn.send(&sent.request, version, waiter, self.sink.step(until)?)?;
            sent.at = Instant::now();
        }
        Ok(())
    }

    /// One produce request: a record batch per chunk of a partition that has
    /// not failed, with the next sequence numbers of its partition; `None`
    /// when no chunk is left.
    fn request(&mut self, chunks: &[Chunk], failed_runs: &[bool]) -> Option<ProduceRequest> {
        let producer = &mut self.session.producer;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let mut topics: Vec<TopicProduceData> = Vec::new();
        let mut topic_of: HashMap<&str, usize> = HashMap::new();
        for chunk in chunks.iter().filter(|c| !failed_runs[c.run]) {
            let run = &self.runs[chunk.run];
            let members = &run.members[chunk.members.clone()];
            let first = producer.take(&run.topic, run.partition, members.len());
            let batch: Vec<kafka_protocol::records::Record> = members
                .iter()
                .enumerate()
                .map(|(i, &m)| {
                    let record = self.records[m];
                    kafka_protocol::records::Record {
                        transactional: false,
                        control: false,
                        delete_horizon: false,
                        partition_leader_epoch: -1,
                        producer_id: producer.id,
                        producer_epoch: producer.epoch,
                        timestamp_type: TimestampType::Creation,
                        offset: i as i64,
                        sequence: next_sequence(first, i),
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
            let mut bytes = BytesMut::new();
            let options = RecordEncodeOptions { version: 2, compression: self.sink.config.kafka.compression };
            // Encoding writes to memory; lz4 and zstd fail only where
            // memory does, which aborts first.
            RecordBatchEncoder::encode(&mut bytes, &batch, &options).expect("a record batch encodes");
            let data =
                PartitionProduceData::default().with_index(run.partition).with_records(Some(bytes.freeze()));
            let slot = *topic_of.entry(run.topic.as_str()).or_insert_with(|| {
                topics.push(
                    TopicProduceData::default()
                        .with_name(TopicName(StrBytes::from_string(run.topic.clone()))),
                );
                topics.len() - 1
            });
            topics[slot].partition_data.push(data);
        }
        // The broker's own deadline for replication (`acks=all`): ours
        // leaves its REQUEST_TIMED_OUT a timeout to come back in.
        let timeout = self.sink.config.kafka.request_timeout.as_millis().min(i32::MAX as u128) as i32;
        (!topics.is_empty()).then(|| {
            ProduceRequest::default()
                .with_transactional_id(None)
                .with_acks(-1)
                .with_timeout_ms(timeout)
                .with_topic_data(topics)
        })
    }

    /// What the answer to one request says of each of its batches.
    fn settle(
        &mut self,
        chunks: &[Chunk],
        answer: &ProduceResponse,
        deliveries: &mut [Delivery],
        failed_runs: &mut [bool],
    ) {
        let mut answers: HashMap<(&str, i32), (i16, Option<String>)> = HashMap::new();
        for topic in &answer.responses {
            for partition in &topic.partition_responses {
                let message = partition.error_message.as_ref().map(|m| m.to_string());
                answers.insert((topic.name.0.as_str(), partition.index), (partition.error_code, message));
            }
        }
        for chunk in chunks {
            let run = &self.runs[chunk.run];
            let members = &run.members[chunk.members.clone()];
            if failed_runs[chunk.run] {
                // Behind a batch that failed: not sent, or refused as out of
                // order; not the record's doing, and not known delivered.
                continue;
            }
            let Some((code, message)) = answers.remove(&(run.topic.as_str(), run.partition)) else {
                // Whether the broker wrote it is not known: the partition's
                // records go back to pending, what follows goes under the
                // next epoch, and the connection goes after the push (not
                // sent again: an answer came, and said nothing of it).
                failed_runs[chunk.run] = true;
                self.session.producer.stale = true;
                self.broken.get_or_insert_with(|| {
                    SinkError::ConnectionLost(format!(
                        "Kafka protocol error: the produce answer left out {}[{}]",
                        broker_text(&run.topic),
                        run.partition
                    ))
                });
                continue;
            };
            let key = (run.topic.clone(), run.partition);
            if code == 0 || code == ResponseError::DuplicateSequenceNumber.code() {
                if members.len() == 1 {
                    self.alone.remove(&key);
                }
                members.iter().for_each(|&m| deliveries[m] = Delivery::Delivered);
                continue;
            }
            failed_runs[chunk.run] = true;
            self.session.producer.stale = true;
            if FORGOTTEN.iter().any(|e| e.code() == code) {
                self.session.producer.forgotten = true;
            }
            let error = format!(
                "{}: {}[{}]{}",
                failed(code).unwrap_or_default(),
                run.topic,
                run.partition,
                message.map(|m| format!(": {}", broker_text(&m))).unwrap_or_default()
            );
            match Fault::of(code) {
                // One record of several may be the cause: they go back to
                // pending and then one per batch, so that only it pays.
                Fault::Message { split: true } if members.len() > 1 => {
                    self.alone.insert(key);
                }
                fault @ Fault::Broker(_) => {
                    self.session.cluster.forget(&run.topic);
                    members.iter().for_each(|&m| deliveries[m] = fault.verdict(&error));
                }
                fault => members.iter().for_each(|&m| deliveries[m] = fault.verdict(&error)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zstd_is_refused_where_produce_is_older_than_kip_110() {
        let refused = codec_spoken(Compression::Zstd, 6).unwrap_err().to_string();
        assert!(refused.contains("outbox.kafka_compression") && refused.contains("version 6"), "{refused}");
        codec_spoken(Compression::Zstd, 7).unwrap();
        codec_spoken(Compression::Lz4, 3).unwrap();
        codec_spoken(Compression::None, 3).unwrap();
    }

    #[test]
    fn sequences_wrap_as_kafkas_do() {
        assert_eq!(next_sequence(0, 5), 5);
        assert_eq!(next_sequence(i32::MAX, 1), 0);
        assert_eq!(next_sequence(i32::MAX - 1, 3), 1);
    }

    fn run(topic: &str, members: std::ops::Range<usize>) -> Run {
        Run { topic: topic.into(), partition: 0, leader: 1, members: members.collect() }
    }

    fn shape(requests: &[Vec<Chunk>]) -> Vec<Vec<(usize, Range<usize>)>> {
        requests.iter().map(|r| r.iter().map(|c| (c.run, c.members.clone())).collect()).collect()
    }

    #[test]
    fn batches_are_cut_by_bytes_and_requests_keep_each_partitions_order() {
        let record = Record { key: "k".into(), value: Some(vec![b'x'; 75].into()), headers: Vec::new() };
        assert_eq!(record.size(), 100);
        let records = vec![&record; 6];
        let runs = [run("t", 0..5), run("u", 5..6)];
        let none = HashSet::new();
        let rounds = chunks_of(&runs, &[0, 1], &records, 250, &none);
        let by_round: Vec<Vec<(usize, Range<usize>)>> =
            rounds.iter().map(|r| r.iter().map(|c| (c.run, c.members.clone())).collect()).collect();
        assert_eq!(by_round, vec![vec![(0, 0..2), (1, 0..1)], vec![(0, 2..4)], vec![(0, 4..5)]]);
        // A request budget below a round: the round in two, in order.
        let requests = requests_of(rounds, &runs, &records, 250);
        assert_eq!(
            shape(&requests),
            vec![vec![(0, 0..2)], vec![(1, 0..1)], vec![(0, 2..4)], vec![(0, 4..5)]]
        );
        let alone = HashSet::from([("t".to_string(), 0)]);
        assert_eq!(chunks_of(&runs, &[0], &records, 250, &alone).len(), 5);
    }
}
