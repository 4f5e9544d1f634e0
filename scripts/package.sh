#!/usr/bin/env bash
# Builds an installable archive of the extension for PostgreSQL 15:
# dist/outbox_dispatch-<version>-pg15-<arch>.tar.gz, holding the shared
# library, the control file, every install and upgrade script, and
# install.sh, which copies them where the target server's pg_config says.
# PACKAGE_PROFILE=dev packages the quicker debug build (the tests use it).
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
name="outbox_dispatch-$version-pg15-$(uname -m)"
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT

profile=(--profile release)
[[ "${PACKAGE_PROFILE:-release}" == dev ]] && profile=(--debug)
cargo pgrx package "${profile[@]}" --pg-config "$PG_CONFIG" --out-dir "$staging/build" >/dev/null

root="$staging/$name"
mkdir -p "$root/lib" "$root/extension"
find "$staging/build" -name 'outbox_dispatch.so' -exec cp {} "$root/lib/" \;
find "$staging/build" -path '*/extension/*' -type f -exec cp {} "$root/extension/" \;
cp sql/releases/*.sql sql/upgrade/*.sql "$root/extension/"
cat > "$root/install.sh" <<'INSTALL'
#!/bin/sh
# Installs outbox_dispatch into the PostgreSQL 15 that pg_config (or $PG_CONFIG) names.
set -eu
PG_CONFIG=${PG_CONFIG:-pg_config}
here=$(dirname "$0")
install -m 755 "$here"/lib/outbox_dispatch.so "$($PG_CONFIG --pkglibdir)/"
install -m 644 "$here"/extension/* "$($PG_CONFIG --sharedir)/extension/"
echo "outbox_dispatch installed; add it to shared_preload_libraries and restart the server."
INSTALL
chmod 755 "$root/install.sh"

mkdir -p dist
tar -C "$staging" -czf "dist/$name.tar.gz" "$name"
echo "dist/$name.tar.gz"
