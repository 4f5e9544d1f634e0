"""Real services for the integration tests: a PostgreSQL cluster (PG_BIN, as
`make test PG=…` sets it; 15 by default) with the
extension preloaded (run as the postgres user), a redis-server and a Celery
worker. Every service gets a fresh directory under /tmp and a free port, so
leftovers of an earlier run never get in the way."""

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import psycopg
import redis as redis_lib

PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


# The claim statement (sql/worker/claim.sql) in pg_stat_statements, by a
# line of it without a constant or a comment: pg_stat_statements replaces
# constants with $n when it sees a statement prepared, and since
# PostgreSQL 18 keeps no leading comment.
CLAIM_STATEMENT = "%(SELECT ended.ended FROM ended) AS ended%"
# The planner's switches every dispatcher sets (src/worker/setup.rs), for
# a test that plans or runs the dispatchers' statements itself.
DISPATCHER_PLANNER = "SET enable_bitmapscan = off; SET enable_sort = off; SET jit = off"


# A pushed batch's mark (sql/worker/mark_dispatched.sql) in pg_stat_activity,
# by its leading comment.
MARK_STATEMENT = "-- Batch $1, claimed by%"


class HeldDrain:
    """The dispatchers' drain held at a known point, for a test that acts
    mid-drain rather than racing the drain's speed: a batch pushed to the
    broker, its mark waiting. A session of the superuser's locks
    outbox.batches against writers (SHARE MODE); each time a dispatcher's
    statement waits for it (a claim, a sweeper, a mark), the lock goes and
    is taken again, until `until()` holds while a mark waits. Meanwhile
    nothing is claimed, marked or swept; the broker has what was pushed.
    `begin()`, called once the lock is first held, sets the drain going
    (enables the dispatchers, starts a sidecar): none of it passes by; what
    it returns is `begun`."""

    def __init__(self, pg, until, dbname, timeout, begin=None):
        self.gate = pg.connect(autocommit=False, dbname=dbname)
        self.gate.execute("LOCK TABLE outbox.batches IN SHARE MODE")
        self.watch = pg.connect(dbname=dbname)
        try:
            self.begun = begin() if begin is not None else None
            deadline = time.monotonic() + timeout
            while not (self.waiting(MARK_STATEMENT) and until()):
                wait_until(lambda: self.waiting() > 0, timeout=max(deadline - time.monotonic(), 1), interval=0.01,
                           message="a dispatcher's statement waiting for outbox.batches")
                if self.waiting(MARK_STATEMENT) and until():
                    break
                assert time.monotonic() < deadline, f"timed out after {timeout}s holding the drain"
                self.gate.commit()
                self.gate.execute("LOCK TABLE outbox.batches IN SHARE MODE")
        except BaseException:
            self.release()
            raise

    def waiting(self, statement="%"):
        """How many sessions wait for the lock, running `statement` (LIKE)."""
        return self.watch.execute("SELECT count(*) FROM pg_locks AS l JOIN pg_stat_activity AS a USING (pid) "
                                  "WHERE l.relation = 'outbox.batches'::regclass AND NOT l.granted "
                                  "AND a.query LIKE %s", (statement,)).fetchone()[0]

    def release(self):
        """Lets the drain go on (again: nothing). The lock may be gone
        already, with a server the test stopped or crashed."""
        for conn in (self.gate, self.watch):
            with contextlib.suppress(psycopg.Error):
                conn.close()


@contextlib.contextmanager
def drain_held(pg, until=lambda: True, dbname="postgres", timeout=120, begin=None):
    """Holds the drain (HeldDrain) for the block; it goes on after."""
    held = HeldDrain(pg, until, dbname, timeout, begin)
    try:
        yield held
    finally:
        held.release()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout=30.0, interval=0.05, message="condition", seen=None):
    """Polls `condition` until it returns a truthy value, which it returns.
    Deadlines are generous: these machines are shared and slow at times.
    On a timeout, `seen()` (when given) says what there was instead."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            found = f"; found {seen()}" if seen else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {message}{found}")
        time.sleep(interval)


def fetch(url, timeout=30):
    """The body of a GET of `url`."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def exporter(*dsns, timeout=2):
    """`python -m outbox_dispatch.exporter` serving the databases of `dsns`,
    once it answers: (its process, its /metrics URL)."""
    port = free_port()
    args = [sys.executable, "-m", "outbox_dispatch.exporter", "--listen", f"127.0.0.1:{port}",
            "--timeout", str(timeout)]
    for dsn in dsns:
        args += ["--dsn", dsn]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/metrics"

    def answers():
        try:
            return fetch(url, timeout=10)
        except OSError:
            return None

    wait_until(answers, timeout=30, message="the exporter to answer")
    return proc, url


class Listener:
    """A server on a free loopback port: each connection it accepts is
    given to `talk(conn)` on a thread of its own, until `close()`."""

    def __init__(self, talk):
        self.talk = talk
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.talk, args=(conn,), daemon=True).start()

    def close(self):
        self.closed.set()
        self.sock.close()


class SilentBroker:
    """Accepts connections and never says a word (a proxy whose backend is gone)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def make_tls_files():
    """A directory with a CA (ca.pem), a server certificate it signed for
    127.0.0.1 (server.pem, server.key), a client certificate it signed
    (client.pem, client.key), and a second CA that signed nothing
    (other-ca.pem)."""
    directory = Path(tempfile.mkdtemp(prefix="outbox-tls-"))
    os.chmod(directory, 0o755)

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=outbox test {ca}",
                "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    (directory / "san.ext").write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.ext", "-out", "server.pem")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=outbox client",
            "-keyout", "client.key", "-out", "client.csr")
    openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-out", "client.pem")
    for f in directory.iterdir():
        f.chmod(0o644)
    return directory


def as_postgres(*args, **kwargs):
    return subprocess.run(["runuser", "-u", "postgres", "--", *map(str, args)],
                          check=True, capture_output=True, text=True, **kwargs)


class Redis:
    """A redis-server on a free port. `password` sets `requirepass`; `tls`, a
    directory with server.pem, server.key and ca.pem, makes the port TLS-only,
    and `client_certificates` has it require one its CA signed of every
    client. The test client follows them (client.pem, client.key)."""

    def __init__(self, *extra_args, password=None, tls=None, client_certificates=False):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="outbox-redis-")
        self.password = password
        self.tls = tls
        self.client_certificates = client_certificates
        self.extra_args = list(extra_args) + (["--requirepass", password] if password else [])
        self.proc = None
        self.start()

    @property
    def url(self):
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self):
        if self.tls:
            ports = ["--port", "0", "--tls-port", str(self.port),
                     "--tls-auth-clients", "yes" if self.client_certificates else "no",
                     "--tls-cert-file", str(self.tls / "server.pem"), "--tls-key-file", str(self.tls / "server.key"),
                     "--tls-ca-cert-file", str(self.tls / "ca.pem")]
        else:
            ports = ["--port", str(self.port)]
        self.proc = subprocess.Popen(
            ["redis-server", *ports, "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self.dir, *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, timeout=20, message="redis-server to answer")

    def _answers(self):
        try:
            return self.client().ping()
        except redis_lib.exceptions.ConnectionError:
            return False

    def stop(self):
        if self.proc:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None

    def client(self):
        tls = {"ssl": True, "ssl_ca_certs": str(self.tls / "ca.pem")} if self.tls else {}
        if self.client_certificates:
            tls.update(ssl_certfile=str(self.tls / "client.pem"), ssl_keyfile=str(self.tls / "client.key"))
        return redis_lib.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10, **tls)

    def close(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelGroup:
    """Redis under Sentinel on loopback: a master, a replica and three
    sentinels (quorum 2) watching it as `name`; failures are noticed after
    two seconds (after one, a loaded machine saw the sentinels take a
    just-promoted master for failed and fail over again). `master_client()`
    follows the sentinels. `password` protects the master and the replica,
    `sentinel_password` the sentinels."""

    def __init__(self, name="outbox", password=None, sentinel_password=None):
        self.name = name
        self.password = password
        self.sentinel_password = sentinel_password
        auth = ["--masterauth", password] if password else []
        # The master keeps its data (AOF) across a crash, as Redis advises for
        # a replicated master that may restart: one that comes back empty
        # can wipe the replicas that sync from it.
        self.master = Redis(*auth, "--appendonly", "yes", password=password)
        self.replica = Redis("--replicaof", "127.0.0.1", str(self.master.port), *auth, password=password)
        self.sentinels = [self._sentinel(i) for i in range(3)]
        wait_until(lambda: self.master.client().info("replication")["connected_slaves"] == 1,
                   message="the replica in sync")
        wait_until(lambda: all(len(self.sentinel_client(i).execute_command("SENTINEL", "SENTINELS", self.name)) == 2
                               for i in range(3)), timeout=60, message="the sentinels to know each other")

    def _sentinel(self, i):
        port = free_port()
        directory = tempfile.mkdtemp(prefix="outbox-sentinel-")
        conf = Path(directory) / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {directory}\nlogfile {directory}/sentinel.log\n"
            f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {self.name} 2000\n"
            f"sentinel failover-timeout {self.name} 10000\n"
            f"sentinel parallel-syncs {self.name} 1\n"
            + (f"sentinel auth-pass {self.name} {self.password}\n" if self.password else "")
            + (f"requirepass {self.sentinel_password}\n" if self.sentinel_password else ""))
        proc = subprocess.Popen(["redis-server", str(conf), "--sentinel"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis_lib.Redis(host="127.0.0.1", port=port, password=self.sentinel_password, socket_timeout=10)
        wait_until(lambda: self._answers(client), timeout=20, message="a sentinel to answer")
        return {"port": port, "dir": directory, "proc": proc}

    @staticmethod
    def _answers(client):
        try:
            return client.ping()
        except redis_lib.exceptions.ConnectionError:
            return False

    @property
    def url(self):
        """kombu's form: every sentinel, then the database."""
        return ";".join(f"sentinel://127.0.0.1:{s['port']}" for s in self.sentinels) + "/0"

    def sentinel_client(self, i=0):
        return redis_lib.Redis(host="127.0.0.1", port=self.sentinels[i]["port"], password=self.sentinel_password,
                               socket_timeout=10)

    def master_port(self, sentinel=0):
        """The master's port, as sentinel number `sentinel` sees it."""
        # (Not redis-py's sentinel_* helpers, whose reply parsing breaks
        # across versions.)
        address = self.sentinel_client(sentinel).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
        return int(address[1])

    def master_client(self):
        return redis_lib.Redis(host="127.0.0.1", port=self.master_port(), password=self.password, socket_timeout=10)

    def servers(self):
        return [self.master, self.replica]

    def events(self):
        """What the sentinels did and saw (+sdown, +switch-master,
        +convert-to-slave, ...), each line naming its sentinel: for a
        failure's message."""
        entry = re.compile(r"^\d+:X \d+ \w+ \d+ ([\d:.]+) [#*] (.*)$")
        lines = []
        for s in self.sentinels:
            log = Path(s["dir"]) / "sentinel.log"
            for line in log.read_text().splitlines() if log.exists() else []:
                m = entry.match(line)
                if m and (m[2].startswith(("+", "-")) or "failover" in m[2].lower()):
                    lines.append(f"{m[1]} sentinel {s['port']}: {m[2]}")
        first = f"(at the start: master {self.master.port}, replica {self.replica.port})"
        return "\n".join([first, *sorted(lines)])

    def close(self):
        for s in self.sentinels:
            s["proc"].terminate()
            s["proc"].wait(timeout=20)
            shutil.rmtree(s["dir"], ignore_errors=True)
        for server in self.servers():
            server.close()


class RabbitMQ:
    """A RabbitMQ node on loopback (Debian's rabbitmq-server) on free ports,
    its data in a fresh directory, no plugins; `guest` may connect from
    loopback. `stop()` then `start()` is a restart that keeps durable queues
    and persistent messages. Nodes made with the same `home` share an
    Erlang cookie, and can be clustered (`join`)."""

    SBIN = Path("/usr/lib/rabbitmq/bin")

    def __init__(self, home=None, wait=True, tls=None):
        self.port = free_port()
        self.tls_port = free_port()
        self.dist_port = free_port()
        self.own_home = home is None
        self.home = home or tempfile.mkdtemp(prefix="outbox-rabbit-")
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-rabbit-node-", dir=self.home))
        self.node = f"outbox{self.port}@localhost"
        (self.dir / "plugins").write_text("[].\n")
        conf = "loopback_users = none\n"
        if tls:
            conf += (f"listeners.ssl.default = 127.0.0.1:{self.tls_port}\nssl_options.cacertfile = {tls / 'ca.pem'}\n"
                     f"ssl_options.certfile = {tls / 'server.pem'}\nssl_options.keyfile = {tls / 'server.key'}\n"
                     "ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n")
        (self.dir / "rabbitmq.conf").write_text(conf)
        self.env = dict(
            os.environ, HOME=str(self.home), RABBITMQ_NODENAME=self.node, RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port), RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.dir / "mnesia"), RABBITMQ_LOG_BASE=str(self.dir / "log"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.dir / "plugins"),
            RABBITMQ_CONFIG_FILE=str(self.dir / "rabbitmq"), RABBITMQ_PID_FILE=str(self.dir / "pid"))
        self.proc = None
        self.start(wait)

    @property
    def url(self):
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    @property
    def tls_url(self):
        """The TLS listener (a node made with `tls`)."""
        return f"amqps://guest:guest@127.0.0.1:{self.tls_port}//"

    def start(self, wait=True):
        self.proc = subprocess.Popen([self.SBIN / "rabbitmq-server"], env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        if wait:
            self.await_startup()

    def await_startup(self):
        def started():
            try:
                return self.ctl("await_startup", "--timeout", "10", timeout=30) is not None
            except subprocess.CalledProcessError:  # not yet known to epmd
                return False
        wait_until(started, timeout=120, interval=0.5, message=f"RabbitMQ node {self.node} to start")

    def ctl(self, *args, timeout=60):
        """rabbitmqctl against this node; its output."""
        return subprocess.run([self.SBIN / "rabbitmqctl", "-n", self.node, *map(str, args)], env=self.env,
                              check=True, capture_output=True, text=True, timeout=timeout).stdout

    def stop(self):
        if self.proc:
            try:
                self.ctl("stop", timeout=120)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
            self.proc = None

    def kill(self):
        """The node dies at once (SIGKILL to its whole process group)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.proc = None

    def join(self, other):
        """Makes this (running) node a member of `other`'s cluster."""
        self.ctl("stop_app")
        self.ctl("join_cluster", other.node, timeout=120)
        self.ctl("start_app", timeout=120)

    def channel(self):
        """A fresh py-amqp connection's channel (close its connection)."""
        import amqp
        connection = amqp.Connection(f"127.0.0.1:{self.port}", userid="guest", password="guest",
                                     connect_timeout=10)
        connection.connect()
        return connection.channel()

    def drain(self, queue):
        """Takes every message from `queue`: the task ids (headers["id"]),
        oldest first. A missing queue has none."""
        import amqp
        channel = self.channel()
        ids = []
        try:
            while (message := channel.basic_get(queue, no_ack=True)) is not None:
                ids.append(message.headers["id"])
        except amqp.exceptions.NotFound:
            pass
        finally:
            channel.connection.close()
        return ids

    def depth(self, queue):
        """Messages ready in `queue` (0 if it does not exist)."""
        import amqp
        channel = self.channel()
        try:
            return channel.queue_declare(queue, passive=True).message_count
        except amqp.exceptions.NotFound:
            return 0
        finally:
            channel.connection.close()

    def reset(self):
        """Deletes every queue and exchange the tests made."""
        channel = self.channel()
        try:
            for name in filter(None, self.ctl("list_queues", "name", "--quiet", "--no-table-headers").split()):
                channel.queue_delete(name)
            for name in filter(None, self.ctl("list_exchanges", "name", "--quiet", "--no-table-headers").split()):
                if not name.startswith("amq."):
                    channel.exchange_delete(name)
        finally:
            channel.connection.close()

    def close(self):
        if self.proc:
            self.kill()
        shutil.rmtree(self.home if self.own_home else self.dir, ignore_errors=True)


class Kafka:
    """A Kafka-protocol broker on loopback: tansu (a Rust implementation of
    Kafka's protocol, `cargo install tansu`), its storage in memory, so a
    restart forgets every topic and record. `authentication` asks every
    client for SASL (SCRAM users made with `add_user`). Records are read
    back with kafka-python. (tansu 0.6 serves no TLS handshake.)"""

    BIN = Path(os.environ.get("TANSU") or shutil.which("tansu") or Path.home() / ".cargo/bin/tansu")

    def __init__(self, authentication=False, advertised_port=None):
        self.port = free_port()
        self.authentication = authentication
        self.advertised_port = advertised_port or self.port
        self.proc = None
        self.start()

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    @property
    def url(self):
        return f"kafka://{self.address}"

    def start(self):
        listener = f"tcp://{self.address}"
        advertised = f"tcp://127.0.0.1:{self.advertised_port}"
        args = [self.BIN, "broker", "--listener-url", listener, "--advertised-listener-url", advertised,
                "--storage-engine", "memory://tansu/", "--cluster-id", f"outbox-{self.port}"]
        if self.authentication:
            args.append("--authentication")
        self.proc = subprocess.Popen(list(map(str, args)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

        def listening():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                return False
        wait_until(listening, timeout=60, message=f"tansu on port {self.port}")

    def kill(self):
        """The broker dies at once, and with it everything it held."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.proc = None

    def freeze(self, frozen=True):
        """Stops (or resumes) the broker's process: its connections stay
        open and nothing answers on them."""
        os.killpg(self.proc.pid, signal.SIGSTOP if frozen else signal.SIGCONT)

    def _cli(self, *args):
        return subprocess.run([str(self.BIN), *map(str, args)], check=True, capture_output=True, text=True,
                              timeout=60).stdout

    def create_topic(self, name, partitions=3):
        self._cli("topic", "create", "--broker", f"tcp://{self.address}", "--partitions", partitions, name)

    def add_user(self, name, password, mechanism="scram512"):
        self._cli("user", "create", "--broker", f"tcp://{self.address}", "--mechanism", mechanism, name, password)

    def records(self, topic):
        """Every record of `topic`, in each partition's order: dicts of
        partition, offset, key, value and headers (a dict)."""
        from kafka import KafkaConsumer, TopicPartition
        consumer = KafkaConsumer(bootstrap_servers=self.address, group_id=None, enable_auto_commit=False,
                                 consumer_timeout_ms=1500, request_timeout_ms=20000, api_version_auto_timeout_ms=20000)
        try:
            partitions = consumer.partitions_for_topic(topic) or set()
            consumer.assign([TopicPartition(topic, p) for p in sorted(partitions)])
            consumer.seek_to_beginning()
            return [dict(partition=m.partition, offset=m.offset, key=m.key, value=m.value, headers=dict(m.headers))
                    for m in consumer]
        finally:
            consumer.close()

    def codecs(self, topic, partitions):
        """The compression of each record batch of `topic` as the broker
        keeps it (Kafka's codes: 0 none, 3 lz4, 4 zstd), read with a Fetch
        of its own: a consumer decompresses without saying."""
        from kafka.protocol.fetch import FetchRequest_v4, FetchResponse_v4
        from kafka.record import MemoryRecords
        request = FetchRequest_v4(replica_id=-1, max_wait_time=100, min_bytes=0, max_bytes=64 << 20,
                                  isolation_level=0, topics=[(topic, [(p, 0, 64 << 20) for p in range(partitions)])])
        client_id = b"outbox-tests"
        body = struct.pack(">hhih", 1, 4, 1, len(client_id)) + client_id + request.encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=20) as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            answer = sock.makefile("rb")
            [size] = struct.unpack(">i", answer.read(4))
            data = answer.read(size)
        codecs = []
        for _name, answers in FetchResponse_v4.decode(data[4:]).topics:
            for partition in answers:
                assert partition[1] == 0, f"Fetch of {topic}[{partition[0]}]: error {partition[1]}"
                records = MemoryRecords(partition[-1])
                while (batch := records.next_batch()) is not None:
                    codecs.append(batch.compression_type)
        return codecs

    def ids(self, topic):
        """The `id` header of every record of `topic`."""
        return [r["headers"]["id"].decode() for r in self.records(topic)]

    def close(self):
        if self.proc:
            self.freeze(False)
            self.kill()


class TlsTerminator:
    """TLS on a free port, in front of `target_port` on loopback: the
    server certificate of `tls` (make_tls_files), and a client certificate
    its CA signed required of every client. Counts the handshakes refused."""

    def __init__(self, tls, target_port):
        import ssl
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(tls / "server.pem", tls / "server.key")
        self.context.load_verify_locations(tls / "ca.pem")
        self.context.verify_mode = ssl.CERT_REQUIRED
        self.target_port, self.refused = target_port, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._terminate, args=(conn,), daemon=True).start()

    def _terminate(self, conn):
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except OSError:
            self.refused += 1
            conn.close()
            return
        target = socket.create_connection(("127.0.0.1", self.target_port))
        for source, sink in ((tls, target), (target, tls)):
            threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def send_of(batch_send, event):
    """What the message of `event` names as its send in a batch whose send
    is `batch_send` (outbox.send_of(), outbox_core::report::send_of): the
    first 16 bytes of SHA-256 over the two ids' bytes."""
    digest = hashlib.sha256(uuid.UUID(str(batch_send)).bytes + uuid.UUID(str(event)).bytes).digest()
    return str(uuid.UUID(bytes=digest[:16]))


def decode(raw):
    """A Celery message as the extension pushed it: (envelope, body)."""
    envelope = json.loads(raw)
    body = json.loads(base64.b64decode(envelope["body"]))
    return envelope, body


def queued_ids(client, key):
    """Task ids of every message in the Redis list `key`, oldest first."""
    return [decode(m)[0]["headers"]["id"] for m in reversed(client.lrange(key, 0, -1))]


def documented_grants(role):
    """The statements docs/operations/security.md grants its example role
    `role` (app, consumer, grafana, platform, ops), as the page writes them:
    the tests give a role of each class what the docs say, no more."""
    page = (ROOT / "docs" / "operations" / "security.md").read_text()
    block = page.split("```sql\n", 1)[1].split("```", 1)[0]
    statements = [s.strip() + ";" for s in re.sub(r"--[^\n]*", "", block).split(";") if s.strip()]
    return [s for s in statements if re.search(rf"\bTO {role};$", s)]


class Cluster:
    """A PostgreSQL cluster with outbox_dispatch preloaded."""

    # Whether outbox.metrics counts what the SQL functions do
    # (outbox_ack(), outbox_inbox_claim()): the library's shared memory.
    counts_in_sql = True
    # Read-only transactions an idle dispatcher makes a second: a
    # background worker sleeps until its latch is set.
    looks_per_second = 0
    # The dispatchers' sessions in pg_stat_activity.
    dispatcher_sessions = "backend_type LIKE 'outbox dispatcher%'"
    # The outbox's owner: the extension's, who created it.
    owner = "postgres"

    def __init__(self, redis_url, preload=True, server_conf=None, **settings):
        """`settings` are outbox.* settings; `server_conf` overrides any other
        line of postgresql.conf (the tests run with fsync off)."""
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
        os.chmod(self.dir, 0o755)
        shutil.chown(self.dir, "postgres", "postgres")
        self.data = self.dir / "data"
        self.port = free_port()
        self.report_key_default = f"outbox_dispatch.reports.{self.port}"
        as_postgres(PG_BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust",
                    "--no-sync", "-E", "UTF8", "--locale=C")
        conf = {
            "port": self.port,
            "listen_addresses": "''",
            "unix_socket_directories": f"'{self.dir}'",
            "fsync": "off",
            "max_worker_processes": 40,
            "max_prepared_transactions": 10,
            "logging_collector": "off",
            "log_line_prefix": "'%m [%p] '",
            "outbox.redis_url": f"'{redis_url}'",
            "outbox.database": "'postgres'",
            # The clusters share one Redis, and database postgres has the
            # same OID in each: a key of their own, or one's dispatchers
            # take another's reports as stale (docs/reference/settings.md).
            "outbox.report_key": f"'{self.report_key_default}'",
        }
        if preload:
            conf["shared_preload_libraries"] = "'outbox_dispatch'"
        conf.update(server_conf or {})
        conf.update({f"outbox.{k}": self._quote(v) for k, v in settings.items()})
        with open(self.data / "postgresql.conf", "a") as f:
            for k, v in conf.items():
                f.write(f"{k} = {v}\n")
        self.log = self.dir / "server.log"
        self.start()

    @staticmethod
    def _quote(value):
        return value if isinstance(value, (int, float)) else f"'{value}'"

    def pg_ctl(self, *args):
        return as_postgres(PG_BIN / "pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "120", *args)

    def start(self):
        self.pg_ctl("start")

    def stop(self, mode="fast"):
        self.pg_ctl("stop", "-m", mode)

    def restart(self):
        self.pg_ctl("restart", "-m", "fast")

    def connect(self, autocommit=True, dbname="postgres", user="postgres", **kwargs):
        return psycopg.connect(host=str(self.dir), port=self.port, user=user,
                               dbname=dbname, autocommit=autocommit, **kwargs)

    def connect_as(self, role, documented, dbname="postgres", **kwargs):
        """A connection as `role`, made (once) and given by the outbox's
        owner what docs/operations/security.md grants its role
        `documented` (documented_grants())."""
        with self.connect(dbname=dbname) as conn:
            conn.execute(f"DO $$ BEGIN CREATE ROLE {role} LOGIN; "
                         "EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        for statement in documented_grants(documented):
            # A role's membership is the superuser's to give (pg_monitor),
            # an object's privileges its owner's.
            grantor = self.owner if " ON " in statement else "postgres"
            with self.connect(dbname=dbname, user=grantor) as conn:
                conn.execute(statement.replace(f" TO {documented};", f" TO {role};"))
        return self.connect(dbname=dbname, user=role, **kwargs)

    def sql(self, query, params=None, dbname="postgres"):
        with self.connect(dbname=dbname) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else None

    def value(self, query, params=None, dbname="postgres"):
        rows = self.sql(query, params, dbname=dbname)
        return rows[0][0] if rows else None

    def install(self, dbname="postgres"):
        """Puts the outbox into `dbname`: CREATE EXTENSION."""
        self.sql("CREATE EXTENSION outbox_dispatch", dbname=dbname)

    def reset(self, **settings):
        """Every `outbox.*` setting back to what the cluster was made with,
        then `settings` (ALTER SYSTEM RESET ALL, then configure())."""
        self.sql("ALTER SYSTEM RESET ALL")
        self.configure(**settings)

    def configure(self, **settings):
        """Sets `outbox.*` settings with ALTER SYSTEM and reloads."""
        with self.connect() as conn:
            for k, v in settings.items():
                conn.execute(f"ALTER SYSTEM SET outbox.{k} = {self._quote(v)}")
            conn.execute("SELECT pg_reload_conf()")

    def empty(self, tables="outbox.log, outbox.batches, outbox.outcomes"):
        """Truncates `tables`, again when a dispatcher's statement that
        locks them in another order makes a deadlock of it."""
        for attempt in range(5):
            try:
                return self.sql(f"TRUNCATE {tables}")
            except psycopg.errors.DeadlockDetected:
                if attempt == 4:
                    raise

    def set_in(self, conn, **settings):
        """`outbox.*` settings the SQL API reads, for `conn`'s statements:
        SET there (as a superuser, whose these are)."""
        for k, v in settings.items():
            conn.execute(f"SET outbox.{k} = {self._quote(v)}")

    def setting(self, name):
        """The value of `outbox.<name>` the dispatchers read."""
        return self.value(f"SHOW outbox.{name}")

    def claim_as(self, dispatcher, limit, bytes=1 << 30):
        """Claims up to `limit` events (and `bytes` of their texts) as
        dispatcher `dispatcher` would (sql/worker/lock_cursor.sql,
        restore_turn.sql and lock_cursor.sql again if it locked nothing,
        then claim.sql), and commits; returns the batch's id and each
        event's send (what its message names), by event id; (None, {})
        when nothing was claimed."""
        with self.connect(autocommit=False) as conn:
            self.take_turn(conn)
            self.prepare_claim(conn, bytes)
            rows = conn.execute(f"EXECUTE claim({int(limit)}, {int(dispatcher)})").fetchall()
            conn.commit()
        return rows[0][17], {str(r[0]): send_of(r[18], r[0]) for r in rows if r[0] is not None}

    def claim_enqueued(self, dispatcher, ids):
        """Claims the events `ids`, enqueued while the dispatchers were
        paused, as dispatcher `dispatcher` would, in one batch; returns it
        as claim_as() does. A dispatcher's last claim before the pause may
        have left its window open (a full page does), with a snapshot taken
        before they were enqueued: that window's claim holds none of them,
        and the next, a window of its own, holds them all."""
        wanted = {str(i) for i in ids}
        for _ in range(3):
            batch, sends = self.claim_as(dispatcher, max(len(wanted), 100))
            if wanted & set(sends):
                assert wanted <= set(sends), ("claimed apart", wanted - set(sends))
                return batch, sends
        raise AssertionError(f"three claims held none of {sorted(wanted)[:3]}...")

    @staticmethod
    def prepare_claim(conn, bytes=1 << 30):
        """Prepares sql/worker/claim.sql in `conn` as `claim(limit,
        dispatcher)`, planned as a dispatcher plans it, its bytes bounded
        by `bytes` (by default outbox.max_batch_bytes's most, 1GB)."""
        conn.execute(DISPATCHER_PLANNER)
        claim = (ROOT / "sql" / "worker" / "claim.sql").read_text().replace("$3", str(int(bytes)))
        conn.execute(f"PREPARE claim(int, int) AS {claim}")

    @staticmethod
    def take_turn(conn):
        """Takes the claims' turn in `conn`'s transaction, as a dispatcher
        does (src/worker/store/claim.rs); returns whether the row had to be
        put back."""
        worker = ROOT / "sql" / "worker"
        if conn.execute((worker / "lock_cursor.sql").read_text()).fetchall():
            return False
        conn.execute((worker / "restore_turn.sql").read_text())
        assert conn.execute((worker / "lock_cursor.sql").read_text()).fetchall() == [()]
        return True

    def log_text(self):
        return self.log.read_text(errors="replace")

    def report_list(self, dbname="postgres"):
        """The Redis list workers report the events of database `dbname` to:
        outbox.report_key, a colon and the database's OID."""
        key, oid = self.sql("SELECT current_setting('outbox.report_key'), oid FROM pg_database "
                            "WHERE datname = %s", (dbname,))[0]
        return f"{key}:{oid}"

    def age_generations(self):
        """Moves back a day every time the rotation waits for
        (sql/rotation.sql): whatever waits for its time is due."""
        self.sql("UPDATE outbox.generations SET started_at = started_at - interval '1 day', "
                 "ended_at = ended_at - interval '1 day'")

    def restore_generation_times(self):
        """The generations' times back to now, after age_generations():
        the next tests' dispatchers find nothing due that was moved back."""
        self.sql("UPDATE outbox.generations SET started_at = CASE WHEN started_at IS NOT NULL THEN now() END, "
                 "ended_at = CASE WHEN ended_at IS NOT NULL THEN now() END")

    def exposition(self):
        """What Prometheus scrapes of this host: the exporter
        (`python -m outbox_dispatch.exporter`) serving database postgres."""
        proc, url = exporter(f"host={self.dir} port={self.port} user=postgres dbname=postgres")
        try:
            return fetch(url)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    def metric(self, name, **labels):
        """The value of one sample of outbox.metrics."""
        return self.value("SELECT value FROM outbox.metrics WHERE name = %s AND labels = %s::jsonb",
                          (name, json.dumps(labels)))

    def dispatcher_pids(self):
        return [r[0] for r in self.sql("SELECT pid FROM outbox.workers WHERE pid IS NOT NULL")]

    def wait_idle(self):
        try:
            wait_until(lambda: self.value("SELECT bool_and(state = 'idle') FROM outbox.workers"),
                       timeout=60, message="idle dispatchers")
        except AssertionError as e:
            raise AssertionError(f"{e}: {self.sql('TABLE outbox.workers')}\n{self.log_text()[-3000:]}") from None

    def count(self, status):
        return self.value("SELECT count(*) FROM outbox.events WHERE status = %s", (status,))

    def close(self):
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class CeleryWorker:
    """A stock Celery 5 worker: tests/celery_app.py by default, in the solo
    pool; `pool="prefork"` with `concurrency` child processes."""

    def __init__(self, broker_url, queues=("celery",), app="celery_app", pool="solo", concurrency=1, env=None,
                 extra_args=()):
        env = dict(os.environ, OUTBOX_TEST_BROKER=broker_url, PYTHONPATH=str(ROOT / "tests"), **(env or {}))
        self.log = tempfile.NamedTemporaryFile(prefix="outbox-celery-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [VENV_BIN / "celery", "-A", app, "worker", f"--pool={pool}", f"--concurrency={concurrency}",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-Q", ",".join(queues),
             "--loglevel=INFO", *extra_args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_text(self):
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout=60):
        wait_until(lambda: "ready." in self.log_text(), timeout=timeout, message="the Celery worker to be ready")

    def close(self):
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        os.unlink(self.log.name)
