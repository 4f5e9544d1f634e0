"""A broker that misbehaves cannot exhaust a dispatcher's memory, hold off a
shutdown, or take the server down: fake servers written for these tests
answer like Redis for the connection's set-up and then stream an endless
bulk string, announce a huge array, drip one byte at a time, send replies no
command asked for, or garbage. Each time the dispatcher's resident memory
stays under the bound docs/design/how-it-works.md gives, a fast shutdown takes seconds, no
process crashes, and once the real Redis is back every event is delivered,
none failed, from the same dispatcher process."""

import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest

from harness import Cluster, Listener, Redis, queued_ids, wait_until

# A misbehaving broker is the broker's side alone (the dispatcher's
# statements are the same on every PostgreSQL): .ci/run runs these under its
# first PostgreSQL version only.
pytestmark = pytest.mark.broker_only

# The dispatcher's own bound (core/src/resp.rs Limits: 64 KiB a reply, 17 MiB
# for the report read) plus what a PostgreSQL backend uses anyway.
RSS_BOUND_KB = 160 * 1024


class FakeRedis:
    """Speaks enough RESP for a dispatcher's connect (SELECT, PING, CONFIG
    GET, the report read) and answers pushes (LPUSH) as `mode` says."""

    def __init__(self, mode):
        self.mode = mode
        self.pushes = 0
        self.listener = Listener(self._serve)
        self.port, self.closed = self.listener.port, self.listener.closed

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def _commands(buf):
        """Whole commands at the front of buf: (list of [name, args...], bytes used)."""
        commands, at = [], 0
        while True:
            start = at
            end = buf.find(b"\r\n", at)
            if end < 0 or buf[at:at + 1] != b"*":
                return commands, start
            count, at = int(buf[at + 1:end]), end + 2
            args = []
            for _ in range(count):
                end = buf.find(b"\r\n", at)
                if end < 0:
                    return commands, start
                length = int(buf[at + 1:end])
                if len(buf) < end + 2 + length + 2:
                    return commands, start
                args.append(buf[end + 2:end + 2 + length])
                at = end + 2 + length + 2
            commands.append(args)

    @staticmethod
    def _answer(args):
        name = args[0].upper()
        if name == b"CONFIG":
            return b"*2\r\n$%d\r\n%s\r\n$0\r\n\r\n" % (len(args[2]), args[2])
        if name == b"PING":
            return b"+PONG\r\n"
        if name == b"EVAL":
            return b"*0\r\n"
        if name in (b"LPUSH", b"WAIT"):
            return b":1\r\n"
        return b"+OK\r\n"

    def _serve(self, conn):
        buf = b""
        try:
            while not self.closed.is_set():
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                commands, used = self._commands(buf)
                buf = buf[used:]
                if any(c[0].upper() == b"LPUSH" for c in commands):
                    self.pushes += 1
                    return self._misbehave(conn, commands)
                conn.sendall(b"".join(self._answer(c) for c in commands))
        except OSError:
            return
        finally:
            conn.close()

    def _misbehave(self, conn, commands):
        if self.mode == "extra":
            conn.sendall(b"".join(self._answer(c) for c in commands) + b":7\r\n")
            time.sleep(5)
            return
        if self.mode == "garbage":
            conn.sendall(b"\x00\xffHTTP/1.1 200 OK\r\n\r\n<html>" * 100)
            time.sleep(5)
            return
        head, chunk, pause = {
            "bulk": (b"$4000000000\r\n", b"x" * 65536, 0),
            "array": (b"*4000000000\r\n", b":1\r\n" * 16384, 0),
            "nested": (b"*16000\r\n", b"*16000\r\n" + b":1\r\n" * 4000, 0),
            "drip": (b"+", b"x", 0.05),
        }[self.mode]
        conn.sendall(head)
        deadline = time.monotonic() + 120
        while not self.closed.is_set() and time.monotonic() < deadline:
            conn.sendall(chunk)
            if pause:
                time.sleep(pause)

    def close(self):
        self.listener.close()


def rss_kb(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def postmaster_pid(pg):
    return int((pg.data / "postmaster.pid").read_text().split()[0])


@pytest.mark.parametrize("mode", ["bulk", "array", "nested", "drip", "extra", "garbage"])
def test_a_misbehaving_broker_is_dropped_within_bounds(redis_server, mode):
    fake = FakeRedis(mode)
    pg = Cluster(fake.url, broker_timeout="2s", reconnect_delay_min="200ms", reconnect_delay_max="500ms",
                 heartbeat_interval="1s")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        [pid] = wait_until(pg.dispatcher_pids, message="the dispatcher")
        postmaster = postmaster_pid(pg)
        queue = f"q_fault_{mode}"
        ids = [str(r[0]) for r in pg.sql(
            "SELECT outbox_enqueue('fault', '{}', queue => %s) FROM generate_series(1, 10)", (queue,))]
        wait_until(lambda: fake.pushes >= 3, timeout=60, message="three pushes to the fake broker")
        peak = 0
        for _ in range(30):
            peak = max(peak, rss_kb(pid))
            time.sleep(0.1)
        assert peak < RSS_BOUND_KB, f"{peak} kB resident"
        expected = "did not answer within outbox.broker_timeout" if mode == "drip" else "protocol error"
        wait_until(lambda: expected in pg.log_text(), message=f"{expected!r} in the log")
        assert pg.count("failed") == 0

        # The real Redis: everything goes out, from the same processes.
        pg.configure(redis_url=redis_server.url)
        wait_until(lambda: set(ids) <= set(queued_ids(redis_server.client(), queue)), timeout=60,
                   message="every event once the real Redis is back")
        wait_until(lambda: pg.count("dispatched") == 10, message="every event marked")
        assert pg.count("failed") == 0
        assert pg.dispatcher_pids() == [pid] and postmaster_pid(pg) == postmaster

        # Misbehaving again, in the middle of a push: a fast stop is prompt.
        pg.configure(redis_url=fake.url)
        pushes = fake.pushes
        pg.sql("SELECT outbox_enqueue('fault', '{}', queue => %s)", (queue,))
        wait_until(lambda: fake.pushes > pushes, timeout=30, message="a push to the fake broker again")
        time.sleep(0.3)
        started = time.monotonic()
        pg.stop("fast")
        assert time.monotonic() - started < 5
        log = pg.log_text()
        assert "terminated by signal" not in log and "was terminated" not in log, log[-3000:]
    finally:
        pg.close()
        fake.close()


class CuttingProxy:
    """Forwards to a real Redis, and drops the connection (both ends) when
    a client sends its (allowed + 1)th LPUSH, which never reaches Redis."""

    def __init__(self, upstream_port, allowed):
        self.upstream_port = upstream_port
        self.allowed = allowed
        self.cuts = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._forward, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pump(source, sink):
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                s.close()

    def _forward(self, client, upstream):
        buf, pushes = b"", 0
        try:
            while data := client.recv(65536):
                buf += data
                commands, used = FakeRedis._commands(buf)
                at = 0
                for command in commands:
                    size = len(self._encode(command))
                    if command[0].upper() == b"LPUSH":
                        pushes += 1
                        if pushes > self.allowed:
                            self.cuts += 1
                            return
                    upstream.sendall(buf[at:at + size])
                    at += size
                buf = buf[used:]
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                s.close()

    @staticmethod
    def _encode(args):
        return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)

    def close(self):
        self.sock.close()


def test_a_push_cut_part_way_keeps_what_its_round_trips_confirmed(redis_server):
    """A claim takes about ten round trips (outbox.max_batch_bytes 64kB,
    8 kB events); every connection is cut at its third push, which never
    reaches Redis. What the first two confirmed stays dispatched: every
    event arrives exactly once (sending them again would repeat the first
    two round trips of every claim forever)."""
    proxy = CuttingProxy(redis_server.port, allowed=2)
    pg = Cluster(proxy.url, batch_size=60, max_batch_bytes="64kB", reconnect_delay_min="100ms",
                 reconnect_delay_max="300ms")
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.wait_idle()
        ids = [str(r[0]) for r in pg.sql(
            "SELECT outbox_enqueue('cut', jsonb_build_object('blob', repeat('x', 8000)), queue => 'q_cut') "
            "FROM generate_series(1, 60)")]
        wait_until(lambda: pg.count("dispatched") == 60, timeout=120,
                   message=f"every event dispatched ({pg.count('dispatched')}, {proxy.cuts} cuts)")
        queued = queued_ids(redis_server.client(), "q_cut")
        assert sorted(queued) == sorted(ids), "each event exactly once"
        assert proxy.cuts >= 3
        assert pg.count("failed") == 0
    finally:
        pg.close()
        proxy.close()


@contextlib.contextmanager
def acl_user(denied, **settings):
    """A Redis whose dispatcher user may do everything but `denied`, and a
    cluster pushing to it as that user."""
    redis = Redis(password="admin-pw")
    redis.client().execute_command("ACL", "SETUSER", "pusher", "on", ">pusher-pw", "~*", "&*", "+@all", denied)
    pg = Cluster(f"redis://pusher:pusher-pw@127.0.0.1:{redis.port}/0", reconnect_delay_min="100ms",
                 reconnect_delay_max="200ms", **settings)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        yield redis, pg
    finally:
        pg.close()
        redis.close()


def assert_refused_once_and_pushing(pg, redis, queue):
    """The refusal logged once, the connection kept, and events pushed."""
    ids = [str(r[0]) for r in pg.sql(
        "SELECT outbox_enqueue('acl', '{}', queue => %s) FROM generate_series(1, 5)", (queue,))]
    wait_until(lambda: pg.count("dispatched") == 5, message="the events pushed")
    time.sleep(3)  # thirty collect cycles
    log = pg.log_text()
    assert log.count("refused to read the reports") == 1, log[-3000:]
    assert "NOPERM" in log and "reconnecting" not in log, log[-3000:]
    assert pg.value("SELECT coalesce(sum(value), 0) FROM outbox.metrics "
                    "WHERE name = 'outbox_reconnects_total'") == 0
    assert pg.value("SELECT bool_and(connected) FROM outbox.workers")
    assert sorted(queued_ids(redis.client(), queue)) == sorted(ids)


def test_a_report_read_the_acl_denies_is_reported_once():
    """A Redis user whose ACL denies scripts (the report read is one): the
    refusal is logged once, the connection stays (no reconnect each
    collect), and events are pushed as usual."""
    with acl_user("-@scripting") as (redis, pg):
        wait_until(lambda: "refused to read the reports" in pg.log_text(), message="the refusal logged")
        assert_refused_once_and_pushing(pg, redis, "q_acl")


def test_reports_are_read_with_eval_when_the_acl_denies_eval_ro():
    """An ACL that denies EVAL_RO and allows EVAL: the reports are read with
    EVAL (as on a Redis without EVAL_RO), not refused for good."""
    with acl_user("-eval_ro", report_key="outbox_reports") as (redis, pg):
        reports = pg.report_list()
        redis.client().rpush(reports, b"not a report")
        wait_until(lambda: redis.client().llen(reports) == 0, message=f"the report read and trimmed "
                   f"({pg.log_text()[-2000:]})")
        log = pg.log_text()
        assert "refused to read the reports" not in log and "reconnecting" not in log, log[-3000:]


def test_a_trim_the_acl_denies_is_the_reads_refusal():
    """An ACL that lets the reports be read but not trimmed (LTRIM): the
    refusal is logged once, like a read's; the connection stays (it was
    dropped at every collect)."""
    with acl_user("-ltrim", report_key="outbox_reports") as (redis, pg):
        redis.client().rpush(pg.report_list(), b"not a report")
        wait_until(lambda: "refused to read the reports" in pg.log_text(), message="the refusal logged")
        assert_refused_once_and_pushing(pg, redis, "q_trim")
