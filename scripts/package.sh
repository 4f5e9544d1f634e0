#!/usr/bin/env bash
# Builds an installable archive of the extension for the PostgreSQL major
# that PG_CONFIG names: dist/outbox_dispatch-<version>-pg<major>-<arch>.tar.gz,
# holding the shared library, the control file, every install and upgrade
# script, and install.sh, which copies them where the target server's
# pg_config says and refuses a server of another major; and the Python
# package's wheel for this platform, dist/outbox_dispatch-<version>-py3-none-<platform>.whl,
# which carries the outbox-dispatch command (sidecar/) beside the package.
# PACKAGE_PROFILE=dev packages the quicker debug builds (the tests use them).
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
major=$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
FEATURES=${FEATURES:---no-default-features --features pg$major}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
name="outbox_dispatch-$version-pg$major-$(uname -m)"
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT

profile=(--profile release)
[[ "${PACKAGE_PROFILE:-release}" == dev ]] && profile=(--debug)
# shellcheck disable=SC2086 # FEATURES is a list of cargo flags
cargo pgrx package "${profile[@]}" --pg-config "$PG_CONFIG" $FEATURES --out-dir "$staging/build" >/dev/null

root="$staging/$name"
mkdir -p "$root/lib" "$root/extension"
find "$staging/build" -name 'outbox_dispatch.so' -exec cp {} "$root/lib/" \;
find "$staging/build" -path '*/extension/*' -type f -exec cp {} "$root/extension/" \;
cp sql/upgrade/*.sql "$root/extension/"
cat > "$root/install.sh" <<INSTALL
#!/bin/sh
# Installs outbox_dispatch into the PostgreSQL $major that pg_config (or \$PG_CONFIG) names.
set -eu
built_for=$major
INSTALL
cat >> "$root/install.sh" <<'INSTALL'
PG_CONFIG=${PG_CONFIG:-pg_config}
here=$(dirname "$0")
server=$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
if [ "$server" != "$built_for" ]; then
    echo "install.sh: this build of outbox_dispatch is for PostgreSQL $built_for; $PG_CONFIG is PostgreSQL $server" >&2
    exit 1
fi
install -m 755 "$here"/lib/outbox_dispatch.so "$($PG_CONFIG --pkglibdir)/"
install -m 644 "$here"/extension/* "$($PG_CONFIG --sharedir)/extension/"
echo "outbox_dispatch installed; add it to shared_preload_libraries and restart the server."
INSTALL
chmod 755 "$root/install.sh"

mkdir -p dist
tar -C "$staging" -czf "dist/$name.tar.gz" "$name"
echo "dist/$name.tar.gz"

# The Python package (python/), with the outbox-dispatch command: a wheel for
# this platform, of the same version.
wheel_version=$(sed -n 's/^version = "\(.*\)"/\1/p' python/pyproject.toml)
if [[ "$wheel_version" != "$version" ]]; then
    echo "package.sh: python/pyproject.toml says $wheel_version, Cargo.toml $version" >&2
    exit 1
fi
wheel_profile=release
[[ "${PACKAGE_PROFILE:-release}" == dev ]] && wheel_profile=dev
rm -f dist/outbox_dispatch-"$version"-py3-none-*.whl
(cd python && ../.venv/bin/maturin build --quiet --profile "$wheel_profile" --out ../dist >/dev/null)
ls dist/outbox_dispatch-"$version"-py3-none-*.whl
