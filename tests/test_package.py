"""`make package`: a Debian package that apt installs into Debian's
PostgreSQL, where the core dispatch tests then run; an archive that
installs on a server without Rust; and the Python package's source
distribution and wheel, which carries the outbox-dispatch command."""

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from harness import PG_BIN, Cluster, queued_ids, wait_until
from standalone import dsn, fresh_database, plain_server

ROOT = Path(__file__).resolve().parent.parent
PG_CONFIG = str(PG_BIN / "pg_config")
MAJOR = subprocess.run([PG_CONFIG, "--version"], check=True, capture_output=True, text=True).stdout.split()[1].split(".")[0]
VERSION = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
# The maintainer of the packages the tests build, as the Makefile names it:
# make install-dev purges a package of theirs that an interrupted test left.
TEST_MAINTAINER = re.search(r"^TEST_MAINTAINER = (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
# What the extension directory holds: one install script, the update chain
# (tests/test_release.py checks that it leads to this version).
EXTENSION_FILES = {"outbox_dispatch.control", f"outbox_dispatch--{VERSION}.sql",
                   *(p.name for p in (ROOT / "sql" / "upgrade").glob("outbox_dispatch--*--*.sql"))}


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """`make package` (of the debug builds, into a directory of the
    tests', not dist/): the Debian package, the archive, the source
    distribution and the wheel."""
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(["./scripts/package.sh"], cwd=ROOT,
                           # Relative, as make package's dist/ is.
                           env=dict(os.environ, PACKAGE_PROFILE="dev", PG_CONFIG=PG_CONFIG,
                                    DIST_DIR=os.path.relpath(out, ROOT), DEB_MAINTAINER=TEST_MAINTAINER),
                           check=True, capture_output=True, text=True)
    files = [(ROOT / line).resolve() for line in built.stdout.split()]
    assert {f.parent for f in files} == {out.resolve()}, files
    kinds = {".deb": "deb", f"-pg{MAJOR}-{os.uname().machine}.tar.gz": "archive",
             f"-{VERSION}.tar.gz": "sdist", ".whl": "wheel"}
    found = {kind: [f for f in files if f.name.endswith(end)] for end, kind in kinds.items()}
    assert all(len(f) == 1 for f in found.values()), files
    return {kind: f[0] for kind, f in found.items()}


def pg_config(option):
    return Path(subprocess.run([PG_CONFIG, option], check=True, capture_output=True, text=True).stdout.strip())


@contextlib.contextmanager
def build_set_aside(tmp_path):
    """What `make install-dev` put into this server moves aside while a
    package installs its own, and comes back after, in place of the
    package's: only the package's files serve meanwhile, and the tests after
    this one find the build's (with the baseline install script the tests
    update from)."""
    libdir, extdir = pg_config("--pkglibdir"), pg_config("--sharedir") / "extension"

    def ours():
        return [*libdir.glob("outbox_dispatch.so"), *extdir.glob("outbox_dispatch*")]

    aside = tmp_path / "aside"
    aside.mkdir()
    moved = [(path, aside / path.name) for path in ours()]
    for path, to in moved:
        shutil.move(path, to)
    try:
        yield libdir, extdir
    finally:
        for path in ours():
            path.unlink()
        for path, to in moved:
            shutil.move(to, path)


def delivers(redis_server):
    """A fresh cluster of this server, with the extension created, delivers
    an event."""
    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        event_id = pg.value("SELECT outbox_enqueue('packaged', '{}', queue => 'q_package')")
        wait_until(lambda: queued_ids(redis_server.client(), "q_package") == [str(event_id)],
                   message="delivery from the packaged build")
        redis_server.client().delete("q_package")
    finally:
        pg.close()


def test_the_archive_installs_and_runs(redis_server, packages, tmp_path):
    archive = packages["archive"]
    assert archive.name == f"outbox_dispatch-{VERSION}-pg{MAJOR}-{os.uname().machine}.tar.gz"
    with tempfile.TemporaryDirectory() as unpacked, tarfile.open(archive) as tar:
        names = {Path(n).name for n in tar.getnames() if not tar.getmember(n).isdir()}
        assert names == EXTENSION_FILES | {"outbox_dispatch.so", "install.sh", "LICENSE", "CHANGELOG.md",
                                           "THIRD-PARTY"}, names
        tar.extractall(unpacked)
        [top] = Path(unpacked).iterdir()
        # A server of another major is refused, and nothing is copied.
        other = Path(unpacked) / "other_pg_config"
        other.write_text("#!/bin/sh\necho 'PostgreSQL 14.11'\n")
        other.chmod(0o755)
        refused = subprocess.run([str(top / "install.sh")], env=dict(os.environ, PG_CONFIG=str(other)),
                                 capture_output=True, text=True)
        assert refused.returncode != 0
        assert f"is for PostgreSQL {MAJOR}; {other} is PostgreSQL 14" in refused.stderr
        with build_set_aside(tmp_path) as (_, extdir):
            # A script an earlier install left is removed, not served.
            (extdir / "outbox_dispatch--0.7.0.sql").write_text("SELECT 1;\n")
            subprocess.run([str(top / "install.sh")], env=dict(os.environ, PG_CONFIG=PG_CONFIG),
                           check=True, capture_output=True)
            assert {p.name for p in extdir.glob("outbox_dispatch*")} == EXTENSION_FILES
            delivers(redis_server)


def debian_postgresql():
    """Whether this server is Debian's (or PGDG's) package of its major,
    which the Debian package depends on."""
    return (PG_CONFIG == f"/usr/lib/postgresql/{MAJOR}/bin/pg_config" and shutil.which("apt-get") is not None
            and subprocess.run(["dpkg", "-S", PG_CONFIG], capture_output=True).returncode == 0)


@pytest.mark.skipif(not debian_postgresql(), reason="the Debian package installs into Debian's or PGDG's "
                    "PostgreSQL, and this server is neither")
def test_the_debian_package_installs_with_apt_and_the_core_tests_pass_on_it(redis_server, packages, tmp_path):
    """`apt install ./postgresql-<major>-outbox-dispatch_<version>_<arch>.deb`
    into this machine's Debian PostgreSQL, the build's files set aside: the
    package's alone serve the dispatch tests; removing it leaves nothing."""
    deb = packages["deb"]
    name = f"postgresql-{MAJOR}-outbox-dispatch"
    arch = subprocess.run(["dpkg", "--print-architecture"], check=True, capture_output=True, text=True).stdout.strip()
    assert deb.name == f"{name}_{VERSION}_{arch}.deb"
    fields = subprocess.run(["dpkg-deb", "--field", deb, "Package", "Version", "Architecture", "Depends"],
                            check=True, capture_output=True, text=True).stdout
    assert f"Package: {name}\nVersion: {VERSION}\nArchitecture: {arch}\n" in fields
    assert f"Depends: postgresql-{MAJOR}," in fields
    # The C library it needs, no older than the newest symbol version the
    # library uses.
    with tempfile.TemporaryDirectory() as unpacked:
        subprocess.run(["dpkg-deb", "--extract", deb, unpacked], check=True)
        symbols = subprocess.run(["objdump", "-T", f"{unpacked}/usr/lib/postgresql/{MAJOR}/lib/outbox_dispatch.so"],
                                 check=True, capture_output=True, text=True).stdout
    needed = max((tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([\d.]+)", symbols)))
    bound = re.search(r"libc6 \(>= ([\d.]+)\)", fields).group(1)
    assert tuple(map(int, bound.split("."))) >= needed, (bound, needed)
    listed = subprocess.run(["dpkg-deb", "--contents", deb], check=True, capture_output=True, text=True).stdout
    files = {line.split()[-1] for line in listed.splitlines() if not line.startswith("d")}
    assert files == {f"./usr/lib/postgresql/{MAJOR}/lib/outbox_dispatch.so",
                     f"./usr/share/doc/{name}/copyright", f"./usr/share/doc/{name}/changelog.gz",
                     f"./usr/share/doc/{name}/THIRD-PARTY.gz",
                     *(f"./usr/share/postgresql/{MAJOR}/extension/{f}" for f in EXTENSION_FILES)}, files

    apt = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # An interrupted run's package is purged by make install-dev (Makefile).
    state = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Status}", name], capture_output=True, text=True)
    assert state.stdout != "installed", f"{name} is installed"
    with build_set_aside(tmp_path) as (libdir, extdir):
        try:
            subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", str(deb.resolve())],
                           env=apt, check=True, capture_output=True)
            status = subprocess.run(["dpkg-query", "-W", "-f", "${Status} ${Version}", name],
                                    check=True, capture_output=True, text=True).stdout
            assert status == f"install ok installed {VERSION}"
            assert subprocess.run(["dpkg", "--verify", name], capture_output=True, text=True).stdout == ""
            core = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   str(ROOT / "tests" / "test_dispatch.py")],
                                  cwd=ROOT, env=dict(os.environ, PG_BIN=str(PG_BIN)), capture_output=True, text=True)
            assert core.returncode == 0, core.stdout[-5000:]
        finally:
            subprocess.run(["apt-get", "purge", "-y", name], env=apt, check=True, capture_output=True)
        assert not (libdir / "outbox_dispatch.so").exists() and not list(extdir.glob("outbox_dispatch*"))


def installed(wheel, tmp_path):
    """`wheel` installed into a fresh venv, without the index: the venv,
    and its outbox-dispatch command, which says this version."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([venv / "bin" / "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True)
    command = venv / "bin" / "outbox-dispatch"
    assert subprocess.run([command, "--version"], check=True, capture_output=True,
                          text=True).stdout.strip() == f"outbox-dispatch {VERSION}"
    return venv, command


def assert_licences(read, metadata):
    """The project's licence and the notices of the crates the command
    links (not the extension's), each declared a License-File (PEP 639);
    `read(name)` reads a file the distribution carries."""
    assert read("LICENSE") == (ROOT / "LICENSE").read_text()
    notices = read("THIRD-PARTY")
    assert notices.startswith("Third-party software in outbox-dispatch: "), notices[:200]
    assert "\nrustls " in notices and "\npgrx " not in notices
    assert {"License-File: LICENSE", "License-File: THIRD-PARTY"} <= set(metadata.splitlines()), metadata


def assert_wheel_licences(wheel):
    info = f"outbox_dispatch-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as python_package:
        assert_licences(lambda name: python_package.read(f"{info}/licenses/{name}").decode(),
                        python_package.read(f"{info}/METADATA").decode())


def test_the_source_distribution_builds_the_package_and_the_command(packages, tmp_path):
    """Where no wheel fits, pip builds one from the source distribution: it
    holds the Python package, the command's Rust sources (the vendored,
    patched codec too) and the SQL they include, and nothing else of the
    repository."""
    sdist = packages["sdist"]
    assert sdist.name == f"outbox_dispatch-{VERSION}.tar.gz"
    with tarfile.open(sdist) as tar:
        tops = {Path(n).parts[1] for n in tar.getnames() if len(Path(n).parts) > 2}
        root = f"outbox_dispatch-{VERSION}"
        assert_licences(lambda name: tar.extractfile(f"{root}/{name}").read().decode(),
                        tar.extractfile(f"{root}/PKG-INFO").read().decode())
    assert tops == {"core", "sidecar", "sql", "src", "vendor"}, tops
    # The crates' dependencies as the build left them (of the same lock file):
    # only the crates of the distribution compile again.
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path, sdist],
                           env=dict(os.environ, MATURIN_PEP517_ARGS="--profile dev",
                                    CARGO_TARGET_DIR=str(ROOT / "target")),
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-5000:]
    [wheel] = tmp_path.glob("*.whl")
    assert_wheel_licences(wheel)
    _, command = installed(wheel, tmp_path)
    script = subprocess.run([command, "sql"], check=True, capture_output=True, text=True).stdout
    assert "CREATE TABLE outbox.log" in script and "CREATE TABLE outbox.installed" in script


def test_the_wheel_brings_the_package_and_the_command(redis_server, packages, tmp_path):
    """`pip install outbox-dispatch` on a machine without Rust: the Python
    package and the `outbox-dispatch` command, which installs the outbox
    into a server without the library and delivers from it."""
    wheel = packages["wheel"]
    with zipfile.ZipFile(wheel) as python_package:
        assert {"outbox_dispatch/__init__.py", "outbox_dispatch/celery.py", "outbox_dispatch/producer.py",
                "outbox_dispatch/report.py", "outbox_dispatch/py.typed",
                f"outbox_dispatch-{VERSION}.data/scripts/outbox-dispatch"} <= set(python_package.namelist())
    assert "-py3-none-" in wheel.name and not wheel.name.endswith("-any.whl"), wheel.name
    assert_wheel_licences(wheel)
    venv, command = installed(wheel, tmp_path)
    assert subprocess.run([venv / "bin" / "python", "-c", "import outbox_dispatch; print(outbox_dispatch.__version__)"],
                          check=True, capture_output=True, text=True, cwd=tmp_path).stdout.strip() == VERSION

    with plain_server() as pg:
        fresh_database(pg, "wheel")
        subprocess.run([command, "install", "--dsn", dsn(pg, "owner", "wheel")], check=True, capture_output=True)
        with pg.connect(dbname="wheel", user="owner") as conn:
            event_id = conn.execute("SELECT outbox_enqueue('wheel', '{}', queue => 'q_wheel')").fetchone()[0]
        sidecar = subprocess.Popen([command, "run", "--dsn", f"{dsn(pg, 'owner', 'wheel')} sslmode=disable",
                                    "--broker-url", redis_server.url], stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: queued_ids(redis_server.client(), "q_wheel") == [str(event_id)],
                       message="delivery by the wheel's command")
        finally:
            sidecar.terminate()
            assert sidecar.wait(timeout=30) == 0, sidecar.stderr.read()


def debian_mirror():
    """The Debian archive this machine's apt installs from."""
    for source in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        text = source.read_text() if source.is_file() else ""
        found = re.search(r"^URIs:\s*(\S+/debian)\s*$", text, re.M) \
            or re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)\s+bookworm\s", text, re.M)
        if found:
            return found.group(1)
    return None


@contextlib.contextmanager
def fresh_debian(root):
    """A Debian 12 of the minimal variant at `root` (no Rust, no
    PostgreSQL) that starts no service; a function that runs a command in
    it, with /proc and a /dev/shm of its own mounted in a mount namespace of
    the command's, gone when the last process in it is (whatever ends this
    test)."""
    subprocess.run(["debootstrap", "--variant=minbase", "bookworm", root, debian_mirror()],
                   check=True, capture_output=True)
    (root / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    (root / "usr/sbin/policy-rc.d").chmod(0o755)
    shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
    enter = 'mount -t proc proc "$0/proc" && mount -t tmpfs shm "$0/dev/shm" && exec chroot "$0" "$@"'

    def inside(*command, **kw):
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", enter, root,
                               *command], capture_output=True, text=True, **kw)

    try:
        yield inside
    finally:
        # Nothing is mounted in it; a server it ran was stopped (or died).
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(MAJOR != "15" or not debian_postgresql() or shutil.which("debootstrap") is None
                    or debian_mirror() is None,
                    reason="needs Debian 12's own PostgreSQL (15), debootstrap and a Debian archive")
def test_a_fresh_debian_installs_the_package_with_apt_and_runs_the_quick_start(redis_server, packages, tmp_path):
    """The quick start on a Debian 12 that has nothing but its base system:
    `apt install ./<package>.deb` brings PostgreSQL with it; no Rust; the
    server preloads the library, CREATE EXTENSION, and a committed event
    reaches this machine's Redis while a rolled-back one does not."""
    deb = packages["deb"]
    root = tmp_path / "debian"
    with fresh_debian(root) as inside:
        shutil.copy(deb, root / "tmp" / deb.name)
        assert inside("sh", "-c", "command -v cargo || command -v rustc").returncode != 0, "Rust in the base system"
        assert inside("apt-get", "update", "-q").returncode == 0
        installed = inside("apt-get", "install", "-y", "-q", "--no-install-recommends", f"/tmp/{deb.name}",
                           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
        assert inside("sh", "-c", "command -v cargo || command -v rustc").returncode != 0, "Rust came with it"

        bin_dir = f"/usr/lib/postgresql/{MAJOR}/bin"
        as_postgres = ("runuser", "-u", "postgres", "--")
        initdb = inside(*as_postgres, f"{bin_dir}/initdb", "-D", "/tmp/data", "-U", "postgres", "--auth=trust")
        assert initdb.returncode == 0, initdb.stderr
        with open(root / "tmp/data/postgresql.conf", "a") as conf:
            conf.write("listen_addresses = ''\nunix_socket_directories = '/tmp'\nport = 5433\n"
                       "shared_preload_libraries = 'outbox_dispatch'\n"
                       f"outbox.broker_url = '{redis_server.url}'\n")
        try:
            started = inside(*as_postgres, f"{bin_dir}/pg_ctl", "-D", "/tmp/data", "-l", "/tmp/data/log", "-w",
                             "start")
            assert started.returncode == 0, started.stderr + (root / "tmp/data/log").read_text()
            def psql(*statements):
                """Runs `statements` in one session; what they return."""
                ran = inside(f"{bin_dir}/psql", "-h", "/tmp", "-p", "5433", "-U", "postgres", "-X", "-q", "-A", "-t",
                             "-v", "ON_ERROR_STOP=1", *(arg for sql in statements for arg in ("-c", sql)))
                assert ran.returncode == 0, ran.stderr
                return ran.stdout.strip()

            psql("CREATE EXTENSION outbox_dispatch", "CREATE TABLE accounts (id int PRIMARY KEY, email text)")
            enqueue = ("SELECT outbox_enqueue('accounts.send_welcome_email', "
                       "'{\"user_id\": 42, \"email\": \"ada@example.com\"}', queue => 'q_fresh')")
            psql("BEGIN", "INSERT INTO accounts VALUES (7, 'gone@example.com')", enqueue, "ROLLBACK")
            committed = psql("BEGIN", "INSERT INTO accounts VALUES (42, 'ada@example.com')", enqueue, "COMMIT")
            wait_until(lambda: queued_ids(redis_server.client(), "q_fresh") == [committed], timeout=60,
                       message="the committed event in Redis, alone")
            assert psql("SELECT count(*) FROM outbox.workers WHERE last_error IS NULL") == "1"
        finally:
            inside(*as_postgres, f"{bin_dir}/pg_ctl", "-D", "/tmp/data", "-m", "fast", "stop")
            redis_server.client().delete("q_fresh")
