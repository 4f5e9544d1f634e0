"""A Prometheus scrape target for outbox_dispatch, with no code to write:

    python -m outbox_dispatch.exporter --dsn "host=db dbname=app user=metrics" --listen :9808

It serves ``/metrics``: for each database given (``--dsn``, once per
database), what ``outbox_metrics_prometheus()`` renders there, each sample
labelled ``database``, and ``outbox_up{database}``: 1 when that database
answered the scrape, 0 when it did not (unreachable, too slow, the
extension missing), so that Prometheus sees a database that is down rather
than a gap. The databases are asked at once, each over one connection kept
between scrapes and opened again after a failure. Every scrape ends within
its deadline (``--timeout``, and never later than Prometheus's own scrape
timeout allows, but at least a second), whatever a server does. Scrapes at
the same time share one query per database; a scrape that gives up leaves
it to end on its own deadline (``--timeout``), and only a query past that
drops its connection. At most :data:`MAX_REQUESTS` requests are served at
once, each read within :data:`REQUEST_SECONDS`. The role needs nothing but ``pg_monitor``, which may execute
``outbox_metrics_prometheus()``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Sequence, Tuple

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

#: The exposition format's content type.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: The header in which Prometheus sends its scrape timeout, in seconds.
SCRAPE_TIMEOUT_HEADER = "X-Prometheus-Scrape-Timeout-Seconds"

#: What a scrape leaves of Prometheus's timeout for merging and sending the
#: answer.
SCRAPE_MARGIN_SECONDS = 0.5

#: The shortest a scrape waits, whatever scrape timeout a client sends (but
#: never longer than ``--timeout``): a client cannot make the exporter give
#: up on every answer.
MIN_DEADLINE_SECONDS = 1.0

#: Requests served at once; those beyond are answered 503 at once, with no
#: thread.
MAX_REQUESTS = 8

#: Seconds a client has to send its whole request (line and headers), and
#: the longest any one read or write of the connection may wait.
REQUEST_SECONDS = 5.0

#: What pg_stat_activity shows of the exporter's connections (unless the
#: DSN names another).
APPLICATION_NAME = "outbox_dispatch exporter"

#: TCP keepalives on the connections kept between scrapes: a peer that
#: vanished is noticed while idle, not by the next scrape's deadline.
KEEPALIVES = {"keepalives": "1", "keepalives_idle": "30", "keepalives_interval": "10", "keepalives_count": "3"}


def deadline(timeout: float, scrape_timeout: Optional[str]) -> float:
    """Seconds a scrape may take: ``timeout``, and less than the scrape
    timeout Prometheus sent (its header's value), by
    :data:`SCRAPE_MARGIN_SECONDS`; but never less than
    :data:`MIN_DEADLINE_SECONDS` (or ``timeout``, when that is shorter),
    whatever the header says."""
    try:
        given = float(scrape_timeout) if scrape_timeout is not None else math.inf
    except ValueError:
        given = math.inf
    if not given > 0:  # NaN, 0 or negative: not a timeout
        given = math.inf
    return min(timeout, max(MIN_DEADLINE_SECONDS, given - SCRAPE_MARGIN_SECONDS))


def names(dsns: Sequence[str]) -> List[str]:
    """The ``database`` label of each DSN: its database name (libpq's
    default, the user name, when it gives none), followed by
    ``@host:port`` where several DSNs name databases of the same name.
    Two DSNs for the same database are refused (ValueError)."""
    parsed = [conninfo_to_dict(dsn) for dsn in dsns]
    plain = [str(p.get("dbname") or p.get("user") or "") for p in parsed]
    labels = [
        f"{name}@{p.get('host') or p.get('hostaddr') or 'localhost'}:{p.get('port') or 5432}"
        if plain.count(name) > 1 else name
        for name, p in zip(plain, parsed)
    ]
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"--dsn: the same database is given more than once: {', '.join(twice)}")
    return labels


def _retrieved(task: "asyncio.Future[Any]") -> None:
    """Marks the outcome of a query as seen, whether a scrape still waited
    for it or not, so that asyncio does not log it as lost."""
    if not task.cancelled():
        task.exception()


class Target:
    """One database, scraped over one connection kept between scrapes. Its
    methods run on the exporter's event loop."""

    def __init__(self, dsn: str, database: str, timeout: float) -> None:
        self.dsn = dsn
        self.database = database
        self.timeout = timeout
        self._asking: Optional["asyncio.Task[Optional[str]]"] = None
        self._conn: Optional[psycopg.AsyncConnection[Any]] = None
        self._call = ""

    async def scrape(self, seconds: float) -> Tuple[Optional[str], float]:
        """The database's exposition text (None when it could not be had
        within ``seconds``) and how long waiting for it took. Scrapes at
        the same time share one query: the one in flight, or a new one.
        A scrape that gives up leaves the query to end on its own (within
        ``--timeout``, its own deadline), and its connection open."""
        started = time.monotonic()
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask_within_deadline())
            self._asking.add_done_callback(_retrieved)
        done, _ = await asyncio.wait({self._asking}, timeout=seconds)
        text = None
        if done:
            try:
                text = self._asking.result()
            except Exception:  # noqa: BLE001 - a fault of the exporter's own: down, and not lost
                pass
        return text, time.monotonic() - started

    async def _ask_within_deadline(self) -> Optional[str]:
        """One query, connecting included, within ``--timeout``: its text,
        or None (unreachable, the connection lost, the deadline passed).
        One that fails or exceeds its deadline leaves the connection in no
        known state: it is closed (psycopg first asks the server to cancel
        the query, a few seconds at most), and the next scrape opens
        another."""
        task = asyncio.current_task()
        assert task is not None
        expired = []

        def expire() -> None:
            expired.append(True)
            task.cancel()

        # Not asyncio.wait_for, which may hang on Python 3.11 (CPython
        # issue 86296).
        timer = asyncio.get_running_loop().call_later(self.timeout, expire)
        try:
            return await self._ask()
        except (psycopg.Error, OSError):
            pass
        except asyncio.CancelledError:
            if not expired:  # not ours: the exporter is stopping
                await self._close()
                raise
            if hasattr(task, "uncancel"):  # Python 3.11: the cancellation was ours, and is handled
                task.uncancel()
        except BaseException:
            await self._close()
            raise
        finally:
            timer.cancel()
        # Down. Out of the except clauses, so that no exception kept with
        # the task keeps the frames of an abandoned connection attempt, and
        # its socket, alive until the next scrape.
        await self._close()
        return None

    async def _ask(self) -> Optional[str]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(self._conninfo(), autocommit=True)
            cursor = await self._conn.execute(
                "SELECT pg_catalog.quote_ident(n.nspname) FROM pg_catalog.pg_extension AS x "
                "JOIN pg_catalog.pg_namespace AS n ON n.oid = x.extnamespace WHERE x.extname = 'outbox_dispatch'"
            )
            row = await cursor.fetchone()
            if row is None:
                await self._close()
                return None
            self._call = f"SELECT {row[0]}.outbox_metrics_prometheus()"
        cursor = await self._conn.execute(self._call.encode())
        result = await cursor.fetchone()
        return None if result is None else str(result[0])

    def _conninfo(self) -> str:
        """The DSN with the exporter's deadlines (they override the DSN's)
        and TCP keepalives (unless the DSN has its own)."""
        milliseconds = int(self.timeout * 1000)
        return make_conninfo("", **{
            **KEEPALIVES,
            "application_name": APPLICATION_NAME,
            **conninfo_to_dict(self.dsn),
            "connect_timeout": max(1, math.ceil(self.timeout)),
            # Data the server's host does not acknowledge is given up on
            # after the deadline; a server that stops answering, by the
            # deadline of the scrape (Target.scrape).
            "tcp_user_timeout": milliseconds,
            "options": f"-c statement_timeout={milliseconds} -c search_path=pg_catalog",
        })

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                await conn.close()
            except psycopg.Error:
                pass


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
    out += gauge("outbox_up", "Whether the database answered the last scrape (1) or not (0).",
                 [(database, 0.0 if text is None else 1.0) for database, text, _ in scraped])
    out += gauge("outbox_scrape_duration_seconds", "How long the last scrape of the database took.",
                 [(database, took) for database, _, took in scraped])
    return "\n".join(out) + "\n"


def gauge(name: str, help_text: str, values: Sequence[Tuple[str, float]]) -> List[str]:
    """A gauge family of one sample per database."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"] + [
        label(f"{name} {value:g}", database) for database, value in values
    ]


class Exporter:
    """Scrapes every target at once, on one event loop of its own: a
    scrape's cost in threads is the HTTP request's, whatever the databases
    do."""

    def __init__(self, dsns: Sequence[str], timeout: float) -> None:
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self.targets = [Target(dsn, name, timeout) for dsn, name in zip(dsns, names(dsns))]
        threading.Thread(target=self._loop.run_forever, name="outbox-exporter-scrapes", daemon=True).start()

    def exposition(self, seconds: Optional[float] = None) -> str:
        """The merged exposition, within ``seconds`` (``--timeout`` by default)."""
        limit = self.timeout if seconds is None else min(seconds, self.timeout)
        return merge(asyncio.run_coroutine_threadsafe(self._scrape(limit), self._loop).result())

    async def _scrape(self, seconds: float) -> List[Tuple[str, Optional[str], float]]:
        scraped = await asyncio.gather(*(t.scrape(seconds) for t in self.targets))
        return [(t.database, text, took) for t, (text, took) in zip(self.targets, scraped)]


def handler(exporter: Exporter) -> type:
    class Handler(BaseHTTPRequestHandler):
        #: The longest one read or write of the connection may wait; the
        #: whole request must have arrived within it too (setup()).
        timeout = REQUEST_SECONDS

        def setup(self) -> None:
            super().setup()
            # A client that sends its request slowly, a byte at a time, is
            # cut off when the request has not all arrived in time: shutting
            # the socket down ends the read its thread waits in.
            self._read_by = threading.Timer(REQUEST_SECONDS, self._cut_off)
            self._read_by.daemon = True
            self._read_by.start()

        def _cut_off(self) -> None:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def parse_request(self) -> bool:
            parsed = super().parse_request()
            self._read_by.cancel()  # the request line and headers are in
            return parsed

        def finish(self) -> None:
            self._read_by.cancel()
            super().finish()

        def do_GET(self) -> None:
            if self.path.split("?")[0] == "/metrics":
                seconds = deadline(exporter.timeout, self.headers.get(SCRAPE_TIMEOUT_HEADER))
                body, status, kind = exporter.exposition(seconds).encode(), 200, CONTENT_TYPE
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


class Server(ThreadingHTTPServer):
    """A thread per request, at most ``max_requests`` at once: a request
    beyond them is answered 503 at once and closed, with no thread."""

    BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

    def __init__(self, listen: Tuple[str, int], handler_class: type, max_requests: int = MAX_REQUESTS) -> None:
        super().__init__(listen, handler_class)
        self._slots = threading.BoundedSemaphore(max_requests)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.setblocking(False)
                request.send(self.BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


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
                        help="seconds a scrape may take, connecting included (default 5); never more than "
                             "Prometheus's scrape timeout less half a second")
    options = parser.parse_args(argv)
    if not options.timeout > 0:
        parser.error("--timeout must be above 0")
    for number, dsn in enumerate(options.dsn, 1):
        try:
            conninfo_to_dict(dsn)
        except psycopg.Error:
            # libpq's message quotes the DSN, password included: not shown.
            parser.error(f"--dsn number {number} is not a connection string or URI libpq can read "
                         "(not shown: it may hold a password)")
    try:
        exporter = Exporter(options.dsn, options.timeout)
    except ValueError as e:  # the same database twice (named by database, host and port)
        parser.error(str(e))
    server = Server(options.listen, handler(exporter))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
