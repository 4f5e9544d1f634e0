"""How `outbox-dispatch` connects to PostgreSQL (docs/guides/managed.md,
"Connecting"): libpq's DSNs, sslmode from disable to verify-full,
sslrootcert, client certificates, the password file, the PG* variables, a
service, target_session_attrs; and never a password in clear to a server
that refused TLS. The hostile peers first: a scripted server that refuses
TLS and asks for a cleartext password, one that answers garbage, a forged
certificate, a certificate for another host, key and password files others
can read; then each option against a real PostgreSQL 15 with ssl on,
connecting as the outbox's owner (no superuser), and a client certificate
as the role a `cert` line names."""

import re
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from harness import make_tls_files, queued_ids, wait_until
from standalone import Sidecar, Standby, fresh_database, install, plain_server, run

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
PROTOCOL_3 = 196608


class RefusingPeer:
    """A scripted PostgreSQL-protocol peer on 127.0.0.1: it answers `answer`
    to an SSLRequest ('N' refuses TLS, as a server without ssl does), then
    asks for a cleartext password (AuthenticationCleartextPassword) and
    records every PasswordMessage it gets, and every startup packet that
    came in clear."""

    def __init__(self, answer=b"N"):
        self.answer = answer
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.startups = 0
        self.passwords = []
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    @staticmethod
    def read(conn, n):
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def serve(self, conn):
        conn.settimeout(20)
        try:
            with conn:
                while True:
                    length, code = struct.unpack("!ii", self.read(conn, 8))
                    if code == SSL_REQUEST:
                        conn.sendall(self.answer)
                        if self.answer.startswith(b"S"):
                            # Whatever comes is a TLS handshake this peer cannot do.
                            self.read(conn, 1)
                            return
                        continue
                    if code == GSSENC_REQUEST:
                        conn.sendall(b"N")
                        continue
                    assert code == PROTOCOL_3, code
                    self.read(conn, length - 8)
                    with self.lock:
                        self.startups += 1
                    conn.sendall(b"R" + struct.pack("!ii", 8, 3))
                    kind = self.read(conn, 1)
                    (length,) = struct.unpack("!i", self.read(conn, 4))
                    body = self.read(conn, length - 4)
                    if kind == b"p":
                        with self.lock:
                            self.passwords.append(body.rstrip(b"\0").decode())
                    error = b"SFATAL\0C28P01\0Mpassword authentication failed\0\0"
                    conn.sendall(b"E" + struct.pack("!i", len(error) + 4) + error)
                    return
        except (EOFError, OSError):
            return

    def close(self):
        self.listener.close()


@pytest.fixture
def peer():
    started = []

    def start(answer=b"N"):
        p = RefusingPeer(answer)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


def secret():
    return "S3CRET-" + uuid.uuid4().hex


# -- a server that refuses TLS ------------------------------------------------------------------

def test_a_server_refusing_tls_never_gets_the_password_unless_the_dsn_says_disable_or_allow(peer, tmp_path):
    password = secret()
    home = tmp_path / "home"
    home.mkdir()
    for sslmode, how, sent in [
        ("", "dsn", 0),  # libpq's default, prefer
        ("prefer", "dsn", 0),
        ("prefer", "PGPASSWORD", 0),
        ("prefer", ".pgpass", 0),
        ("require", "dsn", 0),
        ("verify-ca", "dsn", 0),
        ("verify-full", "dsn", 0),
        ("disable", "dsn", 1),
        ("allow", "dsn", 1),
    ]:
        p = peer()
        dsn = f"host=127.0.0.1 port={p.port} user=owner dbname=app connect_timeout=10"
        dsn += f" sslmode={sslmode}" if sslmode else ""
        env = {"HOME": str(home)}
        if how == "dsn":
            dsn += f" password={password}"
        elif how == "PGPASSWORD":
            env["PGPASSWORD"] = password
        else:
            pgpass = home / ".pgpass"
            pgpass.write_text(f"127.0.0.1:{p.port}:app:owner:{password}\n")
            pgpass.chmod(0o600)
        result = run("install", "--dsn", dsn, env=env)
        assert result.returncode == 1, (sslmode, how)
        assert password not in result.stderr + result.stdout
        assert len(p.passwords) == sent, (sslmode, how, p.passwords)
        if sent:
            assert p.passwords == [password]
        elif sslmode in ("", "prefer"):
            # It went again without TLS and without the password, and says why.
            assert p.startups == 1, (how, p.startups)
            assert "refused TLS" in result.stderr and "sslmode=disable" in result.stderr, result.stderr
        else:
            assert p.startups == 0, (sslmode, p.startups)
            assert f"sslmode={sslmode} asks for TLS" in result.stderr, result.stderr
        (home / ".pgpass").unlink(missing_ok=True)


def test_a_running_sidecar_never_sends_it_either(peer):
    password = secret()
    p = peer()
    sidecar = Sidecar(None, None, to=f"host=127.0.0.1 port={p.port} user=owner dbname=app password={password}")
    try:
        # The first check, the dispatcher, the control connection and the
        # listener, each connecting again and again.
        wait_until(lambda: p.connections >= 6, timeout=60, message="connections again and again",
                   seen=lambda: p.connections)
        assert p.passwords == []
        assert sidecar.proc.poll() is None
        assert password not in sidecar.log()
        assert "refused TLS" in sidecar.log()
    finally:
        sidecar.stop()
        sidecar.close()
    assert p.passwords == []


@pytest.mark.parametrize("answer", [b"E", b"\x00garbage", b"S\x16\x03\x01garbage"])
def test_garbage_for_an_answer_gets_nothing_in_clear(peer, answer):
    """Any answer but S is a refusal; an S whose handshake fails is never a
    reason to go on in clear."""
    password = secret()
    p = peer(answer)
    result = run("install", "--dsn", f"host=127.0.0.1 port={p.port} user=owner dbname=app "
                 f"password={password} connect_timeout=10")
    assert result.returncode == 1
    assert password not in result.stderr + result.stdout
    assert p.passwords == []
    assert p.startups == (0 if answer.startswith(b"S") else 1), result.stderr


def test_a_server_that_accepts_and_never_answers_is_given_up_within_the_deadline():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    try:
        started = time.monotonic()
        result = run("install", "--dsn", f"host=127.0.0.1 port={listener.getsockname()[1]} user=owner "
                     "dbname=app connect_timeout=3")
        took = time.monotonic() - started
        assert result.returncode == 1
        assert took < 20, took
        assert "no session within" in result.stderr or "timed out" in result.stderr, result.stderr
    finally:
        listener.close()


# -- a real server with TLS ---------------------------------------------------------------------

def openssl(directory, *args):
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def sign(directory, name, subject):
    """`name`.pem and `name`.key (0600), signed by directory's ca.pem, as
    PostgreSQL's documentation makes a client's: `openssl x509 -req` with
    no extensions (an X.509 v1 certificate)."""
    openssl(directory, "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={subject}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
    openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.pem")
    (directory / f"{name}.key").chmod(0o600)


@pytest.fixture(scope="module")
def tls():
    directory = make_tls_files()
    sign(directory, "certuser", "certuser")
    yield directory
    shutil.rmtree(directory)


@pytest.fixture(scope="module")
def server(tls):
    """PostgreSQL 15 with ssl on, on 127.0.0.1: owner and sslonly log in
    with a password (SCRAM), sslonly over TLS alone; certuser with a client
    certificate (a `cert` line)."""
    key = tls / "pg.key"
    shutil.copy(tls / "server.key", key)
    shutil.chown(key, "postgres", "postgres")
    key.chmod(0o600)
    with plain_server(server_conf={"listen_addresses": "'127.0.0.1'", "log_connections": "on",
                                   "password_encryption": "'scram-sha-256'"}) as pg:
        # A server built without TLS refuses to start with ssl on: asked
        # first, with it off.
        if not pg.value("SHOW ssl_library"):
            pytest.skip("this PostgreSQL is built without TLS (the relocatable builds are): "
                        "these run under Debian's")
        with open(pg.data / "postgresql.conf", "a") as conf:
            conf.write(f"ssl = on\nssl_cert_file = '{tls / 'server.pem'}'\nssl_key_file = '{key}'\n"
                       f"ssl_ca_file = '{tls / 'ca.pem'}'\n")
        pg.restart()
        pg.sql("ALTER ROLE owner PASSWORD 'owner-pw'")
        pg.sql("CREATE ROLE sslonly LOGIN PASSWORD 'sslonly-pw'")
        pg.sql("CREATE ROLE certuser LOGIN")
        (pg.data / "pg_hba.conf").write_text(
            "local all all trust\n"
            "hostssl all certuser 127.0.0.1/32 cert\n"
            "hostnossl all sslonly 127.0.0.1/32 reject\n"
            "host all all 127.0.0.1/32 scram-sha-256\n")
        pg.pg_ctl("reload")
        for db, owner in (("app", "owner"), ("tlsonly", "sslonly"), ("certdb", "certuser")):
            fresh_database(pg, db, owner=owner)
        yield pg


def probe(pg, dsn, env=None, *args):
    """`outbox-dispatch install` as the connection's test: (the result, and
    for each session it opened, whether it used TLS), from the server's
    log_connections lines."""
    before = pg.log.read_text()
    result = run("install", "--dsn", dsn, *args, env=env)
    lines = pg.log.read_text()[len(before):]
    sessions = ["SSL enabled" in line for line in lines.splitlines() if "connection authorized" in line]
    return result, sessions


def tcp(pg, user="owner", dbname="app", **params):
    words = [f"host=127.0.0.1 port={pg.port} user={user} dbname={dbname}"]
    words += [f"{k}={v}" for k, v in params.items()]
    return " ".join(words)


def test_a_forged_certificate_is_refused_in_every_mode_that_uses_tls(server, tls):
    for sslmode in ("prefer", "require", "verify-ca", "verify-full"):
        result, sessions = probe(server, tcp(server, password="owner-pw", sslmode=sslmode,
                                             sslrootcert=tls / "other-ca.pem"))
        assert result.returncode == 1, sslmode
        assert "certificate" in result.stderr.lower(), result.stderr
        # Never in clear after it.
        assert sessions == [], (sslmode, sessions)


def test_a_certificate_for_another_host_is_refused_under_verify_full_and_taken_under_verify_ca(server, tls):
    # host names the server for TLS; hostaddr is where it is.
    wrong = f"host=db.wrong.example hostaddr=127.0.0.1 port={server.port} user=owner dbname=app password=owner-pw"
    result, sessions = probe(server, f"{wrong} sslmode=verify-full sslrootcert={tls / 'ca.pem'}")
    assert result.returncode == 1 and sessions == []
    assert "not valid for name" in result.stderr.lower() or "certificate" in result.stderr.lower(), result.stderr
    result, sessions = probe(server, f"{wrong} sslmode=verify-ca sslrootcert={tls / 'ca.pem'}")
    assert result.returncode == 0, result.stderr
    assert sessions and all(sessions)
    # And its own name, under verify-full.
    result, sessions = probe(server, tcp(server, password="owner-pw", sslmode="verify-full",
                                         sslrootcert=tls / "ca.pem"))
    assert result.returncode == 0, result.stderr
    assert sessions and all(sessions)


def test_each_sslmode_uses_tls_as_libpq_does(server, tls):
    root = tls / "ca.pem"
    for sslmode, with_tls in [("disable", False), ("allow", False), ("prefer", True), ("require", True),
                              ("verify-ca", True), ("verify-full", True)]:
        result, sessions = probe(server, tcp(server, password="owner-pw", sslmode=sslmode, sslrootcert=root))
        assert result.returncode == 0, (sslmode, result.stderr)
        assert sessions == [with_tls], (sslmode, sessions)
    # allow goes again with TLS when the server refuses the session without it.
    result, sessions = probe(server, tcp(server, user="sslonly", dbname="tlsonly", password="sslonly-pw",
                                         sslmode="allow", sslrootcert=root))
    assert result.returncode == 0, result.stderr
    assert sessions == [True]
    result, _ = probe(server, tcp(server, user="sslonly", dbname="tlsonly", password="sslonly-pw",
                                  sslmode="disable"))
    assert result.returncode == 1 and "sslonly" in result.stderr


def test_sslrootcert_system_trusts_the_systems_authorities_and_means_verify_full(server, tls):
    # The test's authority is not the system's.
    result, sessions = probe(server, tcp(server, password="owner-pw", sslrootcert="system"))
    assert result.returncode == 1 and sessions == []
    assert "certificate" in result.stderr.lower(), result.stderr
    result, _ = probe(server, tcp(server, password="owner-pw", sslrootcert="system", sslmode="require"))
    assert result.returncode == 1
    assert "verify-full with sslrootcert=system" in result.stderr, result.stderr


def test_the_tls_ca_file_option_stands_for_sslrootcert_and_the_dsn_s_own_wins(server, tls):
    plain = tcp(server, password="owner-pw", sslmode="verify-full")
    result, sessions = probe(server, plain, None, "--tls-ca-file", str(tls / "ca.pem"))
    assert result.returncode == 0, result.stderr
    assert sessions == [True]
    result, sessions = probe(server, plain, {"OUTBOX_TLS_CA_FILE": str(tls / "ca.pem")})
    assert result.returncode == 0, result.stderr
    # Over PGSSLROOTCERT, under the DSN's.
    result, _ = probe(server, plain, {"PGSSLROOTCERT": str(tls / "other-ca.pem")},
                      "--tls-ca-file", str(tls / "ca.pem"))
    assert result.returncode == 0, result.stderr
    result, sessions = probe(server, f"{plain} sslrootcert={tls / 'other-ca.pem'}", None,
                             "--tls-ca-file", str(tls / "ca.pem"))
    assert result.returncode == 1 and sessions == []
    assert "the DSN's are used" in result.stderr, result.stderr


def test_a_client_certificate_is_accepted_by_a_cert_line_and_a_key_others_can_read_is_refused(server, tls, tmp_path):
    cert, key = tls / "certuser.pem", tmp_path / "certuser.key"
    shutil.copy(tls / "certuser.key", key)
    key.chmod(0o600)
    dsn = tcp(server, user="certuser", dbname="certdb", sslmode="verify-full", sslrootcert=tls / "ca.pem")
    result, sessions = probe(server, f"{dsn} sslcert={cert} sslkey={key}")
    assert result.returncode == 0, result.stderr
    assert sessions == [True]
    # Through PGSSLCERT and PGSSLKEY too.
    result, _ = probe(server, dsn, {"PGSSLCERT": str(cert), "PGSSLKEY": str(key)})
    assert result.returncode == 0, result.stderr
    # Without one, the cert line refuses the role.
    result, _ = probe(server, dsn)
    assert result.returncode == 1
    for mode in (0o640, 0o644, 0o604):
        key.chmod(mode)
        result, sessions = probe(server, f"{dsn} sslcert={cert} sslkey={key}")
        assert result.returncode == 1 and sessions == [], oct(mode)
        assert f"sslkey {key}" in result.stderr and "0600" in result.stderr, result.stderr


def test_the_password_file_is_read_as_libpq_reads_it(server, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    pgpass = home / ".pgpass"
    pgpass.write_text("# the owner's\n"
                      f"127.0.0.1:{server.port}:other:owner:wrong\n"
                      f"127.0.0.1:{server.port}:app:owner:owner-pw\n")
    pgpass.chmod(0o600)
    dsn = tcp(server, sslmode="disable")
    assert probe(server, dsn, {"HOME": str(home)})[0].returncode == 0
    elsewhere = tmp_path / "elsewhere.pgpass"
    elsewhere.write_text("*:*:*:owner:owner-pw\n")
    elsewhere.chmod(0o600)
    assert probe(server, dsn, {"HOME": "/nonexistent", "PGPASSFILE": str(elsewhere)})[0].returncode == 0
    assert probe(server, f"{dsn} passfile={elsewhere}", {"HOME": "/nonexistent"})[0].returncode == 0
    # Escapes: a password holding : and \.
    server.sql("ALTER ROLE owner PASSWORD 'a:b\\c'")
    try:
        pgpass.write_text(f"127.0.0.1:{server.port}:app:owner:a\\:b\\\\c\n")
        assert probe(server, dsn, {"HOME": str(home)})[0].returncode == 0
    finally:
        server.sql("ALTER ROLE owner PASSWORD 'owner-pw'")
    # Others may read it: ignored, as libpq ignores it, with a warning.
    pgpass.write_text(f"127.0.0.1:{server.port}:app:owner:owner-pw\n")
    for mode in (0o640, 0o644, 0o604):
        pgpass.chmod(mode)
        result, sessions = probe(server, dsn, {"HOME": str(home)})
        assert result.returncode == 1 and sessions == [], oct(mode)
        assert re.search(r"password file .*\.pgpass is ignored: .*0600", result.stderr), result.stderr
        assert "owner-pw" not in result.stderr


def test_the_pg_variables_and_a_service_stand_for_what_the_dsn_leaves_out(server, tls, tmp_path):
    env = {"PGHOST": "127.0.0.1", "PGPORT": str(server.port), "PGUSER": "owner", "PGDATABASE": "app",
           "PGPASSWORD": "owner-pw", "PGSSLMODE": "verify-full", "PGSSLROOTCERT": str(tls / "ca.pem"),
           "PGCONNECT_TIMEOUT": "10", "PGAPPNAME": "from-env", "PGTARGETSESSIONATTRS": "read-write"}
    result, sessions = probe(server, "", env)
    assert result.returncode == 0, result.stderr
    assert sessions == [True]
    # The DSN wins over a variable.
    result, _ = probe(server, "dbname=nonexistent", env)
    assert result.returncode == 1 and 'database "nonexistent" does not exist' in result.stderr
    # A service: PGSERVICEFILE, else PGSYSCONFDIR/pg_service.conf; the DSN over it, it over the variables.
    services = tmp_path / "pg_service.conf"
    services.write_text(f"[outbox]\nhost=127.0.0.1\nport={server.port}\nuser=owner\ndbname=app\n"
                        f"sslmode=verify-full\nsslrootcert={tls / 'ca.pem'}\n")
    base = {"PGPASSWORD": "owner-pw", "PGUSER": "nobody", "HOME": str(tmp_path / "none")}
    for extra in ({"PGSERVICEFILE": str(services)}, {"PGSYSCONFDIR": str(tmp_path)}):
        result, sessions = probe(server, "service=outbox", {**base, **extra})
        assert result.returncode == 0, result.stderr
        assert sessions == [True]
    result, _ = probe(server, "", {**base, "PGSERVICE": "outbox", "PGSYSCONFDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    result, _ = probe(server, "service=missing", {**base, "PGSYSCONFDIR": str(tmp_path)})
    assert result.returncode == 1 and 'definition of service "missing" not found' in result.stderr


def test_a_dsn_libpq_refuses_or_the_sidecar_cannot_honour_is_refused_naming_the_keyword():
    password = secret()
    for dsn, said in [
        (f"host=127.0.0.1 password={password} sslcrl=/crl.pem", "sslcrl"),
        (f"host=127.0.0.1 password={password} sslmode=verify_full", "sslmode"),
        (f"host=127.0.0.1 pasword={password}", 'invalid connection option "pasword"'),
        (f"host=127.0.0.1 {password}", "word 2"),
        (f"postgresql://owner:{password}@127.0.0.1/app?sslmode=bogus", "sslmode"),
    ]:
        result = run("install", "--dsn", dsn)
        assert result.returncode == 1, dsn
        assert said in result.stderr, result.stderr
        assert password not in result.stderr + result.stdout


def test_a_standby_is_passed_over_for_the_primary(redis_server):
    """A multi-host DSN with the standby first: the sidecar writes, so it
    asks for a primary unless target_session_attrs says otherwise; each
    value of it picks as libpq's does."""
    with plain_server(server_conf={"log_connections": "on"}) as primary:
        install(primary, "app_attrs")
        standby = Standby(primary)

        def sessions(pg):
            return pg.log.read_text().count("connection authorized: user=owner")

        try:
            both = (f"host={standby.dir},{primary.dir} port={standby.port},{primary.port} user=owner "
                    "dbname=app_attrs")
            for attrs, picked in [("", primary), ("read-write", primary), ("primary", primary),
                                  ("any", standby), ("standby", standby), ("read-only", standby),
                                  ("prefer-standby", standby)]:
                before = (sessions(primary), sessions(standby))
                result = run("install", "--dsn", f"{both} target_session_attrs={attrs}" if attrs else both)
                # An install finds this release there and writes nothing: a standby serves it too.
                assert result.returncode == 0, (attrs, result.stderr)
                assert "installed already" in result.stdout
                grew = [sessions(pg) > b for pg, b in zip((primary, standby), before)]
                if picked is primary:
                    assert grew[0], attrs  # the standby asked first, and passed over
                else:
                    assert grew == [False, True], attrs
            result = run("install", "--dsn", f"host={standby.dir} port={standby.port} user=owner dbname=app_attrs")
            assert result.returncode == 1
            assert "not a primary" in result.stderr, result.stderr
            # run: the standby passed over at each connect, events flow.
            sidecar = Sidecar(primary, "app_attrs", broker=redis_server.url, to=both)
            try:
                with primary.connect(dbname="app_attrs", user="writer") as conn:
                    ids = [str(r[0]) for r in conn.execute(
                        "SELECT outbox_enqueue('t.attrs', '{}', queue => 'q_attrs') FROM generate_series(1, 5)")]
                wait_until(lambda: sorted(queued_ids(redis_server.client(), "q_attrs")) == sorted(ids),
                           timeout=60, message="sent through the primary", seen=sidecar.log)
            finally:
                sidecar.stop()
                sidecar.close()
        finally:
            standby.close()
