#!/usr/bin/env bash
# The build toolchain of the extension, which `make install`, `make build`
# and `make package` need and never install (scripts/deps.sh installs it,
# with the tests' machinery, for `make test` and `make demo`):
#
#   scripts/toolchain.sh check [install]
#                                   says what is missing, for the PostgreSQL
#                                   that PG_CONFIG names, and fails if anything
#                                   is (with install: the right to write its
#                                   library and extension directories too)
#   scripts/toolchain.sh packages   the Debian packages that bring what Debian
#                                   has of it, for PostgreSQL PG (15: Debian 12's
#                                   own server too)
#
# Rust (cargo and rustc no older than Cargo.toml's rust-version: rustup, as
# Debian 12's 1.63 is too old) and cargo-pgrx of pgrx's version are not
# Debian packages.
set -euo pipefail
cd "$(dirname "$0")/.."

RUST_VERSION=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
PGRX_VERSION=$(sed -n 's/^pgrx = "=\(.*\)"/\1/p' Cargo.toml)

packages() {
    local pg=$1
    echo make gcc libclang-dev
    [[ "$pg" == 15 ]] && echo postgresql-15 postgresql-server-dev-15
    return 0
}

# Whether version $1 is $2 or newer.
at_least() {
    [[ "$(printf '%s\n' "$1" "$2" | sort -V | head -1)" == "$2" ]]
}

# $1: "install" checks too that the server's directories may be written.
check() {
    local target=${1:-build} pg_config=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config} missing=()
    if ! command -v cargo >/dev/null || ! command -v rustc >/dev/null; then
        missing+=("Rust $RUST_VERSION or newer (cargo and rustc; rustup installs them: https://rustup.rs)")
    else
        local rustc
        rustc=$(rustc --version | sed -E 's/^rustc ([0-9]+\.[0-9]+(\.[0-9]+)?).*/\1/')
        at_least "$rustc" "$RUST_VERSION" ||
            missing+=("Rust $RUST_VERSION or newer (Cargo.toml's rust-version): rustc is $rustc (rustup update)")
        [[ "$(cargo pgrx --version 2>/dev/null)" == "cargo-pgrx $PGRX_VERSION" ]] ||
            missing+=("cargo-pgrx $PGRX_VERSION, pgrx's version (cargo install cargo-pgrx --version $PGRX_VERSION --locked)")
    fi
    command -v cc >/dev/null || missing+=("a C compiler, cc (Debian: gcc)")
    command -v make >/dev/null || missing+=("make (Debian: make)")
    # bindgen loads libclang at run time, by the names clang-sys looks for.
    if [[ -z "${LIBCLANG_PATH:-}" ]] && ! "$(command -v ldconfig || echo /sbin/ldconfig)" -p 2>/dev/null | grep -Eq '\slibclang(-[0-9.]+)?\.so(\.[0-9.]+)? ' &&
        [[ -z "$(compgen -G '/usr/lib/llvm-*/lib/libclang.so*')" ]]; then
        missing+=("libclang, which bindgen reads PostgreSQL's headers with (Debian: libclang-dev; or set LIBCLANG_PATH)")
    fi
    if [[ ! -x "$pg_config" ]]; then
        missing+=("PostgreSQL's pg_config at $pg_config (Debian: postgresql-server-dev-<major>; or set PG_CONFIG)")
    else
        local major includes
        major=$("$pg_config" --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
        includes=$("$pg_config" --includedir-server)
        case "$major" in
            15|16|18) ;;
            17) echo "toolchain: PostgreSQL 17 builds (pgrx's pg17 feature) but is not tested here" \
                     "(docs/getting-started/postgresql-versions.md)" >&2 ;;
            *) missing+=("a PostgreSQL that outbox_dispatch supports (15, 16 or 18): $pg_config is PostgreSQL $major") ;;
        esac
        [[ -f "$includes/postgres.h" ]] ||
            missing+=("PostgreSQL $major's server headers in $includes (Debian: postgresql-server-dev-$major)")
        if [[ "$target" == install ]]; then
            local dir
            for dir in "$("$pg_config" --pkglibdir)" "$("$pg_config" --sharedir)/extension"; do
                [[ -w "$dir" ]] || missing+=("the right to write $dir, where make install puts the extension's files" \
                    "(run it as a user who may, or as root)")
            done
        fi
    fi
    if ((${#missing[@]})); then
        echo "The build needs what is missing here (nothing is installed for you; see docs/getting-started/install.md):" >&2
        printf '  - %s\n' "${missing[@]}" >&2
        return 1
    fi
}

case "${1:-}" in
    check) check "${2:-build}" ;;
    packages) packages "${PG:-15}" ;;
    *) echo "usage: $0 check|packages" >&2; exit 2 ;;
esac
