"""`make bench`, without the library (docs/managed.md): what an enqueue costs
on a server where the schema is installed by `outbox-dispatch install`,
against a plain INSERT of the same row, beside the same with the library,
in the same run. The per-insert work the library does in Rust (the id, the
routing default, the wake) is SQL there; a NOTIFY per insert
(`outbox.notify = on`) is what a sidecar woken by LISTEN would cost the
application.

Runs two PostgreSQL servers (fsync on, dispatch paused where there is
one): one with the library preloaded and the extension created, one
without shared_preload_libraries and the schema installed by a role that
is not a superuser; the workloads take turns on both. Writes
bench/results/standalone.md. Sizes as bench/run.py: BENCH_PGBENCH_SECONDS,
BENCH_PGBENCH_CLIENTS, BENCH_ROUNDS (5 here), BENCH_PAYLOAD_BYTES."""

import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from harness import Cluster  # noqa: E402
from run import PAYLOAD, PGBENCH_CLIENTS, PGBENCH_SECONDS, SERVER_CONF, machine, pgbench  # noqa: E402
from wal import create_plain  # noqa: E402

BIN = ROOT / "target" / "release" / "outbox-dispatch"
RESULTS = ROOT / "bench" / "results"

ROUNDS = int(os.environ.get("BENCH_ROUNDS", 5))
PLAIN = "plain INSERT (no trigger)"
HOSTS = ("with the library", "without it")


def install(pg):
    pg.sql("CREATE ROLE owner LOGIN")
    pg.sql("GRANT pg_read_all_stats TO owner")
    pg.sql("ALTER SCHEMA public OWNER TO owner")
    pg.sql("ALTER DATABASE postgres OWNER TO owner")
    subprocess.run([str(BIN), "install", "--dsn", f"host={pg.dir} port={pg.port} user=owner dbname=postgres"],
                   check=True, capture_output=True, text=True)


def enqueue_cost(servers):
    """TPS of each workload on each server, the median of ROUNDS runs, the
    workloads and the servers taking turns."""
    payload = PAYLOAD.replace("'", "''")
    enqueue = f"SELECT outbox_enqueue('bench', '{payload}', queue => 'bench_enqueue');\n"
    workloads = {
        PLAIN: (f"INSERT INTO bench_plain (event_type, payload, queue) "
                f"VALUES ('bench', '{payload}', 'bench_enqueue');\n", ""),
        "outbox_enqueue(), notify off": (enqueue, ""),
        "INSERT INTO outbox.events, notify off": (
            f"INSERT INTO outbox.events (event_type, payload, queue) "
            f"VALUES ('bench', '{payload}', 'bench_enqueue');\n", ""),
        "outbox_enqueue(), notify on": (enqueue, "-c outbox.notify=on"),
    }
    for pg in servers.values():
        create_plain(pg, "bench_plain")
    runs = {(host, name): [] for host in servers for name in workloads}
    for _ in range(ROUNDS):
        for name, (script, options) in workloads.items():
            for host, pg in servers.items():
                pg.sql("TRUNCATE outbox.log, bench_plain")
                pg.sql("CHECKPOINT")
                runs[(host, name)].append(pgbench(pg, script, options))
    return {key: statistics.median(tps) for key, tps in runs.items()}, list(workloads)


def write_report(tps, workloads):
    lines = [
        "# Enqueue without the library",
        "",
        f"{machine()}; pgbench, {PGBENCH_CLIENTS} clients, {PGBENCH_SECONDS} s per run, the median of {ROUNDS} "
        "runs, the workloads and the servers taking turns; one statement per transaction. With the library: "
        "preloaded, the extension created, dispatch paused. Without it: a server without "
        "shared_preload_libraries, the schema installed by `outbox-dispatch install` as a role that is not a "
        "superuser, no dispatcher running.",
        "",
        "| workload | " + " | ".join(f"{host}: TPS, of a plain INSERT" for host in HOSTS) + " |",
        "|---|" + "---|" * len(HOSTS),
    ]
    for name in workloads:
        cells = [f"{tps[(host, name)]:,.0f}, {tps[(host, name)] / tps[(host, PLAIN)]:.0%}" for host in HOSTS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "standalone.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    servers = {}
    try:
        servers[HOSTS[0]] = Cluster("redis://127.0.0.1:1/0", server_conf=SERVER_CONF, enabled="off")
        servers[HOSTS[0]].sql("CREATE EXTENSION outbox_dispatch")
        servers[HOSTS[1]] = Cluster("redis://127.0.0.1:1/0", preload=False, server_conf=SERVER_CONF)
        install(servers[HOSTS[1]])
        write_report(*enqueue_cost(servers))
    finally:
        for pg in servers.values():
            pg.close()


if __name__ == "__main__":
    main()
