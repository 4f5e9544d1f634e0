"""`make package`: a Debian package that apt installs into Debian's
PostgreSQL, where the core dispatch tests then run; an archive that
installs on a server without Rust; the Python package, pure Python (its
source distribution and its wheel for any platform), which a fresh venv
without Rust installs and enqueues with; and the outbox-dispatch command's
distribution (outbox-dispatch-cli: manylinux wheels and the source
distribution they build from)."""

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
    tests', not dist/): the Debian package, the archive, the Python
    package's source distribution and wheel, the command's source
    distribution and its wheel for this machine (and the aarch64 one, when
    built: "cli-aarch64")."""
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(["./scripts/package.sh"], cwd=ROOT,
                           # Relative, as make package's dist/ is.
                           env=dict(os.environ, PACKAGE_PROFILE="dev", PG_CONFIG=PG_CONFIG,
                                    DIST_DIR=os.path.relpath(out, ROOT), DEB_MAINTAINER=TEST_MAINTAINER),
                           check=True, capture_output=True, text=True)
    files = [(ROOT / line).resolve() for line in built.stdout.split()]
    assert {f.parent for f in files} == {out.resolve()}, files
    kinds = {"deb": r".*\.deb", "archive": rf".*-pg{MAJOR}-{os.uname().machine}\.tar\.gz",
             "sdist": rf"outbox_dispatch-{VERSION}\.tar\.gz", "wheel": rf"outbox_dispatch-{VERSION}-py3-none-any\.whl",
             "cli-sdist": rf"outbox_dispatch_cli-{VERSION}\.tar\.gz",
             "cli": rf"outbox_dispatch_cli-{VERSION}-py3-none-manylinux.*_{os.uname().machine}\.whl",
             "cli-aarch64": rf"outbox_dispatch_cli-{VERSION}-py3-none-manylinux.*_aarch64\.whl"}
    found = {kind: [f for f in files if re.fullmatch(pattern, f.name)] for kind, pattern in kinds.items()}
    assert all(len(f) == 1 for k, f in found.items() if k != "cli-aarch64"), files
    assert len(files) == sum(len(f) for f in found.values()), files
    return {kind: f[0] for kind, f in found.items() if f}


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


def fresh_venv(tmp_path, name="venv"):
    """A fresh venv, and an environment whose PATH has its bin and the
    system's alone: no Rust (cargo and rustc are in ~/.cargo/bin)."""
    venv = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    env = dict(os.environ, PATH=f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin")
    assert shutil.which("cargo", path=env["PATH"]) is None and shutil.which("rustc", path=env["PATH"]) is None
    return venv, env


def installed(wheel, tmp_path):
    """The command's `wheel` installed into a fresh venv, without the index:
    the venv, and its outbox-dispatch command, which says this version."""
    venv, _ = fresh_venv(tmp_path)
    subprocess.run([venv / "bin" / "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True)
    command = venv / "bin" / "outbox-dispatch"
    assert subprocess.run([command, "--version"], check=True, capture_output=True,
                          text=True).stdout.strip() == f"outbox-dispatch {VERSION}"
    return venv, command


def assert_licences(read, metadata, notices=True):
    """The project's licence and (`notices`) the notices of the crates the
    command links (not the extension's), each declared a License-File (PEP
    639); `read(name)` reads a file the distribution carries."""
    assert read("LICENSE") == (ROOT / "LICENSE").read_text()
    assert "License-File: LICENSE" in metadata.splitlines(), metadata
    if notices:
        text = read("THIRD-PARTY")
        assert text.startswith("Third-party software in outbox-dispatch: "), text[:200]
        assert "\nrustls " in text and "\npgrx " not in text
        assert "License-File: THIRD-PARTY" in metadata.splitlines(), metadata


def wheel_metadata(wheel):
    dist = wheel.name.split("-")[0]
    with zipfile.ZipFile(wheel) as package:
        return package.read(f"{dist}-{VERSION}.dist-info/METADATA").decode()


def assert_wheel_licences(wheel, notices=True):
    info = f"{wheel.name.split('-')[0]}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as package:
        assert_licences(lambda name: package.read(f"{info}/licenses/{name}").decode(),
                        package.read(f"{info}/METADATA").decode(), notices)


def test_the_python_package_is_pure_python_and_says_what_it_needs(packages):
    """One wheel for every platform: the package's modules, the outbox's
    scripts (for the Django app) and no command; its metadata as an index
    shows it, the Python it needs and each extra's."""
    wheel = packages["wheel"]
    with zipfile.ZipFile(wheel) as package:
        names = set(package.namelist())
        tag = package.read(f"outbox_dispatch-{VERSION}.dist-info/WHEEL").decode()
    assert {"outbox_dispatch/__init__.py", "outbox_dispatch/aio.py", "outbox_dispatch/celery.py",
            "outbox_dispatch/exporter.py", "outbox_dispatch/inbox.py", "outbox_dispatch/py.typed",
            "outbox_dispatch/django/admin.py", "outbox_dispatch/django/migrations/0001_initial.py",
            "outbox_dispatch/standalone/install.sql", "outbox_dispatch/standalone/others.sql",
            "outbox_dispatch/standalone/update-from-1.0.0.sql"} <= names, sorted(names)
    assert not [n for n in names if ".data/" in n or n.endswith((".so", ".pyd"))], sorted(names)
    assert "Root-Is-Purelib: true" in tag and "Tag: py3-none-any" in tag, tag
    assert_wheel_licences(wheel, notices=False)
    metadata = wheel_metadata(wheel).splitlines()
    for line in ("Requires-Python: >=3.9", "Classifier: Operating System :: OS Independent",
                 "Classifier: Framework :: Django", "Classifier: Typing :: Typed",
                 f"Requires-Dist: outbox-dispatch-cli=={VERSION}; extra == 'cli'",
                 "Requires-Dist: psycopg<4,>=3.3.9; extra == 'exporter'",
                 "Requires-Dist: django>=4.2; extra == 'django'"):
        assert line in metadata or line.replace("'", '"') in metadata, (line, metadata)
    with tarfile.open(packages["sdist"]) as tar:
        root = f"outbox_dispatch-{VERSION}"
        tops = {Path(n).parts[1] for n in tar.getnames() if len(Path(n).parts) > 1}
        assert_licences(lambda name: tar.extractfile(f"{root}/{name}").read().decode(),
                        tar.extractfile(f"{root}/PKG-INFO").read().decode(), notices=False)
    assert tops == {"src", "README.md", "LICENSE", "PKG-INFO", "pyproject.toml", ".gitignore"}, tops


def test_a_fresh_venv_without_rust_installs_the_package_and_enqueues(packages, tmp_path):
    """pip install of the wheel (psycopg from the index) where no Rust is:
    the outbox installed into a server without the library by the
    package's own scripts, and an event enqueued in a transaction, the one
    rolled back gone. The source distribution builds the same wheel there."""
    venv, env = fresh_venv(tmp_path)
    subprocess.run([venv / "bin" / "pip", "install", "-q", packages["wheel"], "psycopg[binary]>=3.1"], env=env,
                   check=True)
    with plain_server() as pg:
        fresh_database(pg, "pure")
        program = f"""
import psycopg, outbox_dispatch
from outbox_dispatch.install import install
assert outbox_dispatch.__version__ == {VERSION!r}
with psycopg.connect({dsn(pg, "owner", "pure")!r}) as conn:
    print(install(conn.cursor()))
    conn.commit()
    outbox_dispatch.enqueue(conn, "tests.dropped")
    conn.rollback()
    print(outbox_dispatch.enqueue(conn, "tests.kept", args=(1,), queue="q_pure"))
"""
        ran = subprocess.run([venv / "bin" / "python", "-c", program], env=env, cwd=tmp_path, capture_output=True,
                             text=True)
        assert ran.returncode == 0, ran.stderr
        said, event_id = ran.stdout.split("\n")[:2]
        assert said == f"installed outbox_dispatch {VERSION}"
        assert pg.sql("SELECT id::text, task, queue FROM outbox.events", dbname="pure") == [
            (event_id, "tests.kept", "q_pure")]
    built = subprocess.run([venv / "bin" / "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "built",
                            packages["sdist"]], env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    [rebuilt] = (tmp_path / "built").glob("*.whl")
    with zipfile.ZipFile(rebuilt) as again, zipfile.ZipFile(packages["wheel"]) as first:
        assert rebuilt.name == packages["wheel"].name and set(again.namelist()) == set(first.namelist())


def test_the_cli_extra_brings_the_command(packages, tmp_path):
    """`pip install 'outbox-dispatch[cli]'` (here from the built files):
    the command's wheel comes with it; find_bin() and `python -m
    outbox_dispatch_cli` find the command."""
    venv, env = fresh_venv(tmp_path)
    subprocess.run([venv / "bin" / "pip", "install", "-q", "--no-index", "--find-links", packages["cli"].parent,
                    f"{packages['wheel']}[cli]"], env=env, check=True)
    found = subprocess.run([venv / "bin" / "python", "-c", "import outbox_dispatch_cli; print(outbox_dispatch_cli.find_bin())"],
                           env=env, cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()
    assert found == str(venv / "bin" / "outbox-dispatch")
    assert subprocess.run([venv / "bin" / "python", "-m", "outbox_dispatch_cli", "--version"], env=env,
                          cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip() == (
        f"outbox-dispatch {VERSION}")


def test_the_command_source_distribution_builds_the_command(packages, tmp_path):
    """Where no wheel fits, pip builds one from the command's source
    distribution: it holds the finder, the command's Rust sources (the
    vendored, patched codec too) and the SQL they include, and nothing else
    of the repository."""
    sdist = packages["cli-sdist"]
    with tarfile.open(sdist) as tar:
        tops = {Path(n).parts[1] for n in tar.getnames() if len(Path(n).parts) > 2}
        root = f"outbox_dispatch_cli-{VERSION}"
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


def glibc_needed(command):
    """The newest glibc symbol version `command` uses."""
    symbols = subprocess.run(["objdump", "-T", command], check=True, capture_output=True, text=True).stdout
    return max(tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([\d.]+)", symbols))


def test_the_command_wheel_is_manylinux_and_delivers(redis_server, packages, tmp_path):
    """`pip install outbox-dispatch-cli` on a machine without Rust: the
    command alone (and its finder), for glibc 2.17 and later, which
    installs the outbox into a server without the library and delivers
    from it."""
    wheel = packages["cli"]
    with zipfile.ZipFile(wheel) as package:
        names = {n for n in package.namelist() if ".dist-info/" not in n}
    assert names == {"outbox_dispatch_cli/__init__.py", "outbox_dispatch_cli/__main__.py",
                     "outbox_dispatch_cli/py.typed", f"outbox_dispatch_cli-{VERSION}.data/scripts/outbox-dispatch"}, names
    assert re.search(r"-py3-none-(manylinux2014_\w+\.)?manylinux_2_17_\w+\.whl$", wheel.name), wheel.name
    assert "Classifier: Operating System :: POSIX :: Linux" in wheel_metadata(wheel).splitlines()
    assert_wheel_licences(wheel)
    venv, command = installed(wheel, tmp_path)
    assert glibc_needed(command) <= (2, 17)

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


QEMU = "/usr/bin/qemu-aarch64-static"
ARM64_LIBC = "/usr/aarch64-linux-gnu"


@pytest.mark.skipif(not Path(QEMU).exists() or not Path(ARM64_LIBC).is_dir(),
                    reason="needs Debian's qemu-user-static and libc6-arm64-cross (scripts/deps.sh)")
def test_the_aarch64_wheel_carries_a_command_for_aarch64(packages, tmp_path):
    """Built where Rust's library for aarch64 is installed (make package
    says when it is not): an aarch64 command for glibc 2.17, which answers
    under emulation."""
    if "cli-aarch64" not in packages:
        pytest.skip("make package built no aarch64 wheel: Rust's library for aarch64-unknown-linux-gnu is missing")
    wheel = packages["cli-aarch64"]
    command = tmp_path / "outbox-dispatch"
    with zipfile.ZipFile(wheel) as package:
        command.write_bytes(package.read(f"outbox_dispatch_cli-{VERSION}.data/scripts/outbox-dispatch"))
    command.chmod(0o755)
    header = subprocess.run(["readelf", "-h", command], check=True, capture_output=True, text=True).stdout
    assert re.search(r"Machine:\s+AArch64", header), header
    assert glibc_needed(command) <= (2, 17)
    assert_wheel_licences(wheel)
    answered = subprocess.run([QEMU, "-L", ARM64_LIBC, command, "--version"], capture_output=True, text=True,
                              timeout=60)
    assert answered.stdout.strip() == f"outbox-dispatch {VERSION}", answered.stderr


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
    test), and `binds` (this machine's path, the path in it) mounted there
    read-only."""
    subprocess.run(["debootstrap", "--variant=minbase", "bookworm", root, debian_mirror()],
                   check=True, capture_output=True)
    (root / "usr/sbin/policy-rc.d").write_text("#!/bin/sh\nexit 101\n")
    (root / "usr/sbin/policy-rc.d").chmod(0o755)
    shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
    enter = 'mount -t proc proc "$0/proc" && mount -t tmpfs shm "$0/dev/shm" && exec chroot "$0" "$@"'

    def inside(*command, binds=(), **kw):
        mounts = []
        for outside, within in binds:
            (root / within.lstrip("/")).mkdir(parents=True, exist_ok=True)
            mounts.append(f'mount --bind {outside} "$0{within}" && mount -o remount,bind,ro "$0{within}" && ')
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                               "".join(mounts) + enter, root, *command], capture_output=True, text=True, **kw)

    try:
        yield inside
    finally:
        # Nothing is mounted in it; a server it ran was stopped (or died).
        shutil.rmtree(root, ignore_errors=True)


FRESH_DEBIAN = pytest.mark.skipif(
    MAJOR != "15" or not debian_postgresql() or shutil.which("debootstrap") is None or debian_mirror() is None,
    reason="needs Debian 12's own PostgreSQL (15), debootstrap and a Debian archive")


@pytest.fixture(scope="module")
def debian(tmp_path_factory):
    """One fresh Debian 12 (fresh_debian()) for this module's tests: its
    root, and the function that runs a command in it."""
    root = tmp_path_factory.mktemp("fresh") / "debian"
    with fresh_debian(root) as inside:
        assert inside("apt-get", "update", "-q").returncode == 0
        yield root, inside


def running_in(root):
    """The processes whose root is `root`: what runs in the fresh Debian."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if proc.name.isdigit() and os.readlink(proc / "root") == str(root):
                found.append((proc.name, (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
    return found


@FRESH_DEBIAN
def test_a_fresh_debian_installs_the_package_with_apt_and_runs_the_quick_start(redis_server, packages, debian):
    """The quick start on a Debian 12 that has nothing but its base system:
    `apt install ./<package>.deb` brings PostgreSQL with it; no Rust; the
    server preloads the library, CREATE EXTENSION, and a committed event
    reaches this machine's Redis while a rolled-back one does not. `apt
    purge` takes the package away again."""
    deb = packages["deb"]
    root, inside = debian
    shutil.copy(deb, root / "tmp" / deb.name)
    assert inside("sh", "-c", "command -v cargo || command -v rustc").returncode != 0, "Rust in the base system"
    try:
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
    finally:
        purged = inside("apt-get", "purge", "-y", "-q", f"postgresql-{MAJOR}-outbox-dispatch",
                        env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        shutil.rmtree(root / "tmp/data", ignore_errors=True)
    assert purged.returncode == 0, purged.stderr
    assert not list((root / f"usr/share/postgresql/{MAJOR}/extension").glob("outbox_dispatch*"))


def debian_packages(inside):
    listed = inside("dpkg-query", "-W", "-f", "${db:Status-Status} ${Package}\n")
    assert listed.returncode == 0, listed.stderr
    return {line.split()[1] for line in listed.stdout.splitlines() if line.startswith("installed ")}


@FRESH_DEBIAN
def test_make_install_on_a_fresh_debian_needs_the_build_toolchain_alone(debian):
    """`make install` from a fresh copy of the sources (the files a clone
    has) on a Debian 12 with the build toolchain alone: the Debian packages
    scripts/toolchain.sh names, and Rust and cargo-pgrx (this machine's,
    mounted read-only: no Rust comes from Debian), as a user who is not
    root and may write PostgreSQL's library and extension directories.
    It installs the extension's files and nothing else: no package (no
    redis, rabbitmq or prometheus), nothing of it left running, so no port
    listening. (The release profile without its link-time optimisation,
    for the test's time: what is checked is what the install needs.)"""
    root, inside = debian
    apt = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    inside("apt-get", "purge", "-y", "-q", f"postgresql-{MAJOR}-outbox-dispatch", env=apt)
    toolchain = subprocess.run([ROOT / "scripts" / "toolchain.sh", "packages"], env=dict(os.environ, PG=MAJOR),
                               check=True, capture_output=True, text=True).stdout.split()
    got = inside("apt-get", "install", "-y", "-q", "--no-install-recommends", *toolchain, env=apt)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    # Cargo fetches the crates from their registry as this machine does,
    # trusting what it trusts (as its resolver, fresh_debian()).
    (root / "etc/ssl/certs").mkdir(parents=True, exist_ok=True)
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", root / "etc/ssl/certs/ca-certificates.crt")
    before = debian_packages(inside)

    home = root / "home/builder"
    assert inside("useradd", "--create-home", "builder").returncode == 0
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (home / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, home / "src" / name)
    libdir, extdir = f"/usr/lib/postgresql/{MAJOR}/lib", f"/usr/share/postgresql/{MAJOR}/extension"
    assert inside("chown", "-R", "builder:", "/home/builder", libdir, extdir).returncode == 0

    sysroot = subprocess.run(["rustc", "--print", "sysroot"], check=True, capture_output=True, text=True).stdout.strip()
    pgrx = Path(shutil.which("cargo-pgrx")).parent
    build = inside("runuser", "-u", "builder", "--", "env", "-i", "HOME=/home/builder",
                   "PATH=/opt/rust/bin:/opt/cargo-pgrx:/usr/bin:/bin", "CARGO_PROFILE_RELEASE_LTO=false",
                   "CARGO_PROFILE_RELEASE_OPT_LEVEL=0", "CARGO_PROFILE_RELEASE_CODEGEN_UNITS=64",
                   "make", "-C", "/home/builder/src", "install",
                   binds=[(sysroot, "/opt/rust"), (str(pgrx), "/opt/cargo-pgrx")], timeout=3600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-5000:]

    assert {p.name for p in (root / extdir.lstrip("/")).glob("outbox_dispatch*")} == EXTENSION_FILES
    assert (root / libdir.lstrip("/") / "outbox_dispatch.so").is_file()
    after = debian_packages(inside)
    assert after == before, f"installed by make install: {sorted(after - before)}"
    assert not after & {"redis-server", "rabbitmq-server", "prometheus"}
    assert running_in(root) == [], "left running: nothing of make install may run, nor listen"
