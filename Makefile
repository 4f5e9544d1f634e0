# outbox_dispatch. `make demo` and `make test` install whatever is missing.
PG_CONFIG ?= /usr/lib/postgresql/15/bin/pg_config
PYTHON    := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: all deps build install install-dev test unit integration demo stop bench clean

all: build

deps:
	PG_CONFIG=$(PG_CONFIG) ./scripts/deps.sh

build: deps
	cargo build --release

# Builds and installs into the PostgreSQL that PG_CONFIG names (release build).
install: deps
	cargo pgrx install --release --pg-config $(PG_CONFIG)

# The same with the quicker dev profile, for the tests.
install-dev: deps
	cargo pgrx install --pg-config $(PG_CONFIG)

unit: deps
	cargo test -p outbox_core

integration: install-dev
	$(PYTHON) -m pytest -v tests $(PYTEST_ARGS)

test: unit integration

demo: install
	./scripts/demo.sh start

stop:
	./scripts/demo.sh stop

clean:
	cargo clean
	rm -rf .venv .run
