"""The ``outbox-dispatch`` command (outbox_dispatch without the library:
``install``, ``sql``, ``run``), which this distribution installs beside
Python's scripts; :func:`find_bin` finds it, wherever pip put it."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional

__all__ = ["CommandNotFound", "find_bin"]

NAME = "outbox-dispatch"


class CommandNotFound(FileNotFoundError):
    """The command is in none of the places pip installs scripts to."""


def find_bin() -> str:
    """The path of the ``outbox-dispatch`` command: in the scripts directory
    of this Python (a venv's ``bin``), of its base installation, of the user
    scheme (``pip install --user``), or beside the package when pip
    installed it with ``--prefix`` or ``--target``."""
    places = _places()
    for place in places:
        command = place / NAME
        if command.is_file() and os.access(command, os.X_OK):
            return str(command)
    raise CommandNotFound(
        f"{NAME} is not installed in any of: {', '.join(str(p) for p in places)} "
        "(pip install outbox-dispatch-cli, on Linux)"
    )


def _places() -> List[Path]:
    here = Path(__file__).resolve().parent
    found: List[Optional[str]] = [
        sysconfig.get_path("scripts"),
        sysconfig.get_path("scripts", vars={"base": sys.base_prefix}),
        sysconfig.get_path("scripts", scheme="posix_user"),
    ]
    places = [Path(p) for p in found if p]
    # --prefix P: P/lib/pythonX.Y/site-packages/outbox_dispatch_cli, the
    # command in P/bin; --target T: T/outbox_dispatch_cli, the command in T/bin.
    if here.parent.name == "site-packages" and len(here.parents) > 3:
        places.append(here.parents[3] / "bin")
    places.append(here.parent / "bin")
    return list(dict.fromkeys(places))
