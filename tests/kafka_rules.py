"""A scripted Kafka broker that keeps Kafka's rules where tansu is lenient:
the idempotent producer's, as Kafka's documentation (KIP-98, KIP-360) and
its `ProducerStateManager` state them. For the tests that count what a
strict broker holds after a fault; tansu stays for the full loop.

It speaks Kafka's wire protocol through kafka-python's own request and
response classes, at the oldest versions the dispatcher still speaks
(ApiVersions 0, Metadata 1, Produce 3, InitProducerId 0), as two nodes
(1 and 2, each on a port of its own) of which node 1 leads every
partition until `leaders` says otherwise. A node answers a produce to a
partition it does not lead with `NOT_LEADER_OR_FOLLOWER`, writing
nothing; the nodes share the partitions' logs and producer state, as
replicas do. Per producer id and partition it keeps the epoch
and the last five batches' sequences (Kafka's
`ProducerStateEntry.NUM_BATCHES_TO_RETAIN`):

- a batch that repeats one of those five is a duplicate: not appended, and
  answered as written, at the offset it was written at;
- a sequence that does not follow the last (wrapping to 0 after the
  largest int32) is out of order (`OUT_OF_ORDER_SEQUENCE_NUMBER`); a
  producer id the partition has no state for may start anywhere;
- a partition's records must be exactly one record batch
  (`INVALID_RECORD` otherwise, as Kafka refuses since Produce v3);
- an epoch below the partition's is fenced (`INVALID_PRODUCER_EPOCH`);
  a higher one starts again at sequence 0.

Faults are scripted, by the produce requests' count from 1 (`produced`):
those in `lose` are appended and their answers lost, the connection
closed instead (a broker that wrote and then died, or a network that
dropped the answer), and those in `omit` are appended and answered
without their last partition, and those in `repeat` answered with each
partition twice, its first answer and then success (broken brokers); with `hold` =
(topic, seconds), the writes to that topic of the first producer id and
epoch that writes to it wait that long before they are appended (a
request stuck on its way, or in a slow disk's queue). A quota is
scripted too: with `throttle_ms` (or `throttle_nodes` = {node: ms}, that
node's alone), every produce answer says so
(`throttle_time_ms`), and a produce request that comes on that connection
before the time is up is counted in `early` (Kafka's broker, since
KIP-219, mutes the connection instead).

Faults of a cluster, for the producer's retries inside its connection:
`moves` = {produce count: {(topic, partition): node}} moves leaders once
that many produce requests were answered; `sick` = {topic: error code}
answers every batch of a topic with that code, writing nothing
(`NOT_ENOUGH_REPLICAS`: a replica down under `min.insync.replicas`);
`appended_then_refused` = {topic: n} writes the next n batches of a
topic and answers them `NOT_ENOUGH_REPLICAS_AFTER_APPEND` (a follower
lost after the write); `ack_delay` holds every produce answer that many
seconds (`acks=all` waiting for a slow follower); and `idle` closes a
connection that sent nothing for that many seconds (Kafka's
`connections.max.idle.ms`). SASL PLAIN is offered (any user and
password); with `session_ms`, an authenticated connection's session
lasts that long (SaslAuthenticate v1's `session_lifetime_ms`, KIP-368),
and a request on it after that closes it instead, counted in `expired`,
as Kafka's broker closes it. Each record's append time (monotonic) is in
its `at`; `producer_ids` counts the ids given, `refused` the partitions
answered with an error, and `overlap` the most nodes that held produce
requests at once. A leader of -1 in `leaders` is one being elected: the
metadata names none, and every node answers `NOT_LEADER_OR_FOLLOWER`."""

import select
import struct
import threading
import time
from collections import deque
from io import BytesIO

from kafka.protocol.api_versions import ApiVersionsResponse_v0
from kafka.protocol.init_producer_id import InitProducerIdRequest_v0, InitProducerIdResponse_v0
from kafka.protocol.metadata import MetadataRequest_v1, MetadataResponse_v1
from kafka.protocol.produce import ProduceRequest_v3, ProduceResponse_v3
from kafka.protocol.sasl_authenticate import SaslAuthenticateRequest_v1, SaslAuthenticateResponse_v1
from kafka.protocol.sasl_handshake import SaslHandshakeRequest_v1, SaslHandshakeResponse_v1
from kafka.record import MemoryRecords

from harness import Listener

# Kafka's error codes (its `Errors` table).
NONE, UNKNOWN_TOPIC_OR_PARTITION, NOT_LEADER_OR_FOLLOWER, REQUEST_TIMED_OUT = 0, 3, 6, 7
NOT_ENOUGH_REPLICAS, NOT_ENOUGH_REPLICAS_AFTER_APPEND = 19, 20
OUT_OF_ORDER_SEQUENCE_NUMBER, INVALID_PRODUCER_EPOCH, INVALID_RECORD = 45, 47, 87
# Sequence numbers wrap to 0 after the largest int32.
SEQUENCES = 2 ** 31
# The last batches a partition keeps per producer id.
RETAINED = 5
NODES = (1, 2)
APIS = {0: (3, 3), 3: (1, 1), 17: (1, 1), 18: (0, 0), 22: (0, 0), 36: (1, 1)}
SASL = (17, 36)


class ProducerState:
    """One producer id's state in one partition."""

    def __init__(self, epoch):
        self.epoch = epoch
        self.batches = deque(maxlen=RETAINED)  # (first sequence, last sequence, base offset)


class Partition:
    def __init__(self):
        self.records = []  # dicts of offset, key, id (the record's `id` header), producer id
        self.producers = {}

    def append(self, batch):
        """Kafka's checks of one record batch, then the append: (error code, base offset)."""
        pid, epoch, first = batch.producer_id, batch.producer_epoch, batch.base_sequence
        records = list(batch)
        last = (first + len(records) - 1) % SEQUENCES
        state = self.producers.get(pid)
        if state is not None:
            if epoch < state.epoch:
                return INVALID_PRODUCER_EPOCH, -1
            if epoch > state.epoch:
                if first != 0:
                    return OUT_OF_ORDER_SEQUENCE_NUMBER, -1
                state = self.producers[pid] = ProducerState(epoch)
            else:
                for seen_first, seen_last, offset in state.batches:
                    if (seen_first, seen_last) == (first, last):
                        return NONE, offset
                if state.batches and first != (state.batches[-1][1] + 1) % SEQUENCES:
                    return OUT_OF_ORDER_SEQUENCE_NUMBER, -1
        else:
            state = self.producers[pid] = ProducerState(epoch)
        base = len(self.records)
        for i, record in enumerate(records):
            headers = dict(record.headers)
            self.records.append(dict(offset=base + i, key=record.key, id=headers["id"].decode(), producer_id=pid,
                                     epoch=epoch, at=time.monotonic()))
        state.batches.append((first, last, base))
        return NONE, base


class StrictKafka:
    """The broker, on a free loopback port: `create_topic`, then point
    `url` at it; `log(topic)` is what it holds, partition by partition."""

    def __init__(self):
        self.listeners = {node: Listener(lambda conn, node=node: self._serve(conn, node)) for node in NODES}
        self.port = self.listeners[NODES[0]].port
        self.lock = threading.Lock()
        self.topics = {}
        self.next_producer_id = 1000
        self.produced = 0
        self.lose = set()
        self.omit = set()
        self.answers_lost = 0
        self.hold = None
        self.throttle_ms = 0
        self.throttle_nodes = {}
        self.early = 0
        self.held = {}  # topic: the (producer id, epoch) whose writes wait
        self.fenced = 0
        self.leaders = {}  # (topic, partition): node; node 1 otherwise
        self.moves = {}
        self.sick = {}
        self.appended_then_refused = {}
        self.ack_delay = 0.0
        self.idle = None
        self.producer_ids = 0
        self.session_ms = None
        self.expired = 0
        self.busy = set()
        self.overlap = 0
        self.repeat = set()
        self.refused = 0

    @property
    def url(self):
        return f"kafka://127.0.0.1:{self.port}"

    def create_topic(self, name, partitions=3):
        with self.lock:
            self.topics[name] = [Partition() for _ in range(partitions)]

    def log(self, topic):
        with self.lock:
            return [list(p.records) for p in self.topics[topic]]

    def throttle(self, node):
        return self.throttle_nodes.get(node, self.throttle_ms)

    def leader(self, topic, partition):
        return self.leaders.get((topic, partition), NODES[0])

    def close(self):
        for listener in self.listeners.values():
            listener.close()

    def _serve(self, conn, node):
        quiet_until = 0.0
        session_ends = None
        last = time.monotonic()
        try:
            while True:
                header = self._read(conn, 4, lambda: self.idle is not None and time.monotonic() - last > self.idle)
                if not header:
                    break
                body = BytesIO(self._read(conn, struct.unpack(">i", header)[0]))
                api, version, correlation, client_len = struct.unpack(">hhih", body.read(10))
                body.read(max(client_len, 0))
                if api == 0 and time.monotonic() < quiet_until:
                    self.early += 1
                if api not in SASL and session_ends is not None and time.monotonic() > session_ends:
                    self.expired += 1
                    return
                if api == 36 and self.session_ms:
                    session_ends = time.monotonic() + self.session_ms / 1000
                answer = self._answer(api, version, body, node)
                if answer is None:
                    return
                frame = struct.pack(">i", correlation) + answer.encode()
                if api == 0:
                    quiet_until = time.monotonic() + self.throttle(node) / 1000
                conn.sendall(struct.pack(">i", len(frame)) + frame)
                last = time.monotonic()
        except OSError:
            pass
        finally:
            conn.close()

    @staticmethod
    def _read(conn, n, idle=lambda: False):
        """n bytes from `conn`; b"" at its end, or once `idle()` says the
        connection has been idle too long (then closed, as Kafka closes it)."""
        data = b""
        while len(data) < n:
            if not select.select([conn], [], [], 0.05)[0]:
                if idle():
                    return b""
                continue
            chunk = conn.recv(n - len(data))
            if not chunk:
                return b""
            data += chunk
        return data

    def _answer(self, api, version, body, node):
        """The response to one request; None to close the connection instead."""
        low, high = APIS.get(api, (0, -1))
        assert low <= version <= high, f"API {api} version {version}: not offered"
        if api == 18:
            return ApiVersionsResponse_v0(error_code=NONE, api_versions=[(k, lo, hi) for k, (lo, hi) in APIS.items()])
        if api == 17:
            SaslHandshakeRequest_v1.decode(body)
            return SaslHandshakeResponse_v1(error_code=NONE, enabled_mechanisms=["PLAIN"])
        if api == 36:
            SaslAuthenticateRequest_v1.decode(body)
            return SaslAuthenticateResponse_v1(error_code=NONE, error_message=None, auth_bytes=b"",
                                               session_lifetime_ms=self.session_ms or 0)
        if api == 22:
            InitProducerIdRequest_v0.decode(body)
            with self.lock:
                self.next_producer_id += 1
                self.producer_ids += 1
                return InitProducerIdResponse_v0(throttle_time_ms=0, error_code=NONE,
                                                 producer_id=self.next_producer_id, producer_epoch=0)
        if api == 3:
            request = MetadataRequest_v1.decode(body)
            with self.lock:
                names = request.topics if request.topics is not None else list(self.topics)
                topics = [(NONE, name, False, [(NONE, p, self.leader(name, p), list(NODES), list(NODES))
                                               for p in range(len(self.topics[name]))])
                          if name in self.topics else (UNKNOWN_TOPIC_OR_PARTITION, name, False, [])
                          for name in names]
            brokers = [(n, "127.0.0.1", listener.port, None) for n, listener in self.listeners.items()]
            return MetadataResponse_v1(brokers=brokers, controller_id=NODES[0], topics=topics)
        request = ProduceRequest_v3.decode(body)
        with self.lock:
            self.busy.add(node)
            self.overlap = max(self.overlap, len(self.busy))
        try:
            return self._produce(request, node)
        finally:
            with self.lock:
                self.busy.discard(node)

    def _produce(self, request, node):
        if self.hold:
            topic, seconds = self.hold
            for name, partitions in request.topics:
                for _, data in partitions:
                    batch = MemoryRecords(data).next_batch()
                    writer = self.held.setdefault(name, (batch.producer_id, batch.producer_epoch))
                    if name == topic and writer == (batch.producer_id, batch.producer_epoch):
                        time.sleep(seconds)
                        break
        answers = []
        with self.lock:
            self.produced += 1
            for name, partitions in request.topics:
                answered = []
                for index, data in partitions:
                    if name not in self.topics or index >= len(self.topics[name]):
                        answered.append((index, UNKNOWN_TOPIC_OR_PARTITION, -1, -1))
                        continue
                    if self.leader(name, index) != node:
                        answered.append((index, NOT_LEADER_OR_FOLLOWER, -1, -1))
                        continue
                    if name in self.sick:
                        answered.append((index, self.sick[name], -1, -1))
                        continue
                    records = MemoryRecords(data)
                    batches = []
                    while (batch := records.next_batch()) is not None:
                        batches.append(batch)
                    # Since Produce v3, exactly one record batch per
                    # partition (Kafka's LogValidator).
                    if len(batches) != 1:
                        answered.append((index, INVALID_RECORD, -1, -1))
                        continue
                    partition = self.topics[name][index]
                    held = len(partition.records)
                    code, offset = partition.append(batches[0])
                    self.fenced += code == INVALID_PRODUCER_EPOCH
                    written = len(partition.records) > held
                    if written and self.appended_then_refused.get(name, 0) > 0:
                        self.appended_then_refused[name] -= 1
                        code = NOT_ENOUGH_REPLICAS_AFTER_APPEND
                    answered.append((index, code, offset, -1))
                answers.append((name, answered))
            if self.produced in self.lose:
                self.answers_lost += 1
                return None
            self.refused += sum(a[1] != NONE for _, answered in answers for a in answered)
            if self.produced in self.omit:
                answers[-1][1].pop()
            if self.produced in self.repeat:
                answers = [(name, [a for entry in answered for a in (entry, (entry[0], NONE, 0, -1))])
                           for name, answered in answers]
            self.leaders.update(self.moves.pop(self.produced, {}))
        time.sleep(self.ack_delay)
        return ProduceResponse_v3(topics=answers, throttle_time_ms=self.throttle(node))

