#!/usr/bin/env python3
"""The third-party notices of what a build links: every crate the named
package depends on for its build's output (normal dependencies, with the
features the build uses), with its version, its licence as it declares it,
and the text of the licence files it ships. `make package` puts the
library's beside the Debian package's copyright and the archive's library,
and the command's (outbox-dispatch) in the Python package's distributions.

usage: notices.py PACKAGE [--every-platform] [CARGO_ARGS...]   (e.g. --no-default-features --features pg15)

With --every-platform, the crates it links on any platform, not only this
one: the Python package's source distribution is built into wheels
elsewhere, and carries the one file for them all.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

LICENCE_FILES = ("LICENSE", "LICENCE", "COPYING", "NOTICE", "COPYRIGHT")


def host():
    return re.search(r"^host: (\S+)$", subprocess.run(["rustc", "-vV"], check=True, capture_output=True,
                                                     text=True).stdout, re.M).group(1)


def linked(package, cargo_args, every_platform):
    """The crates `package` links on this platform (or any), and the
    vendored ones among them: cargo's resolution of it alone."""
    platform = [] if every_platform else ["--filter-platform", host()]
    metadata = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--locked", *platform, *cargo_args],
        check=True, capture_output=True, text=True).stdout)
    packages = {p["id"]: p for p in metadata["packages"]}
    nodes = {n["id"]: n for n in metadata["resolve"]["nodes"]}
    [root] = [i for i, p in packages.items() if p["name"] == package and i in metadata["workspace_members"]]
    seen, stack = set(), [root]
    while stack:
        node = nodes[stack.pop()]
        for dep in node["deps"]:
            if any(kind["kind"] is None for kind in dep["dep_kinds"]) and dep["pkg"] not in seen:
                seen.add(dep["pkg"])
                stack.append(dep["pkg"])
    vendor = Path(metadata["workspace_root"]) / "vendor"
    vendored = {i for i, p in packages.items() if Path(p["manifest_path"]).is_relative_to(vendor)}
    ours = set(metadata["workspace_members"]) - vendored
    crates = sorted((packages[i] for i in seen - ours), key=lambda p: (p["name"], p["version"]))
    return crates, {packages[i]["name"] for i in vendored}


def notice(crate, vendored):
    folder = Path(crate["manifest_path"]).parent
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name.upper().startswith(LICENCE_FILES))
    lines = [f"{crate['name']} {crate['version']}: {crate.get('license') or 'see its licence files'}"]
    if vendored:
        lines.append("(vendored with a fix: vendor/kafka-protocol/PATCHED.md in the source)")
    authors = ", ".join(crate.get("authors") or []) or "its authors"
    if not files:
        lines.append(f"(the crate ships no licence file: {crate.get('license')}, copyright {authors})")
    for file in files:
        lines += ["", f"--- {file.name}", file.read_text(errors="replace").rstrip()]
    return "\n".join(lines)


def main():
    package, cargo_args = sys.argv[1], sys.argv[2:]
    every_platform = cargo_args[:1] == ["--every-platform"]
    crates, vendored = linked(package, cargo_args[1:] if every_platform else cargo_args, every_platform)
    print(f"Third-party software in {package}: {len(crates)} crates, each under its own licence.\n")
    print("\n\n========================================\n\n".join(notice(c, c["name"] in vendored) for c in crates))


if __name__ == "__main__":
    main()
