"""manage.py outbox_sidecar's connection string, without a server: every
value quoted as libpq reads it, the libpq keywords of OPTIONS kept and
Django's own left out."""

from outbox_dispatch.django.management.commands.outbox_sidecar import dsn


def test_each_setting_is_a_quoted_libpq_value():
    settings = {"NAME": "shop", "USER": "app owner", "PASSWORD": "it's a \\secret", "HOST": "/run/pg", "PORT": 5433,
                "OPTIONS": {"sslmode": "verify-full", "pool": {"min_size": 2}, "server_side_binding": True}}
    assert dsn(settings) == ("host='/run/pg' port='5433' dbname='shop' user='app owner' "
                             "password='it\\'s a \\\\secret' sslmode='verify-full'")


def test_empty_values_are_left_to_libpqs_defaults():
    assert dsn({"NAME": "shop", "USER": "", "PASSWORD": "", "HOST": "", "PORT": ""}) == "dbname='shop'"


def test_a_service_is_libpqs():
    assert dsn({"NAME": "", "OPTIONS": {"service": "shop", "isolation_level": 3}}) == "service='shop'"
