# outbox_dispatch. `make demo` and `make test` install whatever is missing.
PG_CONFIG ?= /usr/lib/postgresql/15/bin/pg_config
PYTHON    := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: all deps build install install-dev test unit integration demo stop bench package clean

all: build

deps:
	PG_CONFIG=$(PG_CONFIG) ./scripts/deps.sh

build: deps
	cargo build --release

EXTENSION_DIR = $(shell $(PG_CONFIG) --sharedir)/extension

# Builds and installs into the PostgreSQL that PG_CONFIG names (release build),
# with the install scripts of earlier versions and the upgrade scripts.
install: deps
	cargo pgrx install --release --pg-config $(PG_CONFIG)
	install -m 644 sql/releases/*.sql sql/upgrade/*.sql $(EXTENSION_DIR)/

# The same with the quicker dev profile, for the tests.
install-dev: deps
	cargo pgrx install --pg-config $(PG_CONFIG)
	install -m 644 sql/releases/*.sql sql/upgrade/*.sql $(EXTENSION_DIR)/

unit: deps
	cargo test -p outbox_core

integration: install-dev
	$(PYTHON) -m pytest -v tests $(PYTEST_ARGS)

test: unit integration

# An archive to install on a server without Rust (see the README).
package: deps
	PG_CONFIG=$(PG_CONFIG) ./scripts/package.sh

demo: install
	./scripts/demo.sh start

stop:
	./scripts/demo.sh stop

# Throughput, latency and enqueue cost against the raw ceilings (release
# build; about 10 minutes; sizes: BENCH_* variables, see bench/run.py).
bench: install
	.venv/bin/pip install -q -r bench/requirements.txt
	cargo build --release -p outbox_core --example push_ceiling
	$(PYTHON) bench/run.py

clean:
	cargo clean
	rm -rf .venv dist
