"""`make bench`, the Django admin at scale: the list of outbox.events, as
outbox_dispatch.django's admin serves it, over BENCH_ADMIN_EVENTS
[10000000] events delivered in batches of 100, half of the batches
reported processed, with 100 dead letters and 100 events in line (filled as
bench/table.py fills; a real Django project, `django-admin startproject`,
on the same cluster). Each page is requested twice through Django's test
client, logged in as a superuser; the figure is the second request's wall
time, whole (the count, the page's query, the template). Beside it, the
same page with the admin reading the whole list (WINDOWS empty), as it did
before it read the newest rows first, up to BENCH_ADMIN_WHOLE_UP_TO
[1000000] events: beyond, a page of the whole list sorts every row (minutes
at 10,000,000, linear in the list), and is not timed.

Writes bench/results/admin.md and bench/results/admin.json."""

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

os.environ.setdefault("BENCH_TABLE_EVENTS", os.environ.get("BENCH_ADMIN_EVENTS", "10000000"))

import table  # noqa: E402
from harness import Cluster, Redis  # noqa: E402
from test_django import Project  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# Each list: its name and its query string.
LISTS = [("every event", {}), ("processed", {"status__exact": "processed"}),
         ("dispatched", {"status__exact": "dispatched"}), ("pending", {"status__exact": "pending"}),
         ("failed", {"status__exact": "failed"})]
PAGES = (1, 2, 10)
WHOLE_UP_TO = int(os.environ.get("BENCH_ADMIN_WHOLE_UP_TO", 1_000_000))
TIMED = """
import json, time
from django.contrib.auth.models import User
from django.test import Client
from outbox_dispatch.django import admin as outbox_admin
user = User.objects.filter(username="bench").first() or User.objects.create_superuser("bench", "b@example.com", "x")
client = Client()
client.force_login(user)
lists, pages, modes = {lists}, {pages}, {modes}
timed = {{}}
for windows in modes:
    if windows == "whole list":
        outbox_admin.WINDOWS = ()
    for name, query in lists:
        for page in pages:
            times = []
            for _ in range(2):
                started = time.monotonic()
                answer = client.get("/admin/outbox_dispatch/event/", {{**query, "p": page}})
                times.append(time.monotonic() - started)
                # A page past the list's end: the admin redirects.
                assert answer.status_code in (200, 302), answer.status_code
            timed[f"{{windows}}|{{name}}|{{page}}"] = times[-1] if answer.status_code == 200 else None
print(json.dumps(timed))
"""


def main():
    events = int(os.environ["BENCH_TABLE_EVENTS"])
    redis = Redis("--save", "", "--appendonly", "no")
    pg = Cluster(redis.url, batch_size=100, report_key="", enabled="off",
                 server_conf={"shared_buffers": "'2GB'", "max_wal_size": "'16GB'"})
    try:
        pg.install()
        table.fill(pg, redis)
        with tempfile.TemporaryDirectory() as tmp:
            project = Project(pg, "postgres", Path(tmp) / "shop", user="postgres")
            project.manage("migrate")
            modes = ("newest first", "whole list") if events <= WHOLE_UP_TO else ("newest first",)
            timed = project.shell(TIMED.format(lists=LISTS, pages=PAGES, modes=modes))
        rows = pg.value("SELECT count(*) FROM outbox.log")
    finally:
        pg.close()
        redis.close()
    results = {"events": events, "rows": rows, "seconds": timed}
    (RESULTS / "admin.json").write_text(json.dumps(results, indent=1))
    lines = ["# The Django admin's list of events", "",
             f"{events:,} events delivered in batches of 100, half of the batches reported processed, with 100 dead "
             f"letters and 100 events in line ({rows:,} rows); `make bench` (bench/admin.py). Wall time of the "
             "second request of each page through Django's test client (the count, the page's query, the "
             "template), 50 rows a page; the admin reads the newest rows first, or, as before, the whole list "
             f"(timed up to {WHOLE_UP_TO:,} events).", "",
             "| list | page | newest first | whole list |", "|---|---|---|---|"]
    for name, _ in LISTS:
        for page in PAGES:
            newest, whole = timed[f"newest first|{name}|{page}"], timed.get(f"whole list|{name}|{page}")
            if newest is not None:
                lines.append(f"| {name} | {page} | {newest:.3f} s | "
                             f"{'not timed' if whole is None else f'{whole:.3f} s'} |")
    (RESULTS / "admin.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
