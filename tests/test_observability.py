"""Observability that plugs in, tested with the real tools: the exporter
(`python -m outbox_dispatch.exporter`) scraped by Debian's Prometheus, as a
role with nothing but pg_monitor; a database that cannot answer shows as
outbox_up 0 without holding up the others; the alert rules pass `promtool
check rules` and their unit tests; the Grafana dashboard asks only for
metrics the project exports."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from alert_recording import TARGET, Recording, firing, promtool_on
from harness import exporter, fetch, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
CONTRIB = ROOT / "contrib"


@pytest.fixture
def monitor(outbox):
    outbox.sql("DO $$ BEGIN CREATE ROLE outbox_metrics LOGIN IN ROLE pg_monitor; "
               "EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    return outbox


def dsn(pg, dbname="postgres", port=None):
    return f"host={pg.dir} port={port or pg.port} user=outbox_metrics dbname={dbname}"


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_scrapes_the_exporter_as_a_pg_monitor_role(monitor, redis_server):
    proc, url = exporter(dsn(monitor))
    work = Path(tempfile.mkdtemp(prefix="outbox-prometheus-"))
    prometheus = None
    try:
        scraped = families(fetch(url))
        assert [s.value for s in scraped["outbox_up"].samples] == [1]
        assert {s.labels["database"] for s in scraped["outbox_events"].samples} == {"postgres"}

        port = free_port()
        target = urllib.parse.urlparse(url).netloc
        (work / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files: ['{CONTRIB / 'prometheus' / 'outbox_alerts.yml'}']\n"
            f"scrape_configs:\n  - job_name: outbox\n    static_configs:\n      - targets: ['{target}']\n")
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def query(expr):
            try:
                answer = json.loads(fetch(f"http://127.0.0.1:{port}/api/v1/query?"
                                          + urllib.parse.urlencode({"query": expr}), timeout=10))
            except OSError:
                return []
            return answer["data"]["result"]

        monitor.sql("SELECT outbox_enqueue('observed', '{}', queue => 'q_observed') FROM generate_series(1, 25)")
        wait_until(lambda: monitor.count("dispatched") == 25, message="the events dispatched")
        expected = monitor.metric("outbox_dispatched_total")
        wait_until(lambda: [float(r["value"][1]) for r in query('outbox_dispatched_total{database="postgres"}')]
                   == [expected], timeout=60, message="outbox_dispatched_total in Prometheus")
        assert [r["value"][1] for r in query('up{job="outbox"}')] == ["1"]
        # The rules load and evaluate: a healthy outbox fires none (the
        # exporter's alert is pending at most until the first evaluation
        # after the first scrape).
        rules = json.loads(fetch(f"http://127.0.0.1:{port}/api/v1/rules"))["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} >= {"OutboxLagHigh", "OutboxReportsNotArriving",
                                                                  "OutboxExporterDown"}
        wait_until(lambda: json.loads(fetch(f"http://127.0.0.1:{port}/api/v1/alerts"))["data"]["alerts"] == [],
                   timeout=30, message="no alert, not even pending")
    finally:
        if prometheus:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


def test_a_database_that_cannot_answer_is_down_and_the_others_are_served(monitor):
    """Several databases, one of them unreachable (nothing listens) and one
    without the extension: each has its outbox_up, the scrape ends within
    the timeout, and the exporter keeps serving."""
    nowhere = socket.socket()
    nowhere.bind(("127.0.0.1", 0))
    dead = f"host=127.0.0.1 port={nowhere.getsockname()[1]} user=outbox_metrics dbname=nowhere"
    nowhere.close()
    monitor.sql("DROP DATABASE IF EXISTS plain")
    monitor.sql("CREATE DATABASE plain")
    proc, url = exporter(dsn(monitor), dead, dsn(monitor, "plain"), timeout=2)
    try:
        started = time.monotonic()
        scraped = families(fetch(url))
        assert time.monotonic() - started < 10
        up = {s.labels["database"]: s.value for s in scraped["outbox_up"].samples}
        assert up == {"postgres": 1, "nowhere": 0, "plain": 0}
        assert {s.labels["database"] for s in scraped["outbox_events"].samples} == {"postgres"}
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_database_that_stops_answering_is_down_within_the_deadline_and_nothing_piles_up(monitor):
    """Two targets with the database name postgres: the cluster, and a
    server that accepts connections and never answers. Each gets its own
    label, and every scrape ends within the deadline (the two are asked at
    once), with outbox_up 0 for the silent one. Then the cluster stops
    answering too (its postmaster and the backend serving the exporter
    stopped with SIGSTOP): scrapes, several at once, still end within the
    deadline, with no thread or connection left behind; and once it
    answers again, so does the exporter."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    accepted = []

    def accept():
        while True:
            try:
                accepted.append(silent.accept()[0])
            except OSError:  # closed: the test is over
                return

    threading.Thread(target=accept, daemon=True).start()
    host, port = silent.getsockname()
    proc, url = exporter(dsn(monitor), f"host={host} port={port} user=outbox_metrics dbname=postgres",
                         timeout=2)
    ours, theirs = f"postgres@{monitor.dir}:{monitor.port}", f"postgres@{host}:{port}"
    stopped = []
    try:
        def scrape():
            started = time.monotonic()
            scraped = families(fetch(url, timeout=30))
            up = {s.labels["database"]: s.value for s in scraped["outbox_up"].samples}
            return up, time.monotonic() - started

        up, took = scrape()
        assert up == {ours: 1, theirs: 0} and took < 3.5, (up, took)

        [backend] = [r[0] for r in monitor.sql(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox_dispatch exporter'")]
        postmaster = int((monitor.data / "postmaster.pid").read_text().split()[0])
        for pid in (postmaster, backend):
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        results = []
        scrapers = [threading.Thread(target=lambda: results.append(scrape())) for _ in range(3)]
        for t in scrapers:
            t.start()
        for t in scrapers:
            t.join(timeout=60)
        for _ in range(3):
            results.append(scrape())
        assert [up for up, _ in results] == [{ours: 0, theirs: 0}] * 6
        assert max(took for _, took in results) < 3.5, results
        threads = int(re.search(r"Threads:\s+(\d+)", Path(f"/proc/{proc.pid}/status").read_text())[1])
        assert threads <= 4, f"{threads} threads after the scrapes"
        sockets = [f for f in Path(f"/proc/{proc.pid}/fd").iterdir() if os.readlink(f).startswith("socket:")]
        # The listener, and per database at most its connection and the
        # request that cancels a query cut off (psycopg's, a few seconds).
        assert len(sockets) <= 5, f"{len(sockets)} sockets open"

        while stopped:
            os.kill(stopped.pop(), signal.SIGCONT)
        assert wait_until(lambda: scrape()[0] == {ours: 1, theirs: 0}, timeout=30, message="the database back")
        assert proc.poll() is None
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=30)
        silent.close()
        for s in accepted:
            s.close()


def scrape_with(url, scrape_timeout):
    """A scrape as a client sending its own scrape timeout makes it: its
    outbox_up and how long it took."""
    started = time.monotonic()
    request = urllib.request.Request(url, headers={"X-Prometheus-Scrape-Timeout-Seconds": scrape_timeout})
    with urllib.request.urlopen(request, timeout=30) as response:
        scraped = families(response.read().decode())
    return [s.value for s in scraped["outbox_up"].samples], time.monotonic() - started


def queries_logged(pg, since):
    """How many times the server log shows outbox_metrics_prometheus()
    asked for after offset `since` (log_statement = all for the role)."""
    return pg.log.read_bytes()[since:].count(b"outbox_metrics_prometheus()")


def test_clients_that_give_up_early_share_one_query_and_leave_the_connection_open(monitor):
    """Six clients scrape at once, each saying its scrape times out in
    0.6 s, while the database is slow to answer (outbox.events locked for
    2.5 s): each waits at least a second (the exporter's floor, not the
    0.1 s the header would leave), they share one query, and giving up
    closes nothing: the query ends when the lock is released, on the same
    connection, which the next scrape uses again."""
    monitor.sql("ALTER ROLE outbox_metrics SET log_statement = 'all'")
    proc, url = exporter(dsn(monitor), timeout=5)
    try:
        assert scrape_with(url, "10")[0] == [1]
        [[backend]] = monitor.sql("SELECT pid FROM pg_stat_activity "
                                  "WHERE application_name = 'outbox_dispatch exporter'")
        since = monitor.log.stat().st_size
        results = []
        with monitor.connect(autocommit=False) as holder:
            holder.execute("LOCK TABLE outbox.log IN ACCESS EXCLUSIVE MODE")
            locked = time.monotonic()
            clients = [threading.Thread(target=lambda: results.append(scrape_with(url, "0.6"))) for _ in range(6)]
            for t in clients:
                t.start()
            for t in clients:
                t.join(timeout=30)
            time.sleep(max(0.0, locked + 2.5 - time.monotonic()))
            holder.rollback()
        assert [up for up, _ in results] == [[0]] * 6, results
        assert all(0.9 <= took < 2.5 for _, took in results), results
        assert queries_logged(monitor, since) == 1, "one query for the six"
        time.sleep(0.5)
        assert scrape_with(url, "0.6")[0] == [1]
        assert queries_logged(monitor, since) == 2
        assert monitor.sql("SELECT pid FROM pg_stat_activity "
                           "WHERE application_name = 'outbox_dispatch exporter'") == [(backend,)], \
            "the connection was closed and opened again"
    finally:
        monitor.sql("ALTER ROLE outbox_metrics RESET log_statement")
        proc.terminate()
        proc.wait(timeout=30)


def test_slow_clients_hold_no_thread_for_long_and_too_many_are_turned_away(monitor):
    """Eight clients that open a connection and send a request a byte now
    and then (slowloris) fill the exporter's requests: a ninth is answered
    503 at once. Each is cut off 5 s after it connected, however steadily
    it trickles; then Prometheus's scrapes are served again."""
    proc, url = exporter(dsn(monitor), timeout=2)
    port = urllib.parse.urlparse(url).port
    slow = []
    try:
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Padding: " + b"a" * 200
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(request[:5])
            slow.append(s)
        time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as busy:
            fetch(url, timeout=5)
        assert busy.value.code == 503
        started, cut = time.monotonic(), [None] * len(slow)
        sent = 5
        while None in cut and time.monotonic() - started < 20:
            for i, s in enumerate(slow):
                if cut[i] is None:
                    try:
                        s.sendall(request[sent:sent + 1])
                        s.setblocking(False)
                        if s.recv(1) == b"":
                            cut[i] = time.monotonic() - started
                    except BlockingIOError:
                        pass
                    except OSError:
                        cut[i] = time.monotonic() - started
                    finally:
                        s.setblocking(True)
            sent += 1
            time.sleep(0.5)
        assert None not in cut and max(cut) < 7, cut
        assert [s.value for s in families(fetch(url))["outbox_up"].samples] == [1]
    finally:
        for s in slow:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


def test_the_alert_rules_pass_promtool():
    rules = CONTRIB / "prometheus"
    checked = subprocess.run(["promtool", "check", "rules", "outbox_alerts.yml"], cwd=rules,
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(["promtool", "test", "rules", "outbox_alerts_test.yml"], cwd=rules,
                            capture_output=True, text=True)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize("host, recorded", [("library", "outage.jsonl.gz"), ("sidecar", "outage-sidecar.jsonl.gz")])
def test_the_alerts_on_a_recorded_outage_fire_while_it_lasts_and_not_while_paused(tmp_path, host, recorded):
    """promtool on what each host's scrape target served through real
    faults (tests/alert_recording.py made the recordings: the exporter of
    the library's database, and the sidecar's /metrics): Redis stopped for
    six minutes, then the dispatchers paused, the database stopped, the
    scrape target (the exporter, the sidecar) stopped. On either host the
    same alerts fire: the broker's during the outage, silent after it and
    while paused; the database's and the exporter's while they are down;
    a healthy outbox fires none."""
    promtool_on(Recording.load(FIXTURES / recorded), tmp_path, {
        ("healthy", 1.75): {},
        ("broker down", 5): {"OutboxBrokerUnavailable": [firing("OutboxBrokerUnavailable", severity="warning",
                                                                **TARGET)],
                             "OutboxNoDispatcherConnected": [firing("OutboxNoDispatcherConnected",
                                                                    severity="critical", **TARGET)]},
        ("broker back", 1.75): {},
        ("paused", 3.75): {},
        ("database down", 2.75): {"OutboxDatabaseUnreachable": [firing("OutboxDatabaseUnreachable",
                                                                        severity="critical", **TARGET)]},
        ("exporter down", 1.75): {"OutboxExporterDown": [firing("OutboxExporterDown", "1", severity="critical")]},
    })


def test_the_alerts_on_a_recorded_rabbitmq_alarm_fire_while_it_blocks_publishing(tmp_path):
    """promtool on what the exporter served through RabbitMQ's memory
    alarm (tests/alert_recording.py --alarm), default settings: a minute's
    alarm, then one of eight. OutboxBrokerBlocked fires while the long one
    holds events back (a blocked push counted in
    outbox_broker_refusals_total{condition="blocked"}, the lag climbing),
    and is silent through the brief one and once the alarm is over. With
    the default settings each blocked push is refused and the dispatchers
    reconnect, so the broker's other alerts fire too; a dispatcher that
    waits the alarm out connected (contrib/prometheus/outbox_alerts_test.yml)
    leaves OutboxBrokerBlocked alone to say it."""
    recording = Recording.load(FIXTURES / "alarm.jsonl.gz")

    def lag(phase, minutes):
        """outbox_lag_seconds as the scrape at that time served it."""
        text = recording.scrapes[recording.phases[phase] + round(minutes * 60) // recording.interval]
        return families(text)["outbox_lag_seconds"].samples[0].value

    def humanized(seconds):  # Prometheus's humanizeDuration, for a minute to an hour
        return f"{int(seconds // 60)}m {int(seconds % 60)}s"

    expected = {
        ("healthy", 0.75): {},
        ("brief alarm over", 1.75): {},
        ("alarm", 5): {
            "OutboxBrokerBlocked": [firing("OutboxBrokerBlocked", severity="warning", **TARGET)],
            "OutboxBrokerUnavailable": [firing("OutboxBrokerUnavailable", severity="warning", **TARGET)],
            "OutboxNoDispatcherConnected": [firing("OutboxNoDispatcherConnected", severity="critical", **TARGET)]},
        ("alarm over", 2.75): {},
    }
    blocked = expected[("alarm", 5)]["OutboxBrokerBlocked"][0]["exp_annotations"]
    blocked["description"] = blocked["description"].replace("{{ $value | humanizeDuration }}",
                                                            humanized(lag("alarm", 5)))
    promtool_on(recording, tmp_path, expected)


def test_the_dashboard_and_the_rules_ask_only_for_exported_metrics(monitor):
    proc, url = exporter(dsn(monitor))
    try:
        exported = set()
        for family in text_string_to_metric_families(fetch(url)):
            exported |= {sample.name for sample in family.samples}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    dashboard = json.loads((CONTRIB / "grafana" / "outbox.json").read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    expressions.append(dashboard["templating"]["list"][1]["query"]["query"])
    rules = (CONTRIB / "prometheus" / "outbox_alerts.yml").read_text()
    expressions += re.findall(r"expr: (.*)", rules)
    asked = {name for e in expressions for name in re.findall(r"\b(outbox_[a-z_]+)", e)}
    assert asked, "no metric found in the dashboard"
    assert asked <= exported, sorted(asked - exported)
    panels = {p["title"] for p in dashboard["panels"]}
    assert [title for title in panels if "Redis" in title] == [], "either broker may be behind the panels"
    for topic in ("sent", "Lag", "latency", "status", "Dispatchers", "Broker"):
        assert any(topic.lower() in title.lower() for title in panels), topic


def test_the_dashboard_s_rates_take_grafana_s_rate_interval():
    """Every range the dashboard asks for is $__rate_interval: at least
    four scrape intervals of the data source, whatever its scrape
    interval is, where a fixed window shorter than two scrapes draws
    nothing; per-minute panels scale a rate."""
    dashboard = json.loads((CONTRIB / "grafana" / "outbox.json").read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    ranges = {r for e in expressions for r in re.findall(r"\[([^\]]*)\]", e)}
    assert ranges == {"$__rate_interval"}, ranges
    per_minute = [t["expr"] for p in dashboard["panels"] if "per minute" in p["title"] for t in p["targets"]]
    assert per_minute and all("(60 * rate(" in e for e in per_minute), per_minute
