"""What the tests of outbox_dispatch without the library share: a server
with no shared_preload_libraries and roles that are not superusers, as on a
managed service, and the `outbox-dispatch` command; and the suite's second
mode (OUTBOX_HOST=sidecar), where the tests of the dispatcher run against
`outbox-dispatch run` on such a server."""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness import PG_BIN, ROOT, Cluster, as_postgres, documented_grants, free_port, wait_until

BIN = os.environ.get("OUTBOX_DISPATCH_BIN", str(ROOT / "target" / "debug" / "outbox-dispatch"))
# Which host the suite's tests of the dispatcher run on: "library" (the
# background workers of a server that preloads it) or "sidecar".
HOST = os.environ.get("OUTBOX_HOST", "library")


def run(*args, env=None):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@contextmanager
def plain_server(**settings):
    """A server without the library; roles owner, writer, monitor (of
    pg_monitor) and other, all LOGIN and none superuser."""
    pg = Cluster("redis://127.0.0.1:1/0", preload=False, **settings)
    try:
        pg.sql("CREATE ROLE owner LOGIN")
        pg.sql("CREATE ROLE writer LOGIN")
        pg.sql("CREATE ROLE monitor LOGIN IN ROLE pg_monitor")
        pg.sql("CREATE ROLE other LOGIN")
        yield pg
    finally:
        pg.close()


def dsn(pg, user, dbname):
    return f"host={pg.dir} port={pg.port} user={user} dbname={dbname}"


def fresh_database(pg, name, owner="owner"):
    pg.sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    pg.sql(f"CREATE DATABASE {name} OWNER {owner}")


def install(pg, dbname, owner="owner"):
    """A fresh database `dbname`, installed by its owner, with writer
    granted as docs/guides/managed.md says."""
    fresh_database(pg, dbname, owner=owner)
    result = run("install", "--dsn", dsn(pg, owner, dbname))
    assert result.returncode == 0, result.stderr
    with pg.connect(dbname=dbname, user=owner) as conn:
        for statement in documented_grants("app") + documented_grants("consumer"):
            conn.execute(statement.replace(" TO app;", " TO writer;").replace(" TO consumer;", " TO writer;"))
        conn.execute("GRANT EXECUTE ON FUNCTION outbox_skip(uuid), outbox_inbox_claim(uuid, text), "
                     "outbox_subscribe(text, text, text, integer, integer, interval) TO writer")


class Sidecar:
    """`outbox-dispatch run` on database `dbname` as its owner; its log in a file."""

    def __init__(self, pg, dbname, *args, broker=None, env=None, owner="owner", to=None):
        """`to`: a DSN of its own, in place of `pg`'s."""
        self.log_file = tempfile.NamedTemporaryFile(prefix="sidecar-", suffix=".log", delete=False)
        command = [BIN, "run", "--dsn", to or f"{dsn(pg, owner, dbname)} sslmode=disable", *args]
        if broker:
            command += ["--broker-url", broker]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log_file,
                                     env={**os.environ, **(env or {})})

    def log(self):
        with open(self.log_file.name) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout=30, meanwhile=None):
        """Sends `sig`, then calls `meanwhile()` (when given); (exit
        status, seconds it took)."""
        started = time.monotonic()
        self.proc.send_signal(sig)
        if meanwhile is not None:
            meanwhile()
        status = self.proc.wait(timeout=timeout)
        return status, time.monotonic() - started

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log_file.name)


class Standby(Cluster):
    """A streaming replica of `primary` (pg_basebackup), hot standby."""

    def __init__(self, primary):
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
        os.chmod(self.dir, 0o755)
        shutil.chown(self.dir, "postgres", "postgres")
        self.data, self.port, self.log = self.dir / "data", free_port(), self.dir / "server.log"
        as_postgres(PG_BIN / "pg_basebackup", "-h", str(primary.dir), "-p", str(primary.port), "-U", "postgres",
                    "-D", self.data, "-R", "-X", "stream", "--checkpoint=fast", "--no-sync")
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(f"port = {self.port}\nunix_socket_directories = '{self.dir}'\n")
        self.start()


def scrape(port, request=b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"):
    """(status line, body) of one request to the sidecar's endpoint."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body.decode()


def samples(text):
    """{series: value} of an exposition, a series as written
    (`name{label="value"}`)."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            found[series] = float(value)
    return found


# The settings that are the sidecar's own (sidecar/src/run.rs, OWN_SETTINGS)
# by the option that gives them, and those only the library reads.
SIDECAR_OPTIONS = {
    "broker_url": "--broker-url",
    "redis_url": "--broker-url",
    "broker_password_file": "--broker-password-file",
    "redis_password_file": "--broker-password-file",
    "broker_tls_ca_file": "--broker-tls-ca-file",
    "broker_tls_cert_file": "--broker-tls-cert-file",
    "broker_tls_key_file": "--broker-tls-key-file",
    "kafka_sasl_plain_cleartext": "--kafka-sasl-plain-cleartext",
    "redis_tls_ca_file": "--broker-tls-ca-file",
    "redis_sentinel_password_file": "--sentinel-password-file",
}
LIBRARY_ONLY_SETTINGS = {"database"}


class SidecarCluster(Cluster):
    """The suite's second mode: what a managed service looks like. A server
    without the library, database postgres owned by role owner, who is no
    superuser, installs the outbox (`outbox-dispatch install`) and runs
    the dispatchers (`outbox-dispatch run`, `workers` of them). The tests
    themselves connect as postgres, the operator.

    Settings go where the sidecar reads them: the dispatchers' into
    outbox.settings, then a SIGHUP; the broker's URL and files on its
    command line, which a restart of the sidecar changes; `metric()`
    scrapes its /metrics."""

    counts_in_sql = False
    looks_per_second = 50  # its poll, --poll-interval's default 20 ms
    dispatcher_sessions = "application_name = 'outbox-dispatch'"
    owner = "owner"

    def __init__(self, redis_url, server_conf=None, **settings):
        super().__init__(redis_url, preload=False, server_conf=server_conf)
        self.sql("CREATE ROLE owner LOGIN")
        self.sql("ALTER DATABASE postgres OWNER TO owner")
        # As docs/guides/managed.md asks: the rotation sees every transaction.
        self.sql("GRANT pg_read_all_stats TO owner")
        self.metrics_port = free_port()
        self.base = {"broker_url": redis_url, "workers": 1, "report_key": self.report_key_default, **settings}
        self.own = {}
        self.sidecar = None
        self.earlier_logs = ""

    def install(self, dbname="postgres"):
        assert dbname == "postgres", "the second mode serves database postgres"
        result = run("install", "--dsn", dsn(self, "owner", dbname))
        assert result.returncode == 0, result.stderr
        self.reset()

    def reset(self, **settings):
        self._apply({**self.base, **settings}, replace=True)

    def configure(self, **settings):
        self._apply(settings, replace=False)

    def _apply(self, settings, replace):
        """The dispatchers' settings into outbox.settings (in place of all
        there were, with `replace`), the sidecar's own on its command line:
        a SIGHUP, or a restart when these changed."""
        settings = {k: v for k, v in settings.items() if k not in LIBRARY_ONLY_SETTINGS}
        # redis_url is broker_url's former name: one option, given once.
        own = {("broker_url" if k == "redis_url" else k): str(v) for k, v in settings.items()
               if k in SIDECAR_OPTIONS or k == "workers"}
        with self.connect(user="owner") as conn, conn.transaction():
            if replace:
                conn.execute("DELETE FROM outbox.settings")
            for name, value in settings.items():
                if name not in SIDECAR_OPTIONS and name != "workers":
                    conn.execute("INSERT INTO outbox.settings (name, value) VALUES (%s, %s) "
                                 "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                                 (f"outbox.{name}", str(value)))
        own = own if replace else {**self.own, **own}
        if self.sidecar is None or own != self.own:
            self.own = own
            self._restart_sidecar()
        else:
            self.sidecar.proc.send_signal(signal.SIGHUP)

    def set_in(self, conn, **settings):
        """The owner's rows of outbox.settings, which the SQL API reads
        without the library (a SET is not), for every session."""
        self.configure(**settings)

    def setting(self, name):
        """The value of `outbox.<name>` the owner set; None: the default."""
        return self.value("SELECT outbox.setting(%s)", (f"outbox.{name}",))

    def _restart_sidecar(self):
        self._stop_sidecar()
        dispatchers = int(self.own.get("workers", 1))
        # Rows of dispatchers this sidecar no longer runs.
        self.sql("DELETE FROM outbox.sidecar_workers WHERE worker >= %s", (dispatchers,))
        if dispatchers == 0:
            return
        args = ["--dispatchers", str(dispatchers), "--metrics-listen", f"127.0.0.1:{self.metrics_port}"]
        for name, value in self.own.items():
            if name in SIDECAR_OPTIONS:
                args += [SIDECAR_OPTIONS[name], value]
        self.sidecar = Sidecar(self, "postgres", *args)

    def _stop_sidecar(self):
        if self.sidecar is not None:
            if self.sidecar.proc.poll() is None:
                self.sidecar.stop()
            self.earlier_logs += self.sidecar.log()
            self.sidecar.close()
            self.sidecar = None

    def exposition(self):
        """What Prometheus scrapes of this host: the sidecar's /metrics, once
        the database answered it (outbox_up 1)."""
        up = 'outbox_up{database="postgres"}'

        def scraped():
            try:
                text = scrape(self.metrics_port)[1]
            except OSError:  # not listening yet: a sidecar just started
                return None
            return text if samples(text).get(up) == 1 else None
        return wait_until(scraped, message="the sidecar's /metrics with the database up")

    def metric(self, name, **labels):
        """The value of one sample of the sidecar's /metrics (of database
        postgres); None when it shows none."""
        labels = {"database": "postgres", **{k: str(v) for k, v in labels.items()}}
        for series, value in samples(self.exposition()).items():
            named, _, written = series.partition("{")
            if named == name and dict(re.findall(r'(\w+)="([^"]*)"', written)) == labels:
                return value
        return None

    def report_list(self, dbname="postgres"):
        key, oid = self.sql("SELECT coalesce(outbox.setting('outbox.report_key'), 'outbox_dispatch.reports'), oid "
                            "FROM pg_database WHERE datname = %s", (dbname,))[0]
        return f"{key}:{oid}"

    def log_text(self):
        return (super().log_text() + "\n-- sidecar --\n" + self.earlier_logs
                + (self.sidecar.log() if self.sidecar else ""))

    def close(self):
        self._stop_sidecar()
        super().close()


def new_cluster(redis_url, **settings):
    """A cluster of the suite's mode (HOST) with `settings` (outbox.*
    settings as Cluster takes them); `install()` puts the outbox in."""
    if HOST == "sidecar":
        return SidecarCluster(redis_url, **settings)
    return Cluster(redis_url, **settings)


@contextmanager
def installed_cluster(redis_url, **settings):
    """A cluster of the suite's mode with the outbox installed, closed
    after use."""
    pg = new_cluster(redis_url, **settings)
    try:
        pg.install()
        yield pg
    finally:
        pg.close()


def library_only(why):
    """Marks a test of what only the library does, skipped in the second mode."""
    return pytest.mark.skipif(HOST == "sidecar", reason=f"the library's alone: {why}")
