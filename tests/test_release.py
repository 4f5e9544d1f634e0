"""One version, said the same everywhere a release states it, and one
update chain that reaches it: the crates, the control file's default (the
crate's, through pgrx), the Python package and the command's, PGXN's META.json and the
CHANGELOG; the update scripts from 0.8.0, whose install script the tests
keep, to the current version."""

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
BASELINE = "0.8.0"


def test_every_artefact_states_the_crates_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    assert tomllib.loads((ROOT / "sidecar" / "Cargo.toml").read_text())["package"]["version"] == VERSION
    python = tomllib.loads((ROOT / "python" / "pyproject.toml").read_text())["project"]
    assert python["version"] == VERSION
    # The command's distribution, and the extra that brings the same release of it.
    assert tomllib.loads((ROOT / "python" / "cli" / "pyproject.toml").read_text())["project"]["version"] == VERSION
    assert python["optional-dependencies"]["cli"] == [f"outbox-dispatch-cli=={VERSION}"]
    assert (ROOT / "python" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    init = (ROOT / "python" / "src" / "outbox_dispatch" / "__init__.py").read_text()
    assert re.search(r'^__version__ = "([^"]+)"$', init, re.M).group(1) == VERSION
    assert "default_version = '@CARGO_VERSION@'" in (ROOT / "outbox_dispatch.control").read_text()
    meta = json.loads((ROOT / "META.json").read_text())
    assert meta["version"] == VERSION
    assert meta["provides"]["outbox_dispatch"]["version"] == VERSION


def test_meta_json_has_what_pgxn_requires():
    meta = json.loads((ROOT / "META.json").read_text())
    for key in ("name", "abstract", "version", "maintainer", "license", "provides", "meta-spec"):
        assert meta.get(key), key
    assert meta["meta-spec"]["version"] == "1.0.0"
    for extension in meta["provides"].values():
        assert (ROOT / extension["file"]).is_file() and (ROOT / extension["docfile"]).is_file()


def test_the_changelog_leads_with_this_release():
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert releases[0] == ("Unreleased", "")
    assert releases[1][0] == VERSION and releases[1][1], releases
    sections = set(re.findall(r"^### (\w+)$", text, re.M))
    assert sections <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, sections


def test_one_update_chain_leads_from_the_baseline_to_this_version():
    steps = {}
    for script in (ROOT / "sql" / "upgrade").glob("outbox_dispatch--*--*.sql"):
        start, end = re.fullmatch(r"outbox_dispatch--(.+)--(.+)\.sql", script.name).groups()
        assert start not in steps, f"two updates from {start}"
        steps[start] = end
    version, walked = BASELINE, [BASELINE]
    while version in steps:
        version = steps.pop(version)
        walked.append(version)
    assert version == VERSION and not steps, (walked, steps)
    assert (ROOT / "tests" / "fixtures" / f"outbox_dispatch--{BASELINE}.sql").is_file()
    # No install script of an earlier version ships: the chain installs them.
    shipped = [p.name for p in ROOT.glob("sql/**/outbox_dispatch--*.sql")]
    assert all(re.fullmatch(r"outbox_dispatch--[\d.]+--[\d.]+\.sql", name) for name in shipped), shipped


def test_every_alert_links_to_a_runbook_row_that_exists():
    rules = (ROOT / "contrib" / "prometheus" / "outbox_alerts.yml").read_text()
    links = set(re.findall(r'runbook_url: "([^"#]+)#([^"]+)"', rules))
    assert len(links) > 5
    for page, anchor in links:
        text = (ROOT / page).read_text()
        assert f'id="{anchor}"' in text, f"{page}#{anchor}"
