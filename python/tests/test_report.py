"""The report format, as the dispatchers parse it (core/src/report.rs)."""

import json

from outbox_dispatch import report


def test_reports_are_compact_json_with_the_outcome():
    assert json.loads(report.processed("e1")) == {"id": "e1", "outcome": "processed"}
    assert json.loads(report.failed("e2", "ValueError: é")) == {"id": "e2", "outcome": "failed",
                                                                "error": "ValueError: é"}


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
