#!/usr/bin/env python3
"""The outbox's scripts for a server without the library, as the
`outbox-dispatch` command prints them (`outbox-dispatch sql`), written into
the Python package, which is pure Python and carries no command:
outbox_dispatch.django's migration installs and updates the outbox from
them (python/src/outbox_dispatch/install.py reads them).

usage: package_sql.py COMMAND DIRECTORY

Writes into DIRECTORY:
- install.sql, `outbox-dispatch sql --no-transaction`;
- update-from-<release>.sql, `outbox-dispatch sql --no-transaction
  --update-from <release>`, for each release the command updates (asked
  of it: each release of the extension's update chain, sql/upgrade/);
- others.sql, sql/standalone/others.sql, the install's check of who else
  may create in the functions' schema.

Each script is for the functions' schema named SCHEMA_PLACEHOLDER, which
the command quotes wherever the schema goes: the reader puts the quoted
name of the schema it installs into in place of the quoted placeholder,
as the command would have."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PLACEHOLDER = "@extschema@"


def printed(command, *args):
    return subprocess.run([command, "sql", "--no-transaction", "--schema", SCHEMA_PLACEHOLDER, *args],
                          capture_output=True, text=True, timeout=60)


def main(command, directory):
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    install = printed(command)
    if install.returncode != 0:
        sys.exit(f"package_sql.py: {command} sql: {install.stderr.strip()}")
    scripts = {"install.sql": install.stdout,
               "others.sql": (ROOT / "sql" / "standalone" / "others.sql").read_text()}
    releases = sorted({m.group(1) for p in (ROOT / "sql" / "upgrade").glob("outbox_dispatch--*--*.sql")
                       if (m := re.match(r"outbox_dispatch--(.+)--.+\.sql$", p.name))})
    for release in releases:
        update = printed(command, "--update-from", release)
        if update.returncode == 0:
            scripts[f"update-from-{release}.sql"] = update.stdout
    if len(scripts) == 2:
        sys.exit(f"package_sql.py: {command} updates none of {', '.join(releases)}")
    # Each file replaced whole (a build reading the directory meanwhile
    # finds the old or the new), then those of no release any more removed.
    for name, text in scripts.items():
        with tempfile.NamedTemporaryFile("w", dir=out, suffix=".tmp", delete=False) as written:
            written.write(text)
        os.chmod(written.name, 0o644)
        os.replace(written.name, out / name)
    for stale in out.glob("*.sql"):
        if stale.name not in scripts:
            stale.unlink()

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    main(*sys.argv[1:])
