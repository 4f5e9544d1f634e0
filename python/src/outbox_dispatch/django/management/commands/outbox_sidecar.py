"""``manage.py outbox_sidecar [ARGS...]``: ``outbox-dispatch run`` for the
Django database (docs/guides/managed.md), where the server cannot load the
library: its DSN built from the database's settings and given through the
environment (``OUTBOX_DSN``), never on the command line, where any user of
the machine could read a password. The rest of the arguments go to
``outbox-dispatch run`` as they are (``--broker-url``, ``--dispatchers``...;
or the environment's ``OUTBOX_*``). The command is the distribution
outbox-dispatch-cli's (``pip install 'outbox-dispatch[cli]'``, Linux), or
the first ``outbox-dispatch`` on ``PATH``."""

from __future__ import annotations

import os
import shutil
from typing import Any, Dict, Mapping

from django.core.management.base import BaseCommand, CommandError
from django.db import connections


class Command(BaseCommand):
    help = "Runs outbox-dispatch run for the Django database (a server without the library)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--database", default="default", help="the database alias (default: default)")
        parser.add_argument("args", nargs="*", help="arguments of outbox-dispatch run (after --)")

    def handle(self, *args: str, **options: Any) -> None:
        connection = connections[options["database"]]
        if connection.vendor != "postgresql":
            raise CommandError(f"outbox_dispatch needs PostgreSQL, not {connection.vendor}")
        command = _command()
        env = dict(os.environ, OUTBOX_DSN=dsn(connection.settings_dict))
        os.execve(command, [command, "run", *args], env)


def _command() -> str:
    try:
        from outbox_dispatch_cli import find_bin

        return str(find_bin())
    except ImportError:
        found = shutil.which("outbox-dispatch")
        if found is None:
            raise CommandError("the outbox-dispatch command is not installed: pip install 'outbox-dispatch[cli]' "
                               "(Linux)") from None
        return found


def dsn(settings: Mapping[str, Any]) -> str:
    """A libpq connection string of Django's database settings (NAME,
    USER, PASSWORD, HOST, PORT, and the libpq keywords of OPTIONS, such as
    sslmode or service; not Django's own, such as pool), each value
    quoted; what is empty is left to libpq's defaults, as Django leaves
    it."""
    options = settings.get("OPTIONS") or {}
    keys: Dict[str, Any] = {
        "host": settings.get("HOST"),
        "port": settings.get("PORT"),
        "dbname": settings.get("NAME"),
        "user": settings.get("USER"),
        "password": settings.get("PASSWORD"),
        **{k: v for k, v in options.items() if k in _LIBPQ_OPTIONS},
    }
    return " ".join(f"{key}={_quote(value)}" for key, value in keys.items() if value not in (None, ""))


#: libpq's keywords (PostgreSQL 17's, which outbox-dispatch reads as libpq
#: does) but those Django's own settings give.
_LIBPQ_OPTIONS = (
    "hostaddr", "passfile", "channel_binding", "connect_timeout", "client_encoding", "options", "application_name",
    "fallback_application_name", "keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count",
    "tcp_user_timeout", "gssencmode", "sslmode", "sslnegotiation", "sslcompression", "sslcert", "sslkey",
    "sslpassword", "sslcertmode", "sslrootcert", "sslcrl", "sslcrldir", "sslsni", "requirepeer", "require_auth",
    "ssl_min_protocol_version", "ssl_max_protocol_version", "krbsrvname", "gsslib", "gssdelegation",
    "target_session_attrs", "load_balance_hosts", "service",
)


def _quote(value: Any) -> str:
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"
