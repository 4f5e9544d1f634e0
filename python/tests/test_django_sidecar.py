"""manage.py outbox_sidecar's connection string, without a server: every
value quoted as libpq reads it, the libpq keys of OPTIONS kept, and what
the command cannot read refused."""

import pytest
from django.core.management.base import CommandError

from outbox_dispatch.django.management.commands.outbox_sidecar import dsn


def test_each_setting_is_a_quoted_libpq_value():
    settings = {"NAME": "shop", "USER": "app owner", "PASSWORD": "it's a \\secret", "HOST": "/run/pg", "PORT": 5433,
                "OPTIONS": {"sslmode": "verify-full", "pool": {"min_size": 2}, "server_side_binding": True}}
    assert dsn(settings) == ("host='/run/pg' port='5433' dbname='shop' user='app owner' "
                             "password='it\\'s a \\\\secret' sslmode='verify-full'")


def test_an_empty_host_is_localhost_and_empty_values_are_left_out():
    assert dsn({"NAME": "shop", "USER": "", "PASSWORD": "", "HOST": "", "PORT": ""}) == "host='localhost' dbname='shop'"


def test_a_service_file_is_refused():
    with pytest.raises(CommandError, match="service"):
        dsn({"NAME": "", "OPTIONS": {"service": "shop"}})
