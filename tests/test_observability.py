"""Observability that plugs in, tested with the real tools: the exporter
(`python -m outbox_dispatch.exporter`) scraped by Debian's Prometheus, as a
role with nothing but pg_monitor; a database that cannot answer shows as
outbox_up 0 without holding up the others; the alert rules pass `promtool
check rules` and their unit tests; the Grafana dashboard asks only for
metrics the project exports."""

import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
CONTRIB = ROOT / "contrib"


def fetch(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


@pytest.fixture
def monitor(outbox):
    outbox.sql("DO $$ BEGIN CREATE ROLE outbox_metrics LOGIN IN ROLE pg_monitor; "
               "EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    return outbox


def exporter(pg, *dsns, timeout=2):
    port = free_port()
    args = [sys.executable, "-m", "outbox_dispatch.exporter", "--listen", f"127.0.0.1:{port}",
            "--timeout", str(timeout)]
    for dsn in dsns:
        args += ["--dsn", dsn]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/metrics"

    def answers():
        try:
            return fetch(url, timeout=10)
        except OSError:
            return None

    wait_until(answers, timeout=30, message="the exporter to answer")
    return proc, url


def dsn(pg, dbname="postgres", port=None):
    return f"host={pg.dir} port={port or pg.port} user=outbox_metrics dbname={dbname}"


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_scrapes_the_exporter_as_a_pg_monitor_role(monitor, redis_server):
    proc, url = exporter(monitor, dsn(monitor))
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
        # The rules load and evaluate: a healthy outbox fires none.
        rules = json.loads(fetch(f"http://127.0.0.1:{port}/api/v1/rules"))["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} >= {"OutboxLagHigh", "OutboxReportsNotArriving"}
        assert json.loads(fetch(f"http://127.0.0.1:{port}/api/v1/alerts"))["data"]["alerts"] == []
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
    proc, url = exporter(monitor, dsn(monitor), dead, dsn(monitor, "plain"), timeout=2)
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


def test_the_alert_rules_pass_promtool():
    rules = CONTRIB / "prometheus"
    checked = subprocess.run(["promtool", "check", "rules", "outbox_alerts.yml"], cwd=rules,
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(["promtool", "test", "rules", "outbox_alerts_test.yml"], cwd=rules,
                            capture_output=True, text=True)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_the_dashboard_and_the_rules_ask_only_for_exported_metrics(monitor):
    proc, url = exporter(monitor, dsn(monitor))
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
