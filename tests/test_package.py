"""`make package`: an archive that installs on a server without Rust."""

import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

from harness import Cluster, queued_ids, wait_until

ROOT = Path(__file__).resolve().parent.parent


def test_the_archive_installs_and_runs(redis_server):
    built = subprocess.run(["./scripts/package.sh"], cwd=ROOT, env=dict(os.environ, PACKAGE_PROFILE="dev"),
                           check=True, capture_output=True, text=True)
    archive = ROOT / built.stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory() as unpacked, tarfile.open(archive) as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert {"outbox_dispatch.so", "outbox_dispatch.control", "outbox_dispatch--0.3.0.sql", "outbox_dispatch--0.2.0.sql",
                "outbox_dispatch--0.1.0.sql", "outbox_dispatch--0.1.0--0.2.0.sql",
                "outbox_dispatch--0.2.0--0.3.0.sql", "install.sh"} <= names
        tar.extractall(unpacked)
        [top] = Path(unpacked).iterdir()
        pg_config = "/usr/lib/postgresql/15/bin/pg_config"
        subprocess.run([str(top / "install.sh")], env=dict(os.environ, PG_CONFIG=pg_config),
                       check=True, capture_output=True)

    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        event_id = pg.value("SELECT outbox_enqueue('packaged', '{}', queue => 'q_package')")
        wait_until(lambda: queued_ids(redis_server.client(), "q_package") == [str(event_id)],
                   message="delivery from the packaged build")
    finally:
        pg.close()
