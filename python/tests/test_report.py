"""The report format, as the dispatchers parse it (core/src/report.rs)."""

import json

from outbox_dispatch import report


def test_reports_are_compact_json_with_the_outcome_and_the_send():
    assert json.loads(report.processed("e1", "s1")) == {"id": "e1", "send": "s1", "outcome": "processed"}
    assert json.loads(report.failed("e2", "s2", "ValueError: é")) == {"id": "e2", "send": "s2", "outcome": "failed",
                                                                      "error": "ValueError: é"}
    assert report.send_id({"outbox_send": "s3"}) == "s3"
    for headers in (None, {}, {"outbox_send": ""}, {"outbox_send": 7}):
        assert report.send_id(headers) is None


def test_a_report_fits_whatever_the_error():
    for error in ["x" * 100_000, "é" * 100_000, "\n" * 100_000, "\x01" * 100_000]:
        body = report.failed("e", "s", error)
        assert len(body) <= report.MAX_REPORT_BYTES, (error[:1], len(body))
        decoded = json.loads(body)
        assert decoded["error"].startswith(error[:10]) and decoded["error"].endswith("… (cut)")


def test_only_messages_that_ask_for_a_report_get_one():
    assert report.report_key({"outbox_report_to": "outbox_dispatch.reports"}) == "outbox_dispatch.reports"
    for headers in (None, {}, {"outbox_report_to": ""}, {"outbox_report_to": 7}, {"other": "x"}):
        assert report.report_key(headers) is None


def test_exceptions_are_described_by_type_message_and_traceback_end():
    class Refused(Exception):
        pass

    assert report.describe_exception(ValueError("no")) == "ValueError: no"
    assert report.describe_exception(KeyError()) == "KeyError"
    described = report.describe_exception(Refused("x"), "Traceback (most recent call last):\n  line 1\n")
    assert described == f"{Refused.__module__}.{Refused.__qualname__}: x\nTraceback (most recent call last):\n  line 1"


def test_long_tracebacks_keep_their_end():
    traceback = "Traceback (most recent call last):\n" + "".join(f"  frame {i}\n" for i in range(2000)) + "ValueError: end"
    described = report.describe_exception(ValueError("end"), traceback)
    assert described.startswith("ValueError: end\n… (trimmed)\n")
    assert described.endswith("ValueError: end")
    assert len(described) < report.MAX_TRACEBACK_CHARS + 100


def test_a_report_is_sent_whatever_the_text_holds():
    odd = "bad " + b"\xff".decode("utf-8", "surrogateescape")
    body = report.failed("e", "s", report.describe_exception(ValueError(odd)))
    assert json.loads(body)["error"].startswith("ValueError: bad ")


def test_a_duplicate_is_reported_processed_and_says_so():
    assert json.loads(report.processed("i", "s", duplicate=True)) == {
        "id": "i", "send": "s", "outcome": "processed", "duplicate": True}
    assert "duplicate" not in json.loads(report.processed("i", "s"))
