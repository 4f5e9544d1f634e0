"""Recorded scrapes for the alert rules' tests: each host's scrape target
(the exporter of the library's databases, the sidecar's own /metrics)
scraped through real faults, and the series Prometheus would have stored
from it.

`record()` starts a cluster of the suite's mode (OUTBOX_HOST: the library
and the exporter, or the sidecar) and Redis with the harness, enqueues an
event every few seconds, and makes the faults of `PHASES` one after
another (Redis stopped, the dispatchers paused, the database stopped, the
scrape target stopped: the exporter, or the sidecar), scraping `/metrics`
every `INTERVAL` seconds as Prometheus would. It writes what each scrape
got (None when it failed) and when each phase began, as gzipped JSON
lines.
`record_alarm()` does the same with RabbitMQ as the broker and the faults
of `ALARM_PHASES`: a memory alarm of a minute, then one of eight, with the
default settings (recorded so: each blocked push was refused at once and
the dispatchers reconnected, counting `condition="blocked"` each time; a
dispatcher that waits an alarm out connected counts each pause once, which
contrib/prometheus/outbox_alerts_test.yml models). Run them again when the
metrics change:

    PG_BIN=/usr/lib/postgresql/15/bin .venv/bin/python tests/alert_recording.py tests/fixtures/outage.jsonl.gz
    OUTBOX_HOST=sidecar PG_BIN=/usr/lib/postgresql/15/bin .venv/bin/python tests/alert_recording.py \
        tests/fixtures/outage-sidecar.jsonl.gz
    PG_BIN=/usr/lib/postgresql/15/bin .venv/bin/python tests/alert_recording.py --alarm tests/fixtures/alarm.jsonl.gz

`promtool_input()` turns a recording into `promtool test rules` input
series: each sample labelled with the scrape's job and instance, `up`
for each scrape, and a staleness marker where a series stops, as
Prometheus stores a target's scrapes; `promtool_on()` runs the alert
rules on them.
"""

import contextlib
import gzip
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from prometheus_client.parser import text_string_to_metric_families

from harness import Cluster, RabbitMQ, Redis, exporter, wait_until
from standalone import HOST, SidecarCluster, new_cluster

#: Seconds between scrapes (Prometheus's default scrape_interval).
INTERVAL = 15

#: The labels Prometheus gives the samples of the exporter's target.
JOB, INSTANCE = "outbox", "exporter:9808"

#: Each phase of the recording and how many minutes it lasts; the phase's
#: fault starts as it begins.
PHASES = (
    ("healthy", 2),
    ("broker down", 6),
    ("broker back", 2),
    ("paused", 4),
    ("resumed", 1),
    ("database down", 3),
    ("database back", 1),
    ("exporter down", 2),
)

#: The phases of the RabbitMQ recordings (record_alarm).
ALARM_PHASES = (
    ("healthy", 1),
    ("brief alarm", 1),
    ("brief alarm over", 2),
    ("alarm", 8),
    ("alarm over", 3),
)


@dataclass
class Recording:
    """Scrapes `INTERVAL` seconds apart (the text, or None for a failed
    one), and the index of the first scrape of each phase."""

    interval: int
    scrapes: List[Optional[str]]
    phases: Dict[str, int]

    @classmethod
    def load(cls, path: Path) -> "Recording":
        with gzip.open(path, "rt") as f:
            lines = [json.loads(line) for line in f]
        head, rows = lines[0], lines[1:]
        phases = {r["phase"]: r["scrape"] for r in rows if "phase" in r}
        return cls(head["interval"], [r["text"] for r in rows if "text" in r], phases)


def series_name(name: str, labels: Dict[str, str]) -> str:
    """A series in PromQL's notation, as promtool reads it."""
    escaped = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(escaped.items())) + "}"


def promtool_input(recording: Recording) -> List[Dict[str, str]]:
    """promtool's `input_series` for the recording: one value per scrape,
    `_` before a series first appears, `stale` where it stops."""
    target = {"job": JOB, "instance": INSTANCE}
    values: Dict[str, List[Optional[float]]] = {}
    count = len(recording.scrapes)
    up = series_name("up", target)
    values[up] = [0.0 if text is None else 1.0 for text in recording.scrapes]
    for i, text in enumerate(recording.scrapes):
        for family in text_string_to_metric_families(text or ""):
            for sample in family.samples:
                key = series_name(sample.name, {**sample.labels, **target})
                values.setdefault(key, [None] * count)[i] = sample.value
    return [{"series": key, "values": " ".join(notation(v)) } for key, v in sorted(values.items())]


def notation(values: List[Optional[float]]) -> List[str]:
    """Each value as promtool writes it: a number, `_` (no sample), or
    `stale` (the first scrape a series is missing from)."""
    out = []
    for i, value in enumerate(values):
        if value is not None:
            out.append(repr(value))
        elif i > 0 and values[i - 1] is not None:
            out.append("stale")
        else:
            out.append("_")
    return out


# --- promtool -------------------------------------------------------------------

#: The alert rules.
RULES = Path(__file__).resolve().parent.parent / "contrib" / "prometheus" / "outbox_alerts.yml"

#: The labels of an alert on database postgres of the recorded target.
TARGET = {"database": "postgres", "job": JOB, "instance": INSTANCE}


def alert_annotations(rules):
    """Each alert's annotations, as the rule file writes them (the file is
    YAML; its annotations are one line each)."""
    alerts, current = {}, None
    for line in rules.splitlines():
        if m := re.match(r"\s*- alert: (\w+)", line):
            current = alerts.setdefault(m[1], {})
        elif current is not None and (m := re.match(r'\s+(summary|description|runbook_url): "(.*)"$', line)):
            current[m[1]] = m[2].replace('\\"', '"')
    return alerts


def firing(alert, value="", **labels):
    """An alert as promtool expects it firing: its labels, and its
    annotations as the rule file writes them, filled in."""
    database = labels.get("database", "")
    return {"exp_labels": labels, "exp_annotations": {
        k: v.replace("{{ $labels.database }}", database).replace("{{ $value | humanize }}", value)
        for k, v in alert_annotations(RULES.read_text())[alert].items()}}


def promtool_on(recording, tmp_path, expected):
    """promtool test rules on `recording`: at each time of `expected` (a
    phase and minutes into it), the alerts given fire, and every other
    alert of the rule file is silent."""
    alerts = alert_annotations(RULES.read_text())
    tests = []
    for (phase, minutes), fired in expected.items():
        when = f"{recording.phases[phase] * recording.interval + round(minutes * 60)}s"
        tests += [{"eval_time": when, "alertname": alert, "exp_alerts": fired.get(alert, [])} for alert in alerts]
    suite = {"rule_files": [str(RULES)], "evaluation_interval": f"{recording.interval}s",
             "tests": [{"interval": f"{recording.interval}s", "input_series": promtool_input(recording),
                        "alert_rule_test": tests}]}
    (tmp_path / "recorded_test.yml").write_text(json.dumps(suite))
    tested = subprocess.run(["promtool", "test", "rules", "recorded_test.yml"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout[-6000:] + tested.stderr[-6000:]


# --- Recording ----------------------------------------------------------------


def record(path: Path) -> None:
    """The outage of `PHASES` on the suite's mode's host (OUTBOX_HOST)."""
    redis_server = Redis()
    pg = new_cluster(redis_server.url)
    try:
        with (sidecar_observed(pg) if HOST == "sidecar" else observed(pg)) as (stop_target, url):
            faults = {
                "broker down": redis_server.stop,
                "broker back": redis_server.start,
                "paused": lambda: pg.configure(enabled="off"),
                "resumed": lambda: pg.configure(enabled="on"),
                "database down": pg.stop,
                "database back": pg.start,
                "exporter down": stop_target,
            }
            scrape_through(path, url, PHASES, faults)
    finally:
        pg.close()
        redis_server.close()


def record_alarm(path: Path, **settings: str) -> None:
    """RabbitMQ as the broker, its memory alarm raised twice, with the
    outbox.* `settings` given."""
    redis_server = Redis()
    rabbit = RabbitMQ()
    pg = Cluster(redis_server.url, broker_url=rabbit.url, **settings)
    try:
        with observed(pg) as (_, url):
            alarm = lambda: rabbit.ctl("set_vm_memory_high_watermark", "0.000001")  # noqa: E731
            over = lambda: rabbit.ctl("set_vm_memory_high_watermark", "0.4")  # noqa: E731
            faults = {"brief alarm": alarm, "brief alarm over": over, "alarm": alarm, "alarm over": over}
            scrape_through(path, url, ALARM_PHASES, faults)
    finally:
        pg.close()
        rabbit.close()
        redis_server.close()


@contextlib.contextmanager
def observed(pg: Cluster) -> Iterator[Tuple[Callable[[], None], str]]:
    """The extension and the exporter's role in `pg`, the exporter (what
    stops it, and its URL), and an event enqueued every few seconds
    meanwhile."""
    proc = None
    stop = threading.Event()
    try:
        pg.sql("CREATE EXTENSION outbox_dispatch")
        pg.sql("DO $$ BEGIN CREATE ROLE outbox_metrics LOGIN IN ROLE pg_monitor; "
               "EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        proc, url = exporter(f"host={pg.dir} port={pg.port} user=outbox_metrics dbname=postgres", timeout=5)
        threading.Thread(target=produce, args=(pg, stop), daemon=True).start()
        yield lambda: (proc.terminate(), proc.wait(timeout=30)), url
    finally:
        stop.set()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


@contextlib.contextmanager
def sidecar_observed(pg: SidecarCluster) -> Iterator[Tuple[Callable[[], None], str]]:
    """The outbox installed in `pg` (a SidecarCluster) and its sidecar
    running, what stops the sidecar, the URL of its /metrics, and an
    event enqueued every few seconds meanwhile."""
    stop = threading.Event()
    try:
        pg.install()
        url = f"http://127.0.0.1:{pg.metrics_port}/metrics"
        wait_until(lambda: fetch(url) is not None, timeout=30, message="the sidecar to answer")
        threading.Thread(target=produce, args=(pg, stop), daemon=True).start()
        yield lambda: pg.configure(workers=0), url
    finally:
        stop.set()


def scrape_through(path: Path, url: str, phases: Tuple[Tuple[str, int], ...], faults: Dict[str, Any]) -> None:
    """Scrapes `url` every `INTERVAL` seconds through `phases`, making
    each phase's fault as it begins; writes the recording to `path`."""
    with gzip.open(path, "wt") as out:
        out.write(json.dumps({"interval": INTERVAL, "phases": phases}) + "\n")
        started = time.monotonic()
        scrape = 0
        for phase, minutes in phases:
            if phase in faults:
                faults[phase]()
            out.write(json.dumps({"phase": phase, "scrape": scrape}) + "\n")
            print(f"{time.monotonic() - started:6.0f}s {phase}", file=sys.stderr)
            for _ in range(minutes * 60 // INTERVAL):
                time.sleep(max(0.0, started + scrape * INTERVAL - time.monotonic()))
                out.write(json.dumps({"scrape": scrape, "text": fetch(url)}) + "\n")
                out.flush()
                scrape += 1


def fetch(url: str) -> Optional[str]:
    """A scrape as Prometheus makes it (a 10 s scrape timeout): its text,
    or None when it failed."""
    request = urllib.request.Request(url, headers={"X-Prometheus-Scrape-Timeout-Seconds": "10"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.read().decode()
    except OSError:
        return None


def produce(pg: Cluster, stop: threading.Event) -> None:
    """An event every 5 seconds, while the database answers."""
    while not stop.wait(5):
        try:
            pg.sql("SELECT outbox_enqueue('recorded', '{}', queue => 'q_recorded')")
        except Exception:  # noqa: BLE001 - the database is down in one phase
            pass


if __name__ == "__main__":
    if sys.argv[1] == "--alarm":
        record_alarm(Path(sys.argv[2]))
    else:
        record(Path(sys.argv[1]))
