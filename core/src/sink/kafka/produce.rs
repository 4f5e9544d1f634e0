//! A push to Kafka: each record to the partition its key hashes to, each
//! partition's records in record batches, the batches to their leaders in
//! produce requests, up to [`IN_FLIGHT`] unanswered on a connection, and
//! what each answer says of each record.
//!
//! Sequence numbers are kept per partition from the producer id given at
//! connect: the broker refuses a batch out of order, so a partition's
//! records are never written out of order with several requests in flight.
//! A batch's sequence numbers are fixed when it is cut, so that a batch
//! sent again is the same batch to the broker, which keeps one copy.
//! Requests whose answers were lost with their connection are sent again,
//! unchanged, on a new one. When a batch is refused, the partition's later
//! batches are not sent, or, sent already, are refused as out of order:
//! for a condition of the broker's they are all sent again from the
//! refused one, inside the connection ([`produce`]); otherwise, or once
//! the retries are spent, they go back to pending, and the next push goes
//! under the producer id's next epoch, its sequences at 0 (see
//! [`Producer::renew`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

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

/// How many times a push sends a partition's refused batches again after
/// the first refusal (see [`produce`]): enough for a leader's election,
/// few enough that a partition that stays sick holds the push a fraction of
/// a second.
const RETRIES: u32 = 2;

/// The pause before requests or batches are sent again: Kafka's own
/// `retry.backoff.ms`, doubled for each retry of a batch (KIP-580).
const RETRY_BACKOFF: Duration = Duration::from_millis(100);

/// A partition's first rest after a push gave up on it, doubled for each
/// in a row up to [`REST_MAX`]: its records wait out of line meanwhile, so
/// that a sick partition costs the pushes of the others nothing.
const REST_FIRST: Duration = Duration::from_secs(1);
const REST_MAX: Duration = Duration::from_secs(30);

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

/// What the sink remembers of partitions across pushes and connections.
#[derive(Default)]
pub struct Partitions {
    /// Those whose last batch of several records was refused for one
    /// record's size or form: their records go one per batch until one is
    /// delivered, so that only that record pays for it.
    alone: HashSet<(String, i32)>,
    /// Those the broker kept refusing for a condition of its own, after
    /// the push's retries: their records are deferred at once, unsent,
    /// until the rest is over.
    resting: HashMap<(String, i32), Rest>,
}

/// A partition's rest after refusals: until when, the how manieth in a
/// row, and the refusal that began it.
struct Rest {
    until: Instant,
    strikes: u32,
    condition: Condition,
    error: String,
}

impl Partitions {
    /// The rest of `partition` of `topic` after a push gave up on it for
    /// `condition`: [`REST_FIRST`], doubled for each rest in a row, at
    /// most [`REST_MAX`].
    fn rest(&mut self, topic: &str, partition: i32, condition: Condition, error: &str) -> Duration {
        let strikes = self.resting.get(&(topic.to_string(), partition)).map_or(0, |r| r.strikes + 1);
        let rest = REST_FIRST.saturating_mul(1 << strikes.min(8)).min(REST_MAX);
        let until = Instant::now() + rest;
        let error = error.to_string();
        self.resting.insert((topic.to_string(), partition), Rest { until, strikes, condition, error });
        rest
    }

    /// Forgets the rests over for longer than [`REST_MAX`]: a partition
    /// refused again after that starts over at [`REST_FIRST`].
    fn prune(&mut self) {
        let now = Instant::now();
        self.resting.retain(|_, rest| now < rest.until + REST_MAX);
    }

    /// What becomes of a record of a partition still resting: deferred
    /// for the rest of it.
    fn resting(&self, topic: &str, partition: i32) -> Option<Delivery> {
        if self.resting.is_empty() {
            return None;
        }
        let rest = self.resting.get(&(topic.to_string(), partition))?;
        let left = rest.until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero())?;
        Some(Delivery::Deferred(
            rest.condition,
            format!("{} (resting {:.1}s more)", rest.error, left.as_secs_f64()),
            left,
        ))
    }

    /// A batch of `partition` of `topic` was written: its rest is over,
    /// and a single record written ends its records' going one by one.
    fn written(&mut self, topic: &str, partition: i32, records: usize) {
        let key = (topic.to_string(), partition);
        self.resting.remove(&key);
        if records == 1 {
            self.alone.remove(&key);
        }
    }
}

/// One partition's records in one push, in order (their places among the
/// push's messages), cut into record batches whose sequence numbers are
/// fixed once taken: a batch sent again is the same batch to the broker.
struct Run {
    topic: String,
    partition: i32,
    leader: i32,
    members: Vec<usize>,
    chunks: Vec<Chunk>,
    /// The first chunk not answered yet.
    from: usize,
}

/// One record batch: some of a run's members, and the sequence number of
/// the first.
struct Chunk {
    members: Range<usize>,
    first: i32,
}

/// A chunk of a run, as a request carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Part {
    run: usize,
    chunk: usize,
}

/// A run's chunk refused for a condition of the broker's: the run is sent
/// again from it, or deferred.
struct Refusal {
    chunk: usize,
    code: i16,
    condition: Condition,
    error: String,
}

/// How the producer goes on before batches are sent again.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Renewal {
    /// Under the same id, epoch and sequences: the broker keeps one copy
    /// of what it has (a moved leader, too few replicas, a timeout).
    Same,
    /// Under the next epoch, sequences from 0: the broker's sequence of the
    /// partition is not ours (`OUT_OF_ORDER_SEQUENCE_NUMBER`).
    Epoch,
    /// Under a fresh id: the broker forgot this one ([`FORGOTTEN`]).
    Fresh,
}

impl Renewal {
    fn of(code: i16) -> Renewal {
        if FORGOTTEN.iter().any(|e| e.code() == code) {
            Renewal::Fresh
        } else if code == ResponseError::OutOfOrderSequenceNumber.code() {
            Renewal::Epoch
        } else {
            Renewal::Same
        }
    }
}

/// Produces `batches` (`key`: the topic), writing what became of each
/// record in `deliveries`, every step done by `until`. A partition's batch
/// refused for a condition of the broker's is sent again, with the
/// partition's batches behind it, after [`RETRY_BACKOFF`] (doubled each
/// time) and a metadata refresh, to the partition's leader then, up to
/// [`RETRIES`] times, as Kafka's own producer retries a batch; the other
/// partitions are done meanwhile. After that its records are deferred
/// and the partition rests (see [`Partitions`]).
#[allow(clippy::too_many_arguments)]
pub fn produce(
    sink: &KafkaSink,
    session: &mut Session,
    partitions: &mut Partitions,
    batches: &[KeyBatch<Record>],
    deliveries: &mut [Delivery],
    waiter: &mut dyn Wait,
    until: Instant,
) -> Result<(), SinkError> {
    on_bootstrap(sink, session, waiter, until, |session, waiter, deadline| {
        session.producer.renew(&mut session.bootstrap, waiter, deadline)
    })?;
    let topics: Vec<&str> = batches.iter().map(|b| b.key.as_str()).collect();
    let states = metadata(sink, session, &topics, waiter, until)?;
    let records: Vec<&Record> = batches.iter().flat_map(|b| &b.messages).collect();
    let budget = sink.config.max_batch_bytes.clamp(1, REQUEST_MAX);
    partitions.prune();
    let mut runs = runs_of(batches, &states, &records, partitions, deliveries);
    for run in &mut runs {
        let one_by_one = partitions.alone.contains(&(run.topic.clone(), run.partition));
        run.chunks = cut(&run.members, &records, budget.min(BATCH_MAX), one_by_one)
            .into_iter()
            .map(|members| Chunk { members, first: 0 })
            .collect();
    }
    let mut going: Vec<usize> = (0..runs.len()).collect();
    sequence(&mut session.producer, &mut runs, &going);

    let mut failure = None;
    for retry in 0..=RETRIES {
        let mut refusals: Vec<Option<Refusal>> = runs.iter().map(|_| None).collect();
        let mut leaders: Vec<i32> = Vec::new();
        for &r in &going {
            if !leaders.contains(&runs[r].leader) {
                leaders.push(runs[r].leader);
            }
        }
        let shares: Vec<(i32, Vec<Vec<Part>>)> = leaders
            .into_iter()
            .map(|leader| {
                let mine: Vec<usize> = going.iter().copied().filter(|&r| runs[r].leader == leader).collect();
                (leader, requests_of(rounds_of(&runs, &mine), &runs, &records, budget))
            })
            .collect();
        let failed = Leaders {
            sink,
            session: &mut *session,
            runs: &runs,
            records: &records,
            partitions: &mut *partitions,
            refusals: &mut refusals,
        }
        .send(&shares, deliveries, waiter, until)?;
        // A leader not reached, not answered in time, or whose answer broke
        // the protocol: its records not answered stay unsent, the other
        // leaders' went on; the session goes after the push
        // (KafkaSink::push).
        if let Some(e) = failed {
            session.producer.stale = true;
            failure.get_or_insert(e);
        }
        going = (0..runs.len()).filter(|&r| refusals[r].is_some()).collect();
        if going.is_empty() {
            break;
        }
        for &r in &going {
            runs[r].from = refusals[r].as_ref().expect("refused").chunk;
        }
        // The runs that need the producer renewed wait for the next push
        // (back in line, unsent) while others are sent again as they were:
        // renewing for them would number again a batch the broker may
        // have written under this epoch.
        let renewal = |r: &usize| Renewal::of(refusals[*r].as_ref().expect("refused").code);
        if going.iter().any(|r| renewal(r) == Renewal::Same) {
            for r in going.iter().filter(|r| renewal(r) != Renewal::Same) {
                session.producer.stale = true;
                session.producer.forgotten |= renewal(r) == Renewal::Fresh;
            }
            going.retain(|r| renewal(r) == Renewal::Same);
        }
        // Sent again only when a whole round, its answer awaited as long as
        // the broker may hold it, fits in the push.
        let backoff = RETRY_BACKOFF.saturating_mul(1 << retry);
        let round = backoff + sink.config.kafka.request_timeout + sink.config.timeout;
        let mut again = retry < RETRIES && failure.is_none() && Instant::now() + round < until;
        if again {
            pause(waiter, backoff, until)?;
            match again_after(sink, session, &mut runs, &going, &refusals, waiter, until) {
                Ok(lost) => {
                    // Their sequences were taken and not used.
                    session.producer.stale |= !lost.is_empty();
                    for &r in &lost {
                        defer(&runs[r], LEADER_LOST, partitions, deliveries);
                    }
                    going.retain(|r| !lost.contains(r));
                }
                Err(SinkError::Interrupted) => return Err(SinkError::Interrupted),
                Err(e) => {
                    failure.get_or_insert(e);
                    again = false;
                }
            }
        }
        if !again {
            // Given up: what the broker has of these runs is not known, so
            // the next push goes under the next epoch (or a fresh id). When
            // the session goes too, they go back in line (unsent), and the
            // reconnect paces them; otherwise their partitions rest.
            session.producer.stale = true;
            for &r in &going {
                let refusal = refusals[r].as_ref().expect("refused");
                session.producer.forgotten |= Renewal::of(refusal.code) == Renewal::Fresh;
                if failure.is_none() {
                    defer(&runs[r], (refusal.condition, &refusal.error), partitions, deliveries);
                }
            }
            break;
        }
    }
    failure.map_or(Ok(()), Err)
}

/// Why a run is deferred when its partition has no leader after a refresh.
const LEADER_LOST: (Condition, &str) =
    (Condition::LeaderMoved, "LEADER_NOT_AVAILABLE: no leader after a refresh");

/// Before the runs `going` are sent again: the producer renewed as their
/// refusals need (and their sequences taken again when it changed), and
/// their leaders as the metadata, asked again, names them now. Returns the
/// runs whose partitions have no leader now (their `leader` set to -1).
#[allow(clippy::too_many_arguments)]
fn again_after(
    sink: &KafkaSink,
    session: &mut Session,
    runs: &mut [Run],
    going: &[usize],
    refusals: &[Option<Refusal>],
    waiter: &mut dyn Wait,
    until: Instant,
) -> Result<Vec<usize>, SinkError> {
    let renewal = going.iter().map(|&r| Renewal::of(refusals[r].as_ref().expect("refused").code)).max();
    if renewal > Some(Renewal::Same) {
        session.producer.stale = true;
        session.producer.forgotten |= renewal == Some(Renewal::Fresh);
        on_bootstrap(sink, session, waiter, until, |session, waiter, deadline| {
            session.producer.renew(&mut session.bootstrap, waiter, deadline)
        })?;
        sequence(&mut session.producer, runs, going);
    }
    let topics: Vec<&str> = going.iter().map(|&r| runs[r].topic.as_str()).collect();
    let states = metadata(sink, session, &topics, waiter, until)?;
    let mut lost = Vec::new();
    for &r in going {
        let run = &mut runs[r];
        run.leader = match &states[&run.topic] {
            TopicState::Known(leaders) => {
                leaders.get(run.partition as usize).copied().flatten().unwrap_or(-1)
            }
            TopicState::Failed(..) => -1,
        };
        if run.leader < 0 {
            lost.push(r);
        }
    }
    Ok(lost)
}

/// The metadata of `topics`, as the cluster knows it or asks it.
fn metadata(
    sink: &KafkaSink,
    session: &mut Session,
    topics: &[&str],
    waiter: &mut dyn Wait,
    until: Instant,
) -> Result<HashMap<String, TopicState>, SinkError> {
    on_bootstrap(sink, session, waiter, until, |session, waiter, deadline| {
        session.cluster.states(&mut session.bootstrap, topics.iter().copied(), waiter, deadline)
    })
}

/// Runs `call` on the bootstrap connection, within a step; one the broker
/// closed since it was last used (idle past its
/// `connections.max.idle.ms`) is opened again to the same server, once,
/// and `call` run again on it.
fn on_bootstrap<T>(
    sink: &KafkaSink,
    session: &mut Session,
    waiter: &mut dyn Wait,
    until: Instant,
    mut call: impl FnMut(&mut Session, &mut dyn Wait, Instant) -> Result<T, SinkError>,
) -> Result<T, SinkError> {
    match call(session, waiter, sink.step(until)?) {
        Err(SinkError::ConnectionLost(_)) => {
            session.bootstrap = sink.reopen(waiter, sink.step(until)?)?;
            call(session, waiter, sink.step(until)?)
        }
        other => other,
    }
}

/// The sequence numbers of the runs `which`, from their first chunk not
/// answered yet, taken from `producer`.
fn sequence(producer: &mut Producer, runs: &mut [Run], which: &[usize]) {
    for &r in which {
        let run = &mut runs[r];
        for chunk in &mut run.chunks[run.from..] {
            chunk.first = producer.take(&run.topic, run.partition, chunk.members.len());
        }
    }
}

/// The records of `run` not answered yet deferred for `why`, and its
/// partition resting.
fn defer(run: &Run, why: (Condition, &str), partitions: &mut Partitions, deliveries: &mut [Delivery]) {
    let (condition, error) = why;
    let rest = partitions.rest(&run.topic, run.partition, condition, error);
    for chunk in &run.chunks[run.from..] {
        for &m in &run.members[chunk.members.clone()] {
            deliveries[m] = Delivery::Deferred(condition, error.to_string(), rest);
        }
    }
}

/// Waits `pause` on the latch, or until `until`.
fn pause(waiter: &mut dyn Wait, pause: Duration, until: Instant) -> Result<(), SinkError> {
    let end = (Instant::now() + pause).min(until);
    while Instant::now() < end {
        waiter.wait(None, end).map_err(|_| SinkError::Interrupted)?;
    }
    Ok(())
}

/// Each record to its partition, in runs per partition; a record whose
/// topic failed, whose partition has no leader now or is resting, or that
/// no request could carry, gets its verdict at once.
fn runs_of(
    batches: &[KeyBatch<Record>],
    states: &HashMap<String, TopicState>,
    records: &[&Record],
    partitions: &mut Partitions,
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
            let leader = match (partitions.resting(&batch.key, partition), leaders[partition as usize]) {
                (Some(deferred), _) => {
                    deliveries[here] = deferred;
                    continue;
                }
                (None, Some(leader)) => leader,
                (None, None) => {
                    let error = format!("LEADER_NOT_AVAILABLE: no leader for {}[{partition}]", batch.key);
                    let rest = partitions.rest(&batch.key, partition, Condition::LeaderMoved, &error);
                    deliveries[here] = Delivery::Deferred(Condition::LeaderMoved, error, rest);
                    continue;
                }
            };
            let run = *run_of.entry((b, partition)).or_insert_with(|| {
                runs.push(Run {
                    topic: batch.key.clone(),
                    partition,
                    leader,
                    members: Vec::new(),
                    chunks: Vec::new(),
                    from: 0,
                });
                runs.len() - 1
            });
            runs[run].members.push(here);
        }
    }
    runs
}

/// A run's record batches, each at most `budget` bytes (or one record,
/// which may be larger; one record each when `one_by_one`).
fn cut(members: &[usize], records: &[&Record], budget: usize, one_by_one: bool) -> Vec<Range<usize>> {
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < members.len() {
        let mut bytes = records[members[start]].size();
        let mut end = start + 1;
        while !one_by_one && end < members.len() && bytes + records[members[end]].size() <= budget {
            bytes += records[members[end]].size();
            end += 1;
        }
        chunks.push(start..end);
        start = end;
    }
    chunks
}

/// The chunks not answered yet of `mine` (runs of one leader), by rounds:
/// the first of every run, then the second, …
fn rounds_of(runs: &[Run], mine: &[usize]) -> Vec<Vec<Part>> {
    let mut rounds: Vec<Vec<Part>> = Vec::new();
    for &run in mine {
        for (round, chunk) in (runs[run].from..runs[run].chunks.len()).enumerate() {
            if rounds.len() == round {
                rounds.push(Vec::new());
            }
            rounds[round].push(Part { run, chunk });
        }
    }
    rounds
}

/// The rounds as produce requests of at most `budget` bytes each (or one
/// batch): a round in several requests where it is larger, in order, so a
/// partition's batches still go first to last.
fn requests_of(rounds: Vec<Vec<Part>>, runs: &[Run], records: &[&Record], budget: usize) -> Vec<Vec<Part>> {
    let size = |part: &Part| -> usize {
        let run = &runs[part.run];
        run.members[run.chunks[part.chunk].members.clone()].iter().map(|&m| records[m].size()).sum()
    };
    let mut requests: Vec<Vec<Part>> = Vec::new();
    for round in rounds {
        let mut bytes = 0;
        let mut request = Vec::new();
        for part in round {
            let part_bytes = size(&part);
            if !request.is_empty() && bytes + part_bytes > budget {
                requests.push(std::mem::take(&mut request));
                bytes = 0;
            }
            bytes += part_bytes;
            request.push(part);
        }
        requests.push(request);
    }
    requests
}

/// A push's requests to its leaders.
struct Leaders<'a> {
    sink: &'a KafkaSink,
    session: &'a mut Session,
    runs: &'a [Run],
    records: &'a [&'a Record],
    partitions: &'a mut Partitions,
    /// Each run's chunk refused for a condition of the broker's, if one was.
    refusals: &'a mut [Option<Refusal>],
}

/// A produce request sent and not yet answered: its correlation id on its
/// connection, its batches, when it went, and the request itself, to be
/// sent again as it is.
struct Sent<'r> {
    correlation: i32,
    parts: &'r [Part],
    at: Instant,
    request: ProduceRequest,
}

/// One leader's requests of a push, as they go.
struct Flight<'r> {
    leader: i32,
    /// The version of Produce its connection speaks; `None` until it is
    /// connected.
    version: Option<i16>,
    requests: &'r [Vec<Part>],
    /// The first request not sent yet.
    next: usize,
    in_flight: VecDeque<Sent<'r>>,
    /// When the connection last answered (or was made).
    last: Instant,
    resends: usize,
    /// Why the leader's share ended early: its connection's failure, or an
    /// answer that broke the protocol without losing it (the share goes on
    /// until the requests in flight are answered).
    failure: Option<SinkError>,
    /// Nothing more is sent or waited for.
    over: bool,
}

impl Flight<'_> {
    fn waiting(&self) -> bool {
        !self.over && !self.in_flight.is_empty()
    }

    /// Requests are left to send, and may be sent.
    fn sending(&self) -> bool {
        !self.over && self.failure.is_none() && self.next < self.requests.len()
    }
}

/// The longest wait on one leader's answer before the others' are looked
/// at: while one leader is slow, the others' answers are taken and their
/// windows filled again.
const SLICE: Duration = Duration::from_millis(20);

impl<'r> Leaders<'_> {
    /// Sends each leader its requests (`shares`), all leaders at once: up
    /// to [`IN_FLIGHT`] unanswered on each connection. Every answer that
    /// has come is taken as it comes, and the wait for more is on the
    /// oldest request's connection a [`SLICE`] at a time, so that a slow or
    /// silent leader holds up no other. Each answer is due a request
    /// timeout after its request went (and by `until`), and what it says is
    /// recorded. A request is built as it goes, without the batches of
    /// partitions that failed meanwhile. A connection lost, or an answer
    /// not come in time, with requests unanswered: they are sent again on
    /// a new connection, as they were (the same producer id, epoch and
    /// sequences: the broker drops what it has already), up to [`RESENDS`]
    /// times, as Kafka's own producer retries them. A leader that cannot be
    /// reached, or asks for quiet past the push, has its partitions'
    /// batches not sent refused (see [`Leaders::unreached`]). Returns the
    /// first leader's failure, if one failed.
    fn send(
        mut self,
        shares: &'r [(i32, Vec<Vec<Part>>)],
        deliveries: &mut [Delivery],
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<Option<SinkError>, SinkError> {
        let mut failed_runs = vec![false; self.runs.len()];
        let mut flights: Vec<Flight<'r>> = shares
            .iter()
            .map(|(leader, requests)| Flight {
                leader: *leader,
                version: None,
                requests,
                next: 0,
                in_flight: VecDeque::new(),
                last: Instant::now(),
                resends: 0,
                failure: None,
                over: false,
            })
            .collect();
        // Those connected already first: their answers come while another
        // leader is connected to.
        flights.sort_by_key(|f| !self.session.leaders.contains_key(&f.leader));
        loop {
            for flight in &mut flights {
                self.fill(flight, &failed_runs, waiter, until)?;
            }
            // Every answer that has come, without waiting.
            let mut took = false;
            for flight in flights.iter_mut() {
                while flight.waiting() {
                    match self.answer(flight, deliveries, &mut failed_runs, waiter, Instant::now(), until) {
                        Ok(true) => took = true,
                        Ok(false) => break,
                        turn => {
                            self.recover(flight, turn.map(drop), waiter, until)?;
                            break;
                        }
                    }
                }
                flight.over |= flight.in_flight.is_empty() && !flight.sending();
            }
            if took {
                continue;
            }
            let quiet = flights
                .iter()
                .filter(|f| f.sending())
                .filter_map(|f| self.session.leaders.get(&f.leader)?.throttled_until())
                .min();
            match flights.iter_mut().filter(|f| f.waiting()).min_by_key(|f| f.in_flight.front().map(|s| s.at))
            {
                Some(flight) => {
                    let slice = (Instant::now() + SLICE).min(quiet.unwrap_or(until));
                    let turn = self.answer(flight, deliveries, &mut failed_runs, waiter, slice, until);
                    self.recover(flight, turn.map(drop), waiter, until)?;
                }
                // Nothing to wait for but a throttle's end.
                None => match quiet {
                    Some(end) if end < until => {
                        pause(waiter, end.saturating_duration_since(Instant::now()), until)?
                    }
                    _ => {
                        for flight in flights.iter_mut().filter(|f| f.sending()) {
                            let why = SinkError::Timeout;
                            self.unreached(&flight.requests[flight.next..], "THROTTLED past the push", &why);
                            flight.over = true;
                        }
                        break;
                    }
                },
            }
        }
        Ok(flights.into_iter().find_map(|f| f.failure))
    }

    /// Sends what `flight` may send now: its connection made first (or
    /// made again, once its SASL session is near its end and nothing is in
    /// flight on it), nothing while the broker asks for quiet, and up to
    /// [`IN_FLIGHT`] requests unanswered. Only an interruption is an error.
    fn fill(
        &mut self,
        flight: &mut Flight<'r>,
        failed_runs: &[bool],
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<(), SinkError> {
        if !flight.sending() {
            return Ok(());
        }
        let expiring = self.session.leaders.get(&flight.leader).is_some_and(|c| c.expiring());
        if expiring && !flight.in_flight.is_empty() {
            return Ok(());
        }
        if expiring {
            self.session.leaders.remove(&flight.leader);
        }
        let opened = match self.session.leaders.get(&flight.leader) {
            Some(conn) => conn.versions.of(ApiKey::Produce).map(|version| (version, false)),
            None => self
                .connect(flight.leader, waiter, until)
                .and_then(|()| self.session.leaders[&flight.leader].versions.of(ApiKey::Produce))
                .map(|version| (version, true)),
        };
        match opened {
            Ok((version, _)) if flight.version.is_some_and(|v| v != version) => {
                flight.failure = Some(SinkError::ConnectionLost(
                    "the leader came back speaking another version of Produce".into(),
                ));
                flight.over = true;
                return Ok(());
            }
            Ok((version, new)) => {
                flight.version = Some(version);
                if new {
                    flight.last = Instant::now();
                }
            }
            Err(SinkError::Interrupted) => return Err(SinkError::Interrupted),
            // A setting the leader cannot take is the session's.
            Err(e @ SinkError::InvalidConfig(_)) => {
                flight.failure = Some(e);
                flight.over = true;
                return Ok(());
            }
            // A leader that cannot be reached, while the rest of the
            // cluster can: its partitions' batches are refused as a
            // network fault, and go the way of any refusal (produce).
            Err(e) => {
                self.unreached(&flight.requests[flight.next..], "NETWORK_EXCEPTION", &e);
                flight.over = true;
                return Ok(());
            }
        }
        if self.session.leaders[&flight.leader].throttled_until().is_some() {
            return Ok(());
        }
        while flight.sending() && flight.in_flight.len() < IN_FLIGHT {
            flight.next += 1;
            let turn = self.dispatch(flight, flight.next - 1, failed_runs, waiter, until);
            self.recover(flight, turn, waiter, until)?;
        }
        Ok(())
    }

    /// What follows a turn of `flight`: after a connection lost or an
    /// answer not come in time, with requests in flight, a new connection
    /// that sends them again (up to [`RESENDS`] times); after any other
    /// failure, the leader's share is over. Only an interruption ends the
    /// push.
    fn recover(
        &mut self,
        flight: &mut Flight<'r>,
        turn: Result<(), SinkError>,
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<(), SinkError> {
        let failure = match turn {
            Ok(()) => return Ok(()),
            Err(SinkError::ConnectionLost(_) | SinkError::Timeout)
                if flight.resends < RESENDS && !flight.in_flight.is_empty() && Instant::now() < until =>
            {
                flight.resends += 1;
                match pause(waiter, RETRY_BACKOFF, until).and_then(|()| self.resend(flight, waiter, until)) {
                    Ok(()) => return Ok(()),
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        if failure == SinkError::Interrupted {
            return Err(SinkError::Interrupted);
        }
        flight.failure = Some(failure);
        flight.over = true;
        Ok(())
    }

    /// The runs of `requests`, none of which went, refused from the first
    /// chunk of each there as `code` for `why` (a leader not reached, or
    /// not to be sent to within the push), their topics' metadata to be
    /// asked again.
    fn unreached(&mut self, requests: &[Vec<Part>], code: &str, why: &SinkError) {
        for part in requests.iter().flatten() {
            let run = &self.runs[part.run];
            if self.refusals[part.run].is_none() {
                self.session.cluster.forget(&run.topic);
                self.refusals[part.run] = Some(Refusal {
                    chunk: part.chunk,
                    code: ResponseError::NetworkException.code(),
                    condition: Condition::Unavailable,
                    error: format!("{code}: {}[{}]: {why}", run.topic, run.partition),
                });
            }
        }
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

    /// Builds and sends `flight`'s request `index`, if any of its
    /// partitions has not failed, once the broker's throttle of the
    /// connection is over.
    fn dispatch(
        &mut self,
        flight: &mut Flight<'r>,
        index: usize,
        failed_runs: &[bool],
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<(), SinkError> {
        let deadline = self.sink.step(until)?;
        let parts = &flight.requests[index];
        let Some(request) = self.request(parts, failed_runs) else { return Ok(()) };
        let conn = self.session.leaders.get_mut(&flight.leader).expect("opened");
        // Sent or not, it is in flight: a connection lost as it goes sends
        // it again.
        let sent = conn.send(&request, flight.version.expect("connected"), waiter, deadline);
        flight.in_flight.push_back(Sent {
            correlation: *sent.as_ref().unwrap_or(&-1),
            parts,
            at: Instant::now(),
            request,
        });
        sent.map(drop)
    }

    /// Takes `flight`'s oldest request's answer, waiting for it until
    /// `wait` at the latest, and records what it says: whether it came. An
    /// answer not come when due is a timeout, though one that has come is
    /// still taken then.
    #[allow(clippy::too_many_arguments)]
    fn answer(
        &mut self,
        flight: &mut Flight<'r>,
        deliveries: &mut [Delivery],
        failed_runs: &mut [bool],
        waiter: &mut dyn Wait,
        wait: Instant,
        until: Instant,
    ) -> Result<bool, SinkError> {
        // A broker answers a connection's requests one after another,
        // each once its replicas have it: an answer is due a request
        // timeout after its request went, or a timeout after the
        // answer before it came.
        let oldest = flight.in_flight.front().expect("a request in flight");
        let due = self.sink.answer_due(oldest.at, flight.last, until);
        let deadline = due.as_ref().map_or(Instant::now(), |due| wait.min(*due));
        let conn = self.session.leaders.get_mut(&flight.leader).expect("opened");
        let version = flight.version.expect("connected");
        let answer = match conn.receive::<ProduceRequest>(oldest.correlation, version, waiter, deadline) {
            Ok(answer) => answer,
            Err(SinkError::Timeout) if due.is_ok() && Instant::now() < *due.as_ref().expect("due") => {
                return Ok(false)
            }
            Err(e) => return Err(e),
        };
        conn.throttled(answer.throttle_time_ms);
        flight.last = Instant::now();
        let sent = flight.in_flight.pop_front().expect("a request in flight");
        if let Err(broken) = self.settle(sent.parts, &answer, deliveries, failed_runs) {
            flight.failure.get_or_insert(broken);
        }
        Ok(true)
    }

    /// `flight`'s old connection closed, a new one, and every request
    /// still in flight sent on it again, in order, unchanged.
    fn resend(
        &mut self,
        flight: &mut Flight<'r>,
        waiter: &mut dyn Wait,
        until: Instant,
    ) -> Result<(), SinkError> {
        self.session.leaders.remove(&flight.leader);
        self.connect(flight.leader, waiter, until)?;
        let conn = self.session.leaders.get_mut(&flight.leader).expect("opened");
        let version = flight.version.expect("connected");
        if conn.versions.of(ApiKey::Produce)? != version {
            return Err(SinkError::ConnectionLost(
                "the leader came back speaking another version of Produce".into(),
            ));
        }
        for sent in flight.in_flight.iter_mut() {
            sent.correlation = conn.send(&sent.request, version, waiter, self.sink.step(until)?)?;
            sent.at = Instant::now();
        }
        flight.last = Instant::now();
        Ok(())
    }

    /// One produce request: a record batch per chunk of a partition that has
    /// not failed, with the next sequence numbers of its partition; `None`
    /// when no chunk is left.
    fn request(&self, parts: &[Part], failed_runs: &[bool]) -> Option<ProduceRequest> {
        let producer = &self.session.producer;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let mut topics: Vec<TopicProduceData> = Vec::new();
        let mut topic_of: HashMap<&str, usize> = HashMap::new();
        for part in parts.iter().filter(|p| !failed_runs[p.run]) {
            let run = &self.runs[part.run];
            let chunk = &run.chunks[part.chunk];
            let members = &run.members[chunk.members.clone()];
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
                        sequence: next_sequence(chunk.first, i),
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

    /// What the answer to one request says of each of its batches; an
    /// error when it broke the protocol (it left out a partition).
    fn settle(
        &mut self,
        parts: &[Part],
        answer: &ProduceResponse,
        deliveries: &mut [Delivery],
        failed_runs: &mut [bool],
    ) -> Result<(), SinkError> {
        let mut broken = None;
        let mut answers: HashMap<(&str, i32), (i16, Option<String>)> = HashMap::new();
        let mut repeated = HashSet::new();
        for topic in &answer.responses {
            for partition in &topic.partition_responses {
                let message = partition.error_message.as_ref().map(|m| m.to_string());
                let key = (topic.name.0.as_str(), partition.index);
                if answers.insert(key, (partition.error_code, message)).is_some() {
                    repeated.insert(key);
                }
            }
        }
        // A partition answered twice is answered for neither: which is
        // true is not known.
        for key in &repeated {
            answers.remove(key);
        }
        for part in parts {
            let run = &self.runs[part.run];
            let members = &run.members[run.chunks[part.chunk].members.clone()];
            if failed_runs[part.run] {
                // Behind a batch that failed: not sent, or refused as out of
                // order; not the record's doing, and not known delivered.
                continue;
            }
            let Some((code, message)) = answers.remove(&(run.topic.as_str(), run.partition)) else {
                // Left out or answered twice, whether the broker wrote it is
                // not known: the partition's records go back to pending,
                // what follows goes under the next epoch, and the connection
                // goes after the push (not sent again: an answer came, and
                // said nothing sure of it).
                failed_runs[part.run] = true;
                self.session.producer.stale = true;
                broken.get_or_insert_with(|| {
                    SinkError::ConnectionLost(format!(
                        "Kafka protocol error: the produce answer left out {}[{}], or answered it twice",
                        broker_text(&run.topic),
                        run.partition
                    ))
                });
                continue;
            };
            if code == 0 || code == ResponseError::DuplicateSequenceNumber.code() {
                self.partitions.written(&run.topic, run.partition, members.len());
                members.iter().for_each(|&m| deliveries[m] = Delivery::Delivered);
                continue;
            }
            failed_runs[part.run] = true;
            let error = format!(
                "{}: {}[{}]{}",
                failed(code).unwrap_or_default(),
                run.topic,
                run.partition,
                message.map(|m| format!(": {}", broker_text(&m))).unwrap_or_default()
            );
            match Fault::of(code) {
                // The broker's: sent again, from this batch (produce).
                Fault::Broker(condition) => {
                    if condition == Condition::LeaderMoved {
                        self.session.cluster.forget(&run.topic);
                    }
                    self.refusals[part.run] = Some(Refusal { chunk: part.chunk, code, condition, error });
                }
                // One record of several may be the cause: they go back to
                // pending and then one per batch, so that only it pays.
                Fault::Message { split: true } if members.len() > 1 => {
                    self.session.producer.stale = true;
                    self.partitions.alone.insert((run.topic.clone(), run.partition));
                }
                fault => {
                    self.session.producer.stale = true;
                    members.iter().for_each(|&m| deliveries[m] = fault.verdict(&error));
                }
            }
        }
        broken.map_or(Ok(()), Err)
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

    fn run(topic: &str, members: std::ops::Range<usize>, chunks: Vec<Range<usize>>) -> Run {
        let chunks = chunks.into_iter().map(|members| Chunk { members, first: 0 }).collect();
        Run { topic: topic.into(), partition: 0, leader: 1, members: members.collect(), chunks, from: 0 }
    }

    fn shape(requests: &[Vec<Part>]) -> Vec<Vec<(usize, usize)>> {
        requests.iter().map(|r| r.iter().map(|p| (p.run, p.chunk)).collect()).collect()
    }

    #[test]
    fn batches_are_cut_by_bytes_and_requests_keep_each_partitions_order() {
        let record = Record { key: "k".into(), value: Some(vec![b'x'; 75].into()), headers: Vec::new() };
        assert_eq!(record.size(), 100);
        let records = vec![&record; 6];
        assert_eq!(cut(&[0, 1, 2, 3, 4], &records, 250, false), vec![0..2, 2..4, 4..5]);
        assert_eq!(cut(&[0, 1, 2], &records, 250, true), vec![0..1, 1..2, 2..3]);
        let mut runs =
            [run("t", 0..5, vec![0..2, 2..4, 4..5]), run("u", 5..6, cut(&[5], &records, 250, false))];
        let rounds = rounds_of(&runs, &[0, 1]);
        assert_eq!(shape(&rounds), vec![vec![(0, 0), (1, 0)], vec![(0, 1)], vec![(0, 2)]]);
        // A request budget below a round: the round in two, in order.
        let requests = requests_of(rounds, &runs, &records, 250);
        assert_eq!(shape(&requests), vec![vec![(0, 0)], vec![(1, 0)], vec![(0, 1)], vec![(0, 2)]]);
        // Sent again from a refused chunk: that chunk and those behind it.
        runs[0].from = 1;
        assert_eq!(shape(&rounds_of(&runs, &[0])), vec![vec![(0, 1)], vec![(0, 2)]]);
    }

    #[test]
    fn a_refusal_renews_the_producer_as_its_code_needs() {
        assert_eq!(Renewal::of(ResponseError::NotLeaderOrFollower.code()), Renewal::Same);
        assert_eq!(Renewal::of(ResponseError::NotEnoughReplicasAfterAppend.code()), Renewal::Same);
        assert_eq!(Renewal::of(ResponseError::RequestTimedOut.code()), Renewal::Same);
        assert_eq!(Renewal::of(ResponseError::OutOfOrderSequenceNumber.code()), Renewal::Epoch);
        for forgotten in FORGOTTEN {
            assert_eq!(Renewal::of(forgotten.code()), Renewal::Fresh);
        }
        assert!(Renewal::Same < Renewal::Epoch && Renewal::Epoch < Renewal::Fresh);
    }

    #[test]
    fn a_partition_rests_longer_each_time_in_a_row_and_not_once_written() {
        let mut partitions = Partitions::default();
        let rests: Vec<Duration> = (0..7)
            .map(|_| partitions.rest("t", 0, Condition::NotEnoughReplicas, "NOT_ENOUGH_REPLICAS"))
            .collect();
        assert_eq!(rests[..3], [REST_FIRST, REST_FIRST * 2, REST_FIRST * 4]);
        assert_eq!(rests[6], REST_MAX);
        let Some(Delivery::Deferred(Condition::NotEnoughReplicas, why, left)) = partitions.resting("t", 0)
        else {
            panic!("resting")
        };
        assert!(why.starts_with("NOT_ENOUGH_REPLICAS") && left <= REST_MAX, "{why}");
        assert!(partitions.resting("t", 1).is_none());
        partitions.written("t", 0, 3);
        assert!(partitions.resting("t", 0).is_none());
        assert_eq!(partitions.rest("t", 0, Condition::LeaderMoved, "moved"), REST_FIRST);
        // Long over, a rest is forgotten.
        let rest = partitions.resting.get_mut(&("t".to_string(), 0)).expect("resting");
        rest.until = rest.until.checked_sub(REST_MAX * 2).expect("a monotonic clock a minute old");
        partitions.prune();
        assert!(partitions.resting.is_empty());
    }
}
