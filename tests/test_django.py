"""outbox_dispatch.django in a real Django project (made by
`django-admin startproject` in the test's directory), on a server without
the library (the sidecar's install, as on a managed service), as the
database's owner, who is no superuser: `manage.py migrate` installs the
outbox (and updates one of 1.0.0), enqueue() on Django's connection joins
`transaction.atomic()` and is refused in autocommit, `manage.py
outbox_sidecar` delivers to a real Celery worker (its password through the
environment, never the command line), a task's failure makes a dead
letter, and the admin's retry action, clicked in headless Chromium, sends
it again; the admin's lists count no more than 10,001 rows."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import ROOT, VENV_BIN, CeleryWorker, Cluster, free_port, wait_until
from standalone import BIN, fresh_database, library_only, plain_server

QUEUE = "q_django"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
PASSWORD = "S3cret-never-in-argv"


@pytest.fixture(scope="module")
def scripts():
    """The scripts the package installs from, as this build's command
    prints them (make sidecar writes them too)."""
    subprocess.run([sys.executable, ROOT / "scripts" / "package_sql.py", BIN,
                    ROOT / "python" / "src" / "outbox_dispatch" / "standalone"], check=True)


@pytest.fixture(scope="module")
def server():
    with plain_server() as pg:
        yield pg


class Project:
    """`django-admin startproject shop` with outbox_dispatch.django
    installed, connected as `user` to database `dbname` of `pg`."""

    def __init__(self, pg, dbname, root, user="owner"):
        self.pg, self.dbname, self.root = pg, dbname, root
        root.mkdir()
        subprocess.run([VENV_BIN / "django-admin", "startproject", "shop", root], check=True)
        settings = root / "shop" / "settings.py"
        settings.write_text(settings.read_text() + f"""
INSTALLED_APPS += ["outbox_dispatch.django"]
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
DATABASES = {{"default": {{
    "ENGINE": "django.db.backends.postgresql", "NAME": {dbname!r}, "USER": {user!r},
    "PASSWORD": os.environ.get("SHOP_DB_PASSWORD", ""), "HOST": {str(pg.dir)!r}, "PORT": {pg.port},
    "OPTIONS": {{"sslmode": "disable"}},
}}}}
""")
        settings.write_text("import os\n" + settings.read_text())

    def env(self, **extra):
        # The command outbox_sidecar runs: this build's, on PATH.
        return dict(os.environ, DJANGO_SETTINGS_MODULE="shop.settings", SHOP_DB_PASSWORD=PASSWORD,
                    PYTHONPATH=str(self.root), PATH=f"{Path(BIN).parent}:{os.environ['PATH']}", **extra)

    def manage(self, *args, check=True, **extra):
        done = subprocess.run([sys.executable, self.root / "manage.py", *args], cwd=self.root,
                              env=self.env(**extra), capture_output=True, text=True, timeout=300)
        if check:
            assert done.returncode == 0, done.stdout + done.stderr
        return done

    def shell(self, code):
        """What `code`, run by `manage.py shell`, prints as JSON."""
        return json.loads(self.manage("shell", "-c", code).stdout.strip().splitlines()[-1])

    def popen(self, *args, **kwargs):
        return subprocess.Popen([sys.executable, self.root / "manage.py", *args], cwd=self.root, env=self.env(),
                                start_new_session=True, **kwargs)


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_migrate_updates_an_outbox_of_1_0_0_and_refuses_a_schema_open_to_others(server, scripts, tmp_path):
    """The operation runs the update script of the release installed; a
    second migrate does nothing. A schema where another role may create
    is refused before anything is installed, naming the role."""
    fresh_database(server, "shop_old")
    with server.connect(dbname="shop_old", user="owner") as conn:
        conn.execute((FIXTURES / "outbox-dispatch-1.0.0.sql").read_text())
    project = Project(server, "shop_old", tmp_path / "old")
    migrated = project.manage("migrate", "outbox_dispatch")
    assert "outbox_dispatch: updated outbox_dispatch 1.0.0 to 1.1.0" in migrated.stdout, migrated.stdout
    # The app's migrations say what its models are: none to make.
    assert "No changes detected" in project.manage("makemigrations", "--check", "--dry-run", "outbox_dispatch").stdout
    assert server.value("SELECT version FROM outbox.installed", dbname="shop_old") == "1.1.0"

    fresh_database(server, "shop_open")
    server.sql("GRANT CREATE ON SCHEMA public TO other", dbname="shop_open")
    refused = Project(server, "shop_open", tmp_path / "open").manage("migrate", "outbox_dispatch", check=False)
    assert refused.returncode != 0
    assert 'schema "public" is open to others: other may create in it' in refused.stderr, refused.stderr[-2000:]
    assert server.value("SELECT to_regnamespace('outbox') IS NULL", dbname="shop_open")


@library_only("CREATE EXTENSION needs the library installed into the server")
def test_migrate_creates_the_extension_where_the_library_is_loaded(scripts, redis_server, tmp_path):
    """A server that preloads the library: the operation creates the
    extension (no script), and a second migration of it finds it there."""
    pg = Cluster(redis_server.url)
    try:
        pg.sql("CREATE DATABASE shop_library")
        project = Project(pg, "shop_library", tmp_path / "library", user="postgres")
        migrated = project.manage("migrate", "outbox_dispatch")
        assert "outbox_dispatch: created the extension outbox_dispatch 1.1.0" in migrated.stdout, migrated.stdout
        assert pg.value("SELECT extversion FROM pg_extension WHERE extname = 'outbox_dispatch'",
                        dbname="shop_library") == "1.1.0"
        assert pg.value("SELECT to_regclass('outbox.installed') IS NULL", dbname="shop_library")
        project.manage("migrate", "outbox_dispatch", "zero", check=False)  # not reversed: refused
        assert pg.value("SELECT count(*) FROM pg_extension WHERE extname = 'outbox_dispatch'",
                        dbname="shop_library") == 1
    finally:
        pg.close()


def test_the_admin_pages_a_long_list_from_its_newest_rows_as_the_whole_list_would(server, scripts, tmp_path):
    """The events' list reads the newest rows of the log first, widening
    the window until it holds the page (outbox_dispatch.django.admin,
    windows made small here): each page, filtered or not, is the whole
    list's, and a page beyond the widest window is read from the whole
    list; the count is exact below its bound."""
    fresh_database(server, "long")
    project = Project(server, "long", tmp_path / "long")
    project.manage("migrate")
    with server.connect(dbname="long", user="owner") as conn:
        # Dead letters older than everything else, then events in line.
        conn.execute("INSERT INTO outbox.log (event_type, queue, status, last_error) "
                     "SELECT 'old', 'q', 'failed', 'dead' FROM generate_series(1, 30)")
        conn.execute("SELECT outbox_enqueue('new', '{}', queue => 'q') FROM generate_series(1, 500)")
    seen = project.shell("""
import json
from django.contrib import admin
from outbox_dispatch.django import admin as outbox_admin
from outbox_dispatch.django.models import Event
outbox_admin.WINDOWS = (10, 100)
listed = {}
for status in (None, "pending", "failed"):
    events = Event.objects.all() if status is None else Event.objects.filter(status=status)
    paginator = outbox_admin.EstimatedCountPaginator(events, 25)
    everything = [str(i) for i in events.values_list("id", flat=True)]
    listed[str(status)] = {"count": [paginator.count, len(everything)],
                           "pages": [[str(e.id) for e in paginator.page(n)] == everything[(n - 1) * 25:n * 25]
                                     for n in range(1, paginator.num_pages + 1)],
                           "held": outbox_admin.newest(events, 50)[1]}
print(json.dumps(listed))
""")
    assert seen["None"] == {"count": [530, 530], "pages": [True] * 22, "held": True}, seen
    assert seen["pending"] == {"count": [500, 500], "pages": [True] * 20, "held": True}, seen
    # Older than the widest window: read from the whole list.
    assert seen["failed"] == {"count": [30, 30], "pages": [True] * 2, "held": False}, seen


def test_a_django_project_installs_enqueues_delivers_and_retries_a_dead_letter_in_the_admin(
        server, scripts, redis_server, tmp_path):
    fresh_database(server, "shop")
    project = Project(server, "shop", tmp_path / "shop")
    migrated = project.manage("migrate")
    assert "outbox_dispatch: installed outbox_dispatch 1.1.0" in migrated.stdout, migrated.stdout
    assert "No migrations to apply" in project.manage("migrate").stdout
    assert server.value("SELECT version FROM outbox.installed", dbname="shop") == "1.1.0"

    # enqueue() with no connection: Django's default, in atomic() only.
    ids = project.shell(f"""
import json
from django.db import transaction
from outbox_dispatch import AutocommitError
from outbox_dispatch.django import enqueue
try:
    enqueue("loop.billing", queue={QUEUE!r})
    refused = False
except AutocommitError:
    refused = True
class RolledBack(Exception):
    pass
try:
    with transaction.atomic():
        dropped = enqueue("loop.billing", queue={QUEUE!r})
        raise RolledBack()
except RolledBack:
    pass
with transaction.atomic():
    failing = enqueue("loop.billing", kwargs={{"fail_first": "loop.billing"}}, queue={QUEUE!r})
    ok = enqueue("loop.ok", args=("django",), queue={QUEUE!r})
    delayed = enqueue("loop.ok", args=("never",), queue={QUEUE!r}, countdown=3600)
print(json.dumps({{"refused": refused, "dropped": str(dropped), "failing": str(failing), "ok": str(ok),
                  "delayed": str(delayed)}}))
""")
    assert ids["refused"] is True
    assert server.value("SELECT count(*) FROM outbox.events", dbname="shop") == 3

    client = redis_server.client()
    worker = CeleryWorker(redis_server.url, queues=(QUEUE,), app="loop_app")
    sidecar = project.popen("outbox_sidecar", "--", "--broker-url", redis_server.url, stderr=subprocess.PIPE,
                            text=True)
    try:
        worker.wait_ready()
        # The password reaches the command through its environment alone.
        wait_until(lambda: server.value("SELECT count(*) FROM pg_stat_activity WHERE datname = 'shop' AND "
                                        "application_name = 'outbox-dispatch'"), timeout=60,
                   message="the sidecar connected")
        # manage.py became the command (exec).
        command = Path(f"/proc/{sidecar.pid}")
        argv = (command / "cmdline").read_text().split("\0")
        assert argv[:2] == [str(BIN), "run"] and PASSWORD not in " ".join(argv), argv
        assert f"password='{PASSWORD}'" in (command / "environ").read_text(errors="replace")

        wait_until(lambda: server.value("SELECT status::text FROM outbox.events WHERE id = %s", (ids["ok"],),
                                        dbname="shop") == "processed", timeout=60, message="the ok task processed")
        wait_until(lambda: server.value("SELECT count(*) FROM outbox.dead_letters WHERE id = %s", (ids["failing"],),
                                        dbname="shop") == 1, timeout=60, message="the failed task dead-lettered")
        status = project.manage("outbox_status").stdout
        assert re.search(r"^  failed +1 ", status, re.M) and "outbox.workers" in status, status

        pages = project.shell("""
import json
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
user = User.objects.create_superuser("admin", "admin@example.com", "admin-password")
client = Client()
client.force_login(user)
seen = {}
for page in ("event", "deadletter", "blockedkey"):
    with CaptureQueriesContext(connection) as queries:
        answer = client.get(f"/admin/outbox_dispatch/{page}/", {"status__exact": "failed"} if page == "event" else {})
    seen[page] = [answer.status_code, [q["sql"] for q in queries
                                       if "COUNT(" in q["sql"].upper() and " LIMIT 10001) AS listed" not in q["sql"]]]
print(json.dumps(seen))
""")
        assert pages == {"event": [200, []], "deadletter": [200, []], "blockedkey": [200, []]}, pages
        # The discard action on the events' list: the delayed event is gone,
        # the one sent is left.
        said = project.shell(f"""
import json
from django.contrib.auth.models import User
from django.test import Client
client = Client()
client.force_login(User.objects.get(username="admin"))
answer = client.post("/admin/outbox_dispatch/event/", {{"action": "discard_events",
                     "_selected_action": [{ids['delayed']!r}, {ids['ok']!r}]}}, follow=True)
print(json.dumps([answer.status_code, answer.content.decode()]))
""")
        assert said[0] == 200 and "1 discarded; 1 neither pending nor failed, left as they are" in said[1], said
        assert server.value("SELECT count(*) FROM outbox.events WHERE id = %s", (ids["delayed"],), dbname="shop") == 0

        retried_in_browser(project, ids["failing"], tmp_path)
        wait_until(lambda: server.value("SELECT status::text FROM outbox.events WHERE id = %s", (ids["failing"],),
                                        dbname="shop") == "processed", timeout=60, message="the retried task processed")
        runs = [json.loads(r) for r in client.lrange(f"ran:{ids['failing']}", 0, -1)]
        assert [r["kwargs"] for r in runs] == [{"fail_first": "loop.billing"}] * 2, runs
        assert not client.exists(f"ran:{ids['dropped']}")

        again = project.manage("outbox_retry", ids["failing"]).stdout
        assert "0 sent again; 1 not failed, left as they are" in again, again
        assert "give the ids" in project.manage("outbox_retry", check=False).stderr
    finally:
        stop(sidecar)
        worker.close()


def retried_in_browser(project, event_id, tmp_path):
    """An operator's retry of the dead letter, in headless Chromium: log
    in, open the dead letters, tick the row, choose the action, Go."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    port = free_port()
    web = project.popen("runserver", "--noreload", f"127.0.0.1:{port}", stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    # As this machine runs Chromium (root, no network beyond loopback).
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1400,1000"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(base), timeout=60, message="the development server")
        browser.get(f"{base}/admin/login/?next=/admin/outbox_dispatch/deadletter/")
        browser.find_element(By.NAME, "username").send_keys("admin")
        browser.find_element(By.NAME, "password").send_keys("admin-password")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        wait_until(lambda: "dead letter" in browser.title.lower(), timeout=30, message="the dead letters' page")
        row = browser.find_element(By.CSS_SELECTOR, f"input[name=_selected_action][value='{event_id}']")
        row.click()
        Select(browser.find_element(By.NAME, "action")).select_by_value("retry_events")
        browser.find_element(By.NAME, "index").click()
        wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "ul.messagelist li"), timeout=30,
                   message="the action's message")
        message = browser.find_element(By.CSS_SELECTOR, "ul.messagelist li").text
        browser.save_screenshot(str(tmp_path / "retried.png"))
        assert message == "1 sent again", message
    finally:
        browser.quit()
        stop(web)


def _answers(base):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base}/admin/login/", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False
