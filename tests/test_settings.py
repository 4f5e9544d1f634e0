"""The settings table (docs/reference/settings.md) says what the server
says: every outbox.* setting, its default and its context, and no other."""

import re
from pathlib import Path

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
