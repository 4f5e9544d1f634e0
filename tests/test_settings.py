"""The settings table (docs/reference/settings.md) says what the server
says: every outbox.* setting, its default and its context, and no other."""

import re
from pathlib import Path

from harness import Cluster, wait_until

SETTINGS = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "settings.md").read_text()
UNITS = {"B": 1, "kB": 1024, "MB": 1024 ** 2, "GB": 1024 ** 3,
         "ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


def documented():
    """{name: (default, context)} from the table of docs/reference/settings.md
    (the page up to its first section, if it has any)."""
    section = SETTINGS.split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`outbox."):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(" / ")]
        first = names[0]
        names = [first] + [first.rsplit("_", 1)[0] + n for n in names[1:]]  # `_max` after `..._min`
        context = cells[2].split(",")[0].strip()
        for name, default in zip(names, defaults):
            rows[name] = (default, context)
    return rows


def in_base_unit(text):
    match = re.fullmatch(r"(\d+)\s*([A-Za-z]+)?", text)
    if not match:
        return text
    number, unit = match.groups()
    return int(number) * UNITS[unit] if unit else int(number)


def test_the_readme_settings_table_matches_the_server(cluster):
    server = {name: (boot, unit, context) for name, boot, unit, context in cluster.sql(
        "SELECT name, boot_val, unit, context FROM pg_settings WHERE name LIKE 'outbox.%'")}
    readme = documented()
    assert sorted(readme) == sorted(server)
    for name, (boot, unit, context) in server.items():
        default, documented_context = readme[name]
        assert documented_context == context, name
        if unit:
            assert in_base_unit(default) == int(boot) * UNITS[unit], f"{name}: {default} vs {boot} {unit}"
        elif default == "(empty)":
            assert boot in ("", None), name
        else:
            assert default == boot, f"{name}: {default} vs {boot}"


def test_a_former_name_is_read_while_the_new_one_is_unset_and_warned_of_once(redis_server):
    """`outbox.redis_timeout`, `outbox.redis_password_file` and
    `outbox.redis_tls_ca_file` became `outbox.broker_*`: the former names
    still work, each dispatcher says once that they are deprecated (not at
    every reload), and the new name, once set, wins."""
    pg = Cluster(redis_server.url, redis_timeout="7s")
    try:
        pg.install()
        wait_until(lambda: "broker_timeout=7s" in pg.log_text(), message="the former name read")
        pg.configure(batch_size=50)
        wait_until(lambda: "batch_size=50" in pg.log_text(), message="the reload")
        pg.configure(broker_timeout="3s")
        wait_until(lambda: "broker_timeout=3s" in pg.log_text(), message="the new name read")
        # A dispatcher that found no extension yet (before install) was
        # the first process: one warning each, none at a reload.
        warned = re.findall(r"\[(\d+)\] WARNING:  outbox dispatcher 0: outbox.redis_timeout is deprecated.*"
                            r"set outbox.broker_timeout instead", pg.log_text())
        reloaded = re.findall(r"\[(\d+)\] LOG:  outbox dispatcher 0 reloaded its settings", pg.log_text())
        assert reloaded and len(warned) == len(set(warned)) and reloaded[-1] in warned, (warned, reloaded)
    finally:
        pg.close()
