"""`make package`: an archive that installs on a server without Rust, and
the Python package's wheel, which carries the outbox-dispatch command."""

import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

from harness import PG_BIN, Cluster, queued_ids, wait_until
from standalone import dsn, fresh_database, plain_server

ROOT = Path(__file__).resolve().parent.parent
PG_CONFIG = str(PG_BIN / "pg_config")
MAJOR = subprocess.run([PG_CONFIG, "--version"], check=True, capture_output=True, text=True).stdout.split()[1].split(".")[0]


@pytest.fixture(scope="module")
def packages():
    """`make package` (of the debug builds): the archive and the wheel."""
    built = subprocess.run(["./scripts/package.sh"], cwd=ROOT,
                           env=dict(os.environ, PACKAGE_PROFILE="dev", PG_CONFIG=PG_CONFIG),
                           check=True, capture_output=True, text=True)
    return [ROOT / line for line in built.stdout.strip().splitlines()[-2:]]


def test_the_archive_installs_and_runs(redis_server, packages):
    archive, wheel = packages
    assert f"-pg{MAJOR}-" in archive.name and archive.name.endswith(".tar.gz")
    with zipfile.ZipFile(wheel) as python_package:
        assert {"outbox_dispatch/__init__.py", "outbox_dispatch/celery.py", "outbox_dispatch/producer.py",
                "outbox_dispatch/report.py", "outbox_dispatch/py.typed",
                "outbox_dispatch-0.10.0.data/scripts/outbox-dispatch"} <= set(python_package.namelist())
    assert "-py3-none-" in wheel.name and not wheel.name.endswith("-any.whl"), wheel.name
    with tempfile.TemporaryDirectory() as unpacked, tarfile.open(archive) as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert {"outbox_dispatch.so", "outbox_dispatch.control", "outbox_dispatch--0.10.0.sql", "outbox_dispatch--0.9.0.sql", "outbox_dispatch--0.8.0.sql", "outbox_dispatch--0.7.0.sql", "outbox_dispatch--0.6.0.sql", "outbox_dispatch--0.5.0.sql",
                "outbox_dispatch--0.4.0.sql", "outbox_dispatch--0.3.0.sql", "outbox_dispatch--0.2.0.sql", "outbox_dispatch--0.1.0.sql",
                "outbox_dispatch--0.1.0--0.2.0.sql", "outbox_dispatch--0.2.0--0.3.0.sql",
                "outbox_dispatch--0.3.0--0.4.0.sql", "outbox_dispatch--0.4.0--0.5.0.sql", "outbox_dispatch--0.5.0--0.6.0.sql",
                "outbox_dispatch--0.6.0--0.7.0.sql",
                "outbox_dispatch--0.7.0--0.8.0.sql", "outbox_dispatch--0.8.0--0.9.0.sql",
                "outbox_dispatch--0.9.0--0.10.0.sql", "install.sh"} <= names
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
        subprocess.run([str(top / "install.sh")], env=dict(os.environ, PG_CONFIG=PG_CONFIG),
                       check=True, capture_output=True)

    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        event_id = pg.value("SELECT outbox_enqueue('packaged', '{}', queue => 'q_package')")
        wait_until(lambda: queued_ids(redis_server.client(), "q_package") == [str(event_id)],
                   message="delivery from the packaged build")
    finally:
        pg.close()


def test_the_wheel_brings_the_package_and_the_command(redis_server, packages, tmp_path):
    """`pip install outbox-dispatch` on a machine without Rust: the Python
    package and the `outbox-dispatch` command, which installs the outbox
    into a server without the library and delivers from it."""
    wheel = packages[1]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([venv / "bin" / "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True)
    command = venv / "bin" / "outbox-dispatch"
    assert subprocess.run([command, "--version"], check=True, capture_output=True,
                          text=True).stdout.strip() == "outbox-dispatch 0.10.0"
    assert subprocess.run([venv / "bin" / "python", "-c", "import outbox_dispatch; print(outbox_dispatch.__version__)"],
                          check=True, capture_output=True, text=True, cwd=tmp_path).stdout.strip() == "0.10.0"

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
