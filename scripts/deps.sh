#!/usr/bin/env bash
# Installs what the build, the tests and the demo need, skipping whatever is
# already there: Debian packages, cargo-pgrx 0.18.0, pgrx's PostgreSQL 15
# registration, and the Python venv (.venv) with Celery and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
PGRX_VERSION=0.18.0

missing=()
for pkg in postgresql-15 postgresql-server-dev-15 postgresql-contrib redis-server libclang-dev clang openssl; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "deps: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ "$(cargo pgrx --version 2>/dev/null)" != "cargo-pgrx $PGRX_VERSION" ]]; then
    echo "deps: installing cargo-pgrx $PGRX_VERSION (several minutes, once)"
    cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
fi

if ! grep -qs "^pg15 *= *\"$PG_CONFIG\"" "${PGRX_HOME:-$HOME/.pgrx}/config.toml"; then
    cargo pgrx init --pg15="$PG_CONFIG"
fi

stamp=.venv/.requirements
if ! cmp -s tests/requirements.txt "$stamp"; then
    echo "deps: preparing the Python venv (.venv)"
    python3 -m venv .venv
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -r tests/requirements.txt
    cp tests/requirements.txt "$stamp"
fi
