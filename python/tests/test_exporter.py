"""The exporter's exposition, without a database: every sample labelled
with its database, each family's HELP and TYPE once, outbox_up for each
(tests/test_observability.py scrapes a real server with Prometheus)."""

from prometheus_client.parser import text_string_to_metric_families

import pytest

from outbox_dispatch.exporter import address, deadline, label, main, merge, names

TEXT = """# HELP outbox_dispatched_total Events pushed.
# TYPE outbox_dispatched_total counter
outbox_dispatched_total 7
# HELP outbox_events Events by status.
# TYPE outbox_events gauge
outbox_events{status="pending"} 2
outbox_events{status="failed"} 0
"""


def test_samples_carry_their_database_first():
    assert label("outbox_x 1", "app") == 'outbox_x{database="app"} 1'
    assert label('outbox_x{a="b"} 1', "app") == 'outbox_x{database="app",a="b"} 1'
    assert label("outbox_x{} 1", 'we"ird\\') == 'outbox_x{database="we\\"ird\\\\"} 1'


def test_databases_merge_into_one_exposition_with_up_for_each():
    text = merge([("app", TEXT, 0.01), ("billing", TEXT.replace(" 7", " 9"), 0.02), ("gone", None, 5.0)])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE outbox_events gauge") == 1
    dispatched = {s.labels["database"]: s.value for s in families["outbox_dispatched"].samples}
    assert dispatched == {"app": 7, "billing": 9}
    events = {(s.labels["database"], s.labels["status"]): s.value for s in families["outbox_events"].samples}
    assert events == {("app", "pending"): 2, ("app", "failed"): 0, ("billing", "pending"): 2,
                      ("billing", "failed"): 0}
    up = {s.labels["database"]: s.value for s in families["outbox_up"].samples}
    assert up == {"app": 1, "billing": 1, "gone": 0}
    took = {s.labels["database"]: s.value for s in families["outbox_scrape_duration_seconds"].samples}
    assert took["gone"] == 5.0


def test_listen_addresses():
    assert address(":9808") == ("", 9808)
    assert address("127.0.0.1:9100") == ("127.0.0.1", 9100)
    assert address("[::1]:9100") == ("::1", 9100)


def test_databases_of_the_same_name_are_told_apart_by_their_server():
    assert names(["host=a dbname=app", "host=b dbname=billing"]) == ["app", "billing"]
    assert names(["host=a dbname=app", "host=b port=5433 dbname=app", "dbname=other user=u"]) == [
        "app@a:5432", "app@b:5433", "other"]
    assert names(["postgresql://u@db1/app", "postgresql://u@db2/app"]) == ["app@db1:5432", "app@db2:5432"]
    assert names(["user=metrics"]) == ["metrics"], "libpq's default database is the user's name"
    with pytest.raises(ValueError, match="the same database is given more than once: app@a:5432"):
        names(["host=a dbname=app", "host=a port=5432 dbname=app user=other"])


def test_a_scrape_ends_before_prometheus_gives_up_on_it():
    assert deadline(5, None) == 5
    assert deadline(5, "10") == 5
    assert deadline(5, "3") == 2.5
    assert deadline(5, "0.6") == deadline(5, "0.2") == 1, "never less than a second, whatever a client sends"
    assert deadline(0.5, "0.6") == 0.5, "nor more than --timeout"
    assert deadline(5, "soon") == deadline(5, "0") == deadline(5, "nan") == 5


def test_a_dsn_libpq_cannot_read_is_named_not_shown(capsys):
    """libpq's message quotes the DSN: its password must not reach the
    terminal or the service's log."""
    with pytest.raises(SystemExit):
        main(["--dsn", "dbname=app", "--dsn", "postgresql://metrics:s3cr%zzet@db/app"])
    err = capsys.readouterr().err
    assert "--dsn number 2" in err and "s3cr" not in err and "zzet" not in err, err
