#!/usr/bin/env bash
# `demo.sh start`: a PostgreSQL cluster (PG_BIN, 15 by default) with outbox_dispatch preloaded, a
# Redis and a Celery worker (with outbox_dispatch.celery), all under
# $DEMO_DIR; enqueues events from SQL and from Python and shows them
# processed, and a failed task with its exception in outbox.dead_letters.
# `demo.sh stop` stops all three.
set -euo pipefail
cd "$(dirname "$0")/.."

DEMO_DIR=${DEMO_DIR:-/tmp/outbox-demo}
PG_PORT=${DEMO_PG_PORT:-54329}
REDIS_PORT=${DEMO_REDIS_PORT:-63790}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
BROKER="redis://127.0.0.1:$REDIS_PORT/0"

as_postgres() { runuser -u postgres -- "$@"; }
psql_demo() { "$PG_BIN/psql" -h "$DEMO_DIR" -p "$PG_PORT" -U postgres -X -v ON_ERROR_STOP=1 "$@"; }

stop() {
    if [[ -f "$DEMO_DIR/celery.pid" ]]; then
        kill "$(cat "$DEMO_DIR/celery.pid")" 2>/dev/null || true
        rm -f "$DEMO_DIR/celery.pid"
    fi
    if [[ -f "$DEMO_DIR/data/postmaster.pid" ]]; then
        as_postgres "$PG_BIN/pg_ctl" -D "$DEMO_DIR/data" -m fast -w stop >/dev/null || true
    fi
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
}

start() {
    stop
    rm -rf "$DEMO_DIR"
    install -d -o postgres -g postgres -m 755 "$DEMO_DIR"

    echo "== Redis on port $REDIS_PORT"
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$DEMO_DIR" --daemonize yes --logfile "$DEMO_DIR/redis.log"

    echo "== PostgreSQL $("$PG_BIN/postgres" --version | cut -d" " -f3) on port $PG_PORT (socket in $DEMO_DIR), as the postgres user"
    as_postgres "$PG_BIN/initdb" -D "$DEMO_DIR/data" -U postgres --auth=trust -E UTF8 --locale=C >/dev/null
    cat >> "$DEMO_DIR/data/postgresql.conf" <<CONF
port = $PG_PORT
listen_addresses = ''
unix_socket_directories = '$DEMO_DIR'
shared_preload_libraries = 'outbox_dispatch'
outbox.broker_url = '$BROKER'
outbox.database = 'postgres'
CONF
    as_postgres "$PG_BIN/pg_ctl" -D "$DEMO_DIR/data" -l "$DEMO_DIR/postgresql.log" -w start >/dev/null

    echo "== Celery worker (log: $DEMO_DIR/celery.log)"
    OUTBOX_DEMO_BROKER="$BROKER" PYTHONPATH=scripts nohup .venv/bin/celery -A demo_tasks worker \
        --pool=solo --without-gossip --without-mingle --without-heartbeat --loglevel=INFO \
        >"$DEMO_DIR/celery.log" 2>&1 &
    echo $! >"$DEMO_DIR/celery.pid"

    echo "== Enqueue from SQL: three events committed, one rolled back"
    psql_demo <<'SQL'
CREATE EXTENSION outbox_dispatch;
BEGIN;
SELECT outbox_enqueue('accounts.send_welcome_email',
                      jsonb_build_object('user_id', n, 'email', 'user' || n || '@example.com')) AS event_id
  FROM generate_series(1, 3) AS n;
COMMIT;
BEGIN;
SELECT outbox_enqueue('accounts.send_welcome_email', '{"user_id": 99, "email": "never@example.com"}');
ROLLBACK;
SQL

    echo "== Enqueue from Python (outbox_dispatch.enqueue): a charge the task will refuse"
    .venv/bin/python - "$DEMO_DIR" "$PG_PORT" <<'PYTHON'
import sys

import psycopg

from outbox_dispatch import enqueue

with psycopg.connect(host=sys.argv[1], port=sys.argv[2], user="postgres", dbname="postgres") as conn:
    # In the application's own transaction; committed when the block ends.
    event = enqueue(conn, "billing.charge", args=(1, 4200), kwargs={"currency": "EUR"}, expires=3600)
print(f"enqueued {event}")
PYTHON

    echo "== Waiting for the Celery worker to run them and report back"
    settled() {
        psql_demo -At -c "SELECT count(*) FILTER (WHERE status = 'processed') = 3
                                 AND count(*) FILTER (WHERE status = 'failed') = 1 FROM outbox.events"
    }
    for _ in $(seq 1 120); do
        [[ $(settled) == t ]] && break
        sleep 0.5
    done
    grep "\[demo\]" "$DEMO_DIR/celery.log" || true
    [[ $(settled) == t ]] || { echo "demo: the outcomes did not come back; see $DEMO_DIR/celery.log" >&2; exit 1; }
    if grep -q "user 99" "$DEMO_DIR/celery.log"; then
        echo "demo: the rolled-back event was executed" >&2
        exit 1
    fi

    psql_demo -c "TABLE outbox.status" \
              -c "SELECT worker, pid, state, connected, events_dispatched FROM outbox.workers" \
              -c "SELECT task, payload, split_part(last_error, E'\n', 1) AS error FROM outbox.dead_letters"

    cat <<TEXT
The services keep running. Connect with:
    $PG_BIN/psql -h $DEMO_DIR -p $PG_PORT -U postgres
and try:
    SELECT outbox_enqueue('accounts.send_welcome_email', '{"user_id": 4, "email": "four@example.com"}');
    TABLE outbox.status;
    SELECT last_error FROM outbox.dead_letters;   -- the task's exception and traceback
    SELECT outbox_retry(id) FROM outbox.dead_letters;   -- and it fails again
Celery's log: $DEMO_DIR/celery.log.

Metrics for Prometheus (as a role IN ROLE pg_monitor in production):
    .venv/bin/python -m outbox_dispatch.exporter --listen :9808 \\
        --dsn "host=$DEMO_DIR port=$PG_PORT user=postgres dbname=postgres"
    curl -s localhost:9808/metrics | grep outbox_dispatched_total
Alert rules: contrib/prometheus/outbox_alerts.yml; Grafana dashboard to import:
contrib/grafana/outbox.json (docs/operations/alerts.md).

Stop everything with: make stop
TEXT
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
