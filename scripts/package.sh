#!/usr/bin/env bash
# `make package`: what a release ships, for the PostgreSQL major that
# PG_CONFIG names and this machine's architecture, into DIST_DIR (dist/ by
# default):
#
# - postgresql-<major>-outbox-dispatch_<version>_<arch>.deb, which
#   `apt install ./file.deb` installs into Debian's or PGDG's PostgreSQL of
#   that major (packaging/debian/; built where dpkg-deb is);
# - outbox_dispatch-<version>-pg<major>-<arch>.tar.gz, the same files with
#   install.sh, which copies them where the target server's pg_config says
#   and refuses a server of another major (any other Linux);
# - the Python package outbox-dispatch, pure Python: its source
#   distribution and its wheel (py3-none-any);
# - the command outbox-dispatch (sidecar/) as the distribution
#   outbox-dispatch-cli: its manylinux wheels and its source distribution,
#   carrying the licence and the notices of the crates the command links;
#   all of them checked as an index would take them.
#
# Every artefact has the version of Cargo.toml, and the release's files
# must all say the same (tests/test_release.py states where). Each is
# written whole or not at all. PACKAGE_PROFILE=dev packages the quicker
# debug builds (the tests use them); DEB_MAINTAINER names the Debian
# package's maintainer ("Name <address>").
set -euo pipefail
shopt -s globstar nullglob
cd "$(dirname "$0")/.."

PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
DIST_DIR=${DIST_DIR:-dist}
major=$("$PG_CONFIG" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
# pgrx builds against it without a registration (`cargo pgrx init`).
export PGRX_PG_CONFIG_PATH=$PG_CONFIG
# Beside the build toolchain (scripts/toolchain.sh) and the venv's
# packaging/requirements.txt: binutils' objdump reads the C library's
# versions the library and the command need.
command -v objdump >/dev/null || {
    echo "package.sh: objdump is missing (Debian: binutils)" >&2
    exit 1
}
FEATURES=${FEATURES:---no-default-features --features pg$major}
.venv/bin/python -m pytest -q -p no:cacheprovider --noconftest tests/test_release.py >/dev/null || {
    echo "package.sh: the release's files do not agree (.venv/bin/python -m pytest tests/test_release.py)" >&2
    exit 1
}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
maintainer=${DEB_MAINTAINER:-The outbox_dispatch authors <outbox-dispatch@packages.invalid>}
if ! [[ "$maintainer" =~ ^[A-Za-z0-9\ ._\'-]+\ \<[A-Za-z0-9._+-]+@[A-Za-z0-9.-]+\>$ ]]; then
    echo "package.sh: DEB_MAINTAINER must be \"Name <address>\" (letters, digits, spaces and . _ ' - in the name)" >&2
    exit 1
fi
# In DIST_DIR, so that each artefact arrives by a rename: whole or not at all.
mkdir -p "$DIST_DIR"
staging=$(mktemp -d "$(realpath "$DIST_DIR")/.staging.XXXXXX")
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/out"

profile=(--profile release)
[[ "${PACKAGE_PROFILE:-release}" == dev ]] && profile=(--debug)
# shellcheck disable=SC2086 # FEATURES is a list of cargo flags
cargo pgrx package "${profile[@]}" --pg-config "$PG_CONFIG" $FEATURES --out-dir "$staging/build" >/dev/null
library=$(find "$staging/build" -name 'outbox_dispatch.so')
scripts=("$staging"/build/**/extension/* sql/upgrade/*.sql)
# shellcheck disable=SC2086
python3 scripts/notices.py outbox_dispatch $FEATURES > "$staging/THIRD-PARTY"

# The Debian package: Debian's layout of PostgreSQL <major>, whoever built
# the server it was compiled against; the C library's version the library
# needs, read from its symbols.
if command -v dpkg-deb >/dev/null; then
    name=postgresql-$major-outbox-dispatch
    arch=$(dpkg --print-architecture)
    glibc=$(objdump -T "$library" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
    deb="$staging/deb"
    doc="$deb/usr/share/doc/$name"
    install -D -m 644 "$library" "$deb/usr/lib/postgresql/$major/lib/outbox_dispatch.so"
    install -d "$deb/usr/share/postgresql/$major/extension" "$doc" "$deb/DEBIAN"
    install -m 644 "${scripts[@]}" "$deb/usr/share/postgresql/$major/extension/"
    sed "s/@name@/$name/g" packaging/debian/copyright > "$doc/copyright"
    gzip -9n < "$staging/THIRD-PARTY" > "$doc/THIRD-PARTY.gz"
    gzip -9n < CHANGELOG.md > "$doc/changelog.gz"
    sed -e "s/@major@/$major/g" -e "s/@version@/$version/g" -e "s/@arch@/$arch/g" -e "s/@glibc@/$glibc/g" \
        -e "s/@size@/$(du -sk --exclude=DEBIAN "$deb" | cut -f1)/" -e "s|@maintainer@|$maintainer|" \
        packaging/debian/control > "$deb/DEBIAN/control"
    compress=(-Zxz)
    [[ "${PACKAGE_PROFILE:-release}" == dev ]] && compress=(-Zgzip -z1)
    dpkg-deb --root-owner-group "${compress[@]}" --build "$deb" "$staging/out/${name}_${version}_$arch.deb" >/dev/null
fi

# The archive, for a server installed otherwise.
archive=outbox_dispatch-$version-pg$major-$(uname -m)
root="$staging/$archive"
install -D -m 755 "$library" "$root/lib/outbox_dispatch.so"
install -d "$root/extension"
install -m 644 "${scripts[@]}" "$root/extension/"
install -m 644 LICENSE CHANGELOG.md "$staging/THIRD-PARTY" "$root/"
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
libdir=$("$PG_CONFIG" --pkglibdir)
extdir=$("$PG_CONFIG" --sharedir)/extension
install -m 755 "$here"/lib/outbox_dispatch.so "$libdir/"
install -m 644 "$here"/extension/* "$extdir/"
# The scripts an earlier install left, which are not this release's.
for script in "$extdir"/outbox_dispatch--*.sql; do
    [ -e "$here/extension/$(basename "$script")" ] || rm -f "$script"
done
echo "outbox_dispatch installed; add it to shared_preload_libraries and restart the server."
INSTALL
chmod 755 "$root/install.sh"
tar -C "$staging" -czf "$staging/out/$archive.tar.gz" "$archive"

# The command's wheels (python/cli/, maturin): manylinux_2_17, linked by
# zig (the PyPI package ziglang) against that glibc whatever this machine's
# is, for x86_64, and for aarch64 where Rust's standard library for it is
# installed (`rustup target add aarch64-unknown-linux-gnu`); and its source
# distribution, with the Rust sources the command builds from and the SQL
# they include. Each with the licence and the notices of what the command
# links.
trap 'rm -rf "$staging" python/cli/THIRD-PARTY' EXIT
python3 scripts/notices.py outbox-dispatch --every-platform > python/cli/THIRD-PARTY
wheel_profile=release
[[ "${PACKAGE_PROFILE:-release}" == dev ]] && wheel_profile=dev
targets=(x86_64-unknown-linux-gnu)
if rustup target list --installed 2>/dev/null | grep -qx aarch64-unknown-linux-gnu; then
    targets+=(aarch64-unknown-linux-gnu)
else
    echo "package.sh: no aarch64 wheel of the command: Rust's standard library for aarch64-unknown-linux-gnu is not installed" >&2
fi
for target in "${targets[@]}"; do
    (cd python/cli && PATH="$PWD/../../.venv/bin:$PATH" ../../.venv/bin/maturin build --quiet --profile "$wheel_profile" \
        --zig --compatibility manylinux_2_17 --target "$target" --out "$staging/out" >/dev/null)
done
.venv/bin/python -m build --sdist --outdir "$staging/out" python/cli >/dev/null
cli=("$staging"/out/outbox_dispatch_cli-"$version"-py3-none-manylinux*.whl)
if ((${#cli[@]} != ${#targets[@]})); then
    echo "package.sh: expected a wheel of the command per target (${targets[*]}), built ${cli[*]##*/}" >&2
    exit 1
fi
# The command a wheel carries, at $staging/cli/outbox-dispatch.
command_of() {
    .venv/bin/python -c 'import sys, zipfile; open(sys.argv[3], "wb").write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
        "$1" "outbox_dispatch_cli-$version.data/scripts/outbox-dispatch" "$staging/cli/outbox-dispatch"
    chmod 755 "$staging/cli/outbox-dispatch"
}
mkdir -p "$staging/cli"
# No symbol of a C library newer than manylinux_2_17's (maturin checks it
# too), in each wheel's command.
for wheel in "${cli[@]}"; do
    command_of "$wheel"
    glibc=$(objdump -T "$staging/cli/outbox-dispatch" \
        | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
    if [[ "$(printf '%s\n' "$glibc" 2.17 | sort -V | tail -1)" != 2.17 ]]; then
        echo "package.sh: ${wheel##*/}'s command needs glibc $glibc, newer than manylinux_2_17's" >&2
        exit 1
    fi
done

# The Python package, pure Python: its source distribution and the wheel
# built from it (hatchling), with the outbox's scripts as this build's
# command prints them (scripts/package_sql.py; the x86_64 wheel's command
# runs here).
command_of "$(printf '%s\n' "${cli[@]}" | grep x86_64)"
python3 scripts/package_sql.py "$staging/cli/outbox-dispatch" python/src/outbox_dispatch/standalone
.venv/bin/python -m build --outdir "$staging/out" python >/dev/null
python_package=("$staging"/out/outbox_dispatch-"$version".tar.gz "$staging"/out/outbox_dispatch-"$version"-py3-none-any.whl
    "$staging"/out/outbox_dispatch_cli-"$version".tar.gz "${cli[@]}")
for built in "${python_package[@]}"; do
    [[ -f "$built" ]] || { echo "package.sh: ${built##*/} was not built" >&2; exit 1; }
done
.venv/bin/python -m twine check --strict "${python_package[@]}" >/dev/null
# A build leaves out a file it does not find, without a word: the licences,
# and the pure package's scripts.
.venv/bin/python - "$version" "${python_package[@]}" <<'CARRIED'
import sys, tarfile, zipfile
version, *built = sys.argv[1:]
def names(path):
    return set(tarfile.open(path).getnames() if path.endswith(".tar.gz") else zipfile.ZipFile(path).namelist())
for path in built:
    dist = "outbox_dispatch_cli" if "/outbox_dispatch_cli-" in path else "outbox_dispatch"
    licences = ("LICENSE", "THIRD-PARTY") if dist == "outbox_dispatch_cli" else ("LICENSE",)
    top = f"{dist}-{version}"
    wanted = {f"{top}/{n}" for n in licences} if path.endswith(".tar.gz") else \
        {f"{top}.dist-info/licenses/{n}" for n in licences}
    if dist == "outbox_dispatch":
        scripts = ("install.sql", "others.sql")
        prefix = f"{top}/src/" if path.endswith(".tar.gz") else ""
        wanted |= {f"{prefix}outbox_dispatch/standalone/{n}" for n in scripts}
    if not wanted <= names(path):
        sys.exit(f"package.sh: {path.rsplit('/', 1)[-1]} lacks {sorted(wanted - names(path))}")
CARRIED

# All built: into DIST_DIR, each in place of its namesake.
for built in "$staging"/out/*; do
    mv -f "$built" "$DIST_DIR/"
    echo "$DIST_DIR/$(basename "$built")"
done
