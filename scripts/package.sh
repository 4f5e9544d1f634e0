#!/usr/bin/env bash
# `make package`: what a release ships, into dist/, for the PostgreSQL major
# that PG_CONFIG names and this machine's architecture:
#
# - postgresql-<major>-outbox-dispatch_<version>_<arch>.deb, which
#   `apt install ./file.deb` installs into Debian's or PGDG's PostgreSQL of
#   that major (packaging/debian/);
# - outbox_dispatch-<version>-pg<major>-<arch>.tar.gz, the same files with
#   install.sh, which copies them where the target server's pg_config says
#   and refuses a server of another major (any other Linux);
# - the Python package: its source distribution and a wheel for this
#   platform, which carries the outbox-dispatch command (sidecar/) beside the
#   package, both checked as an index would take them.
#
# Every artefact has the version of Cargo.toml; python/pyproject.toml and
# META.json must say the same. PACKAGE_PROFILE=dev packages the quicker
# debug builds (the tests use them); DEB_MAINTAINER names the Debian
# package's maintainer.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
major=$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
FEATURES=${FEATURES:---no-default-features --features pg$major}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
for file in python/pyproject.toml META.json; do
    if ! grep -Eq "^ *\"?version\"? *[=:] *\"$version\"" "$file"; then
        echo "package.sh: $file does not give version $version (Cargo.toml's)" >&2
        exit 1
    fi
done
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT

profile=(--profile release)
[[ "${PACKAGE_PROFILE:-release}" == dev ]] && profile=(--debug)
# shellcheck disable=SC2086 # FEATURES is a list of cargo flags
cargo pgrx package "${profile[@]}" --pg-config "$PG_CONFIG" $FEATURES --out-dir "$staging/build" >/dev/null
library=$(find "$staging/build" -name 'outbox_dispatch.so')
shopt -s globstar
scripts=("$staging"/build/**/extension/* sql/upgrade/*.sql)
mkdir -p dist

# The Debian package: Debian's layout of PostgreSQL <major>, whoever built
# the server it was compiled against.
name=postgresql-$major-outbox-dispatch
arch=$(dpkg --print-architecture)
deb="$staging/deb"
install -D -m 644 "$library" "$deb/usr/lib/postgresql/$major/lib/outbox_dispatch.so"
install -d "$deb/usr/share/postgresql/$major/extension" "$deb/usr/share/doc/$name" "$deb/DEBIAN"
install -m 644 "${scripts[@]}" "$deb/usr/share/postgresql/$major/extension/"
install -m 644 packaging/debian/copyright "$deb/usr/share/doc/$name/copyright"
gzip -9n < CHANGELOG.md > "$deb/usr/share/doc/$name/changelog.gz"
maintainer=${DEB_MAINTAINER:-The outbox_dispatch authors <outbox-dispatch@packages.invalid>}
sed -e "s/@major@/$major/g" -e "s/@version@/$version/g" -e "s/@arch@/$arch/g" -e "s|@maintainer@|$maintainer|" \
    -e "s/@size@/$(du -sk --exclude=DEBIAN "$deb" | cut -f1)/" \
    packaging/debian/control > "$deb/DEBIAN/control"
compress=(-Zxz)
[[ "${PACKAGE_PROFILE:-release}" == dev ]] && compress=(-Zgzip -z1)
rm -f dist/"$name"_*.deb
dpkg-deb --root-owner-group "${compress[@]}" --build "$deb" "dist/${name}_${version}_$arch.deb" >/dev/null
echo "dist/${name}_${version}_$arch.deb"

# The archive, for a server installed otherwise.
archive=outbox_dispatch-$version-pg$major-$(uname -m)
root="$staging/$archive"
install -D -m 755 "$library" "$root/lib/outbox_dispatch.so"
install -d "$root/extension"
install -m 644 "${scripts[@]}" "$root/extension/"
install -m 644 LICENSE CHANGELOG.md "$root/"
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
rm -f "$($PG_CONFIG --sharedir)"/extension/outbox_dispatch--*.sql
install -m 755 "$here"/lib/outbox_dispatch.so "$($PG_CONFIG --pkglibdir)/"
install -m 644 "$here"/extension/* "$($PG_CONFIG --sharedir)/extension/"
echo "outbox_dispatch installed; add it to shared_preload_libraries and restart the server."
INSTALL
chmod 755 "$root/install.sh"
tar -C "$staging" -czf "dist/$archive.tar.gz" "$archive"
echo "dist/$archive.tar.gz"

# The Python package: the source distribution (maturin's, with the Rust
# sources the command builds from) and this platform's wheel.
rm -f dist/outbox_dispatch-"$version".tar.gz dist/outbox_dispatch-"$version"-py3-none-*.whl
.venv/bin/python -m build --sdist --outdir dist python >/dev/null
wheel_profile=release
[[ "${PACKAGE_PROFILE:-release}" == dev ]] && wheel_profile=dev
(cd python && ../.venv/bin/maturin build --quiet --profile "$wheel_profile" --out ../dist >/dev/null)
.venv/bin/python -m twine check --strict dist/outbox_dispatch-"$version".tar.gz \
    dist/outbox_dispatch-"$version"-py3-none-*.whl >/dev/null
echo "dist/outbox_dispatch-$version.tar.gz"
ls dist/outbox_dispatch-"$version"-py3-none-*.whl
