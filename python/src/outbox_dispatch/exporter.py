"""A Prometheus scrape target for outbox_dispatch, with no code to write:

    python -m outbox_dispatch.exporter --dsn "host=db dbname=app user=metrics" --listen :9808

It serves ``/metrics``: for each database given (``--dsn``, once per
database), what ``outbox_metrics_prometheus()`` renders there, each sample
labelled ``database``, and ``outbox_up{database}``: 1 when that database
answered the last scrape, 0 when it did not (unreachable, too slow, the
extension missing), so that Prometheus sees a database that is down rather
than a gap. Each database has one connection, opened at the first scrape
and again after a failure, and each scrape of it has a deadline
(``--timeout``, connect and statement). The role needs nothing but
``pg_monitor``, which may execute ``outbox_metrics_prometheus()``.
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Sequence, Tuple

import psycopg
from psycopg.conninfo import conninfo_to_dict

#: The exposition format's content type.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"



class Target:
    """One database, scraped over one connection kept between scrapes."""

    def __init__(self, dsn: str, timeout: float) -> None:
        self.dsn = dsn
        self.timeout = timeout
        self.database = str(conninfo_to_dict(dsn).get("dbname") or conninfo_to_dict(dsn).get("user") or "")
        self._lock = threading.Lock()
        self._conn: Optional[psycopg.Connection[Any]] = None
        self._call = ""

    def scrape(self) -> Tuple[Optional[str], float]:
        """The database's exposition text (None when it could not be had)
        and how long asking took."""
        started = time.monotonic()
        with self._lock:
            try:
                text = self._ask()
            except psycopg.Error:
                self._close()
                text = None
        return text, time.monotonic() - started

    def _ask(self) -> Optional[str]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.dsn,
                autocommit=True,
                connect_timeout=max(1, math.ceil(self.timeout)),
                options=f"-c statement_timeout={int(self.timeout * 1000)} -c search_path=pg_catalog",
            )
            row = self._conn.execute(
                "SELECT pg_catalog.quote_ident(n.nspname) FROM pg_catalog.pg_extension AS x "
                "JOIN pg_catalog.pg_namespace AS n ON n.oid = x.extnamespace WHERE x.extname = 'outbox_dispatch'"
            ).fetchone()
            if row is None:
                self._close()
                return None
            self._call = f"SELECT {row[0]}.outbox_metrics_prometheus()"
        result = self._conn.execute(self._call.encode()).fetchone()
        return None if result is None else str(result[0])

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
        self._conn = None


def label(line: str, database: str) -> str:
    """A sample line with ``database`` as its first label."""
    value = database.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
    name, rest = line[:name_end], line[name_end:]
    if rest.startswith("{}"):
        rest = rest[2:]
    if rest.startswith("{"):
        return f'{name}{{database="{value}",{rest[1:]}'
    return f'{name}{{database="{value}"}}{rest}'


def merge(scraped: Sequence[Tuple[str, Optional[str], float]]) -> str:
    """One exposition of every database's: each family's HELP and TYPE
    once, then its samples from every database, labelled; then the
    exporter's own ``outbox_up`` and scrape durations."""
    families: Dict[str, Tuple[List[str], List[str]]] = {}
    for database, text, _ in scraped:
        current: Optional[Tuple[List[str], List[str]]] = None
        for line in (text or "").splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                current = families.setdefault(name, ([], []))
                if line not in current[0]:
                    current[0].append(line)
            elif line.strip() and not line.startswith("#") and current is not None:
                current[1].append(label(line, database))
    out: List[str] = []
    for head, samples in families.values():
        out += head + samples
    out += gauge("outbox_up", "Whether the database answered the exporter's last scrape (1) or not (0).",
                 [(database, 0.0 if text is None else 1.0) for database, text, _ in scraped])
    out += gauge("outbox_scrape_duration_seconds", "How long the exporter's last scrape of the database took.",
                 [(database, took) for database, _, took in scraped])
    return "\n".join(out) + "\n"


def gauge(name: str, help_text: str, values: Sequence[Tuple[str, float]]) -> List[str]:
    """A gauge family of one sample per database."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"] + [
        label(f"{name} {value:g}", database) for database, value in values
    ]


class Exporter:
    def __init__(self, targets: Sequence[Target]) -> None:
        self.targets = list(targets)

    def exposition(self) -> str:
        return merge([(t.database, *t.scrape()) for t in self.targets])


def handler(exporter: Exporter) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] == "/metrics":
                body, status, kind = exporter.exposition().encode(), 200, CONTENT_TYPE
            elif self.path == "/":
                body, status, kind = b"outbox_dispatch exporter: see /metrics\n", 200, "text/plain"
            else:
                body, status, kind = b"not found\n", 404, "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base's name)
            pass

    return Handler


def address(listen: str) -> Tuple[str, int]:
    """``host:port`` or ``:port`` (every interface)."""
    host, _, port = listen.rpartition(":")
    if not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen: {listen!r} is not host:port or :port")
    return host.strip("[]"), int(port)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m outbox_dispatch.exporter", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", action="append", required=True,
                        help="a libpq connection string or URI; once per database")
    parser.add_argument("--listen", type=address, default=("", 9808), help="host:port or :port (default :9808)")
    parser.add_argument("--timeout", type=float, default=5.0,
                        help="seconds each database may take to answer a scrape (default 5)")
    options = parser.parse_args(argv)
    exporter = Exporter([Target(dsn, options.timeout) for dsn in options.dsn])
    server = ThreadingHTTPServer(options.listen, handler(exporter))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
