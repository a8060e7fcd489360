#!/usr/bin/env bash
# `make cluster`: PostgreSQL, two pagewire replicas and HAProxy on this machine, loopback only,
# from Debian's packages (postgresql, haproxy; `make sysdeps` installs them). No containers.
#   examples/scale-out/cluster.sh start    bring it up (idempotent), print the addresses
#   examples/scale-out/cluster.sh stop     stop the proxy, the replicas (SIGTERM: they drain) and PostgreSQL
# Settings (environment): CLUSTER_DIR (/tmp/pagewire-cluster), PROXY_PORT (8100), A_PORT (8101),
# B_PORT (8102), PG_PORT (8132), PY (.venv/bin/python), MODEL_ARGS (default: --demo-model; e.g. a
# model folder or .gguf path), SERVE_ARGS (extra `pagewire serve` options for both replicas).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
DIR="${CLUSTER_DIR:-/tmp/pagewire-cluster}"
PY="${PY:-$ROOT/.venv/bin/python}"
PROXY_PORT="${PROXY_PORT:-8100}"; A_PORT="${A_PORT:-8101}"; B_PORT="${B_PORT:-8102}"; PG_PORT="${PG_PORT:-8132}"
MODEL_ARGS="${MODEL_ARGS:---demo-model}"
SERVE_ARGS="${SERVE_ARGS:-}"
BIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
URL="postgresql://pagewire@127.0.0.1:$PG_PORT/pagewire"

# PostgreSQL refuses to run as root: as root, run it as `nobody`.
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u nobody -- "$@"; else "$@"; fi; }

wait_health() {  # wait_health PORT NAME
    for _ in $(seq 1 600); do
        if "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$1/health', timeout=1).status_code != 200)" \
            2>/dev/null; then return 0; fi
        sleep 0.5
    done
    echo "cluster: $2 did not become healthy; see $DIR/$2.log" >&2; return 1
}

start() {
    [ -n "$BIN" ] || { echo "cluster: PostgreSQL is not installed (make sysdeps)" >&2; exit 1; }
    command -v haproxy >/dev/null || { echo "cluster: HAProxy is not installed (make sysdeps)" >&2; exit 1; }
    mkdir -p "$DIR/pg"
    [ "$(id -u)" = 0 ] && chown nobody "$DIR/pg"
    if [ ! -f "$DIR/pg/data/PG_VERSION" ]; then
        as_pg "$BIN/initdb" -D "$DIR/pg/data" -U pagewire --auth=trust -E UTF8 --no-instructions >"$DIR/initdb.log"
    fi
    if ! as_pg "$BIN/pg_ctl" -D "$DIR/pg/data" status >/dev/null 2>&1; then
        as_pg "$BIN/pg_ctl" -D "$DIR/pg/data" -l "$DIR/pg/server.log" -w \
            -o "-p $PG_PORT -k $DIR/pg -c listen_addresses=127.0.0.1" start >/dev/null
    fi
    "$BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U pagewire -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'pagewire'" | grep -q 1 \
        || "$BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U pagewire pagewire
    for r in a b; do
        port=$([ $r = a ] && echo "$A_PORT" || echo "$B_PORT")
        if [ -f "$DIR/$r.pid" ] && kill -0 "$(cat "$DIR/$r.pid")" 2>/dev/null; then continue; fi
        # shellcheck disable=SC2086
        (cd "$ROOT" && exec "$PY" -m server.cli serve $MODEL_ARGS --host 127.0.0.1 --port "$port" --db "$URL" \
            $SERVE_ARGS >"$DIR/$r.log" 2>&1) &
        echo $! >"$DIR/$r.pid"
    done
    wait_health "$A_PORT" a
    wait_health "$B_PORT" b
    if ! { [ -f "$DIR/haproxy.pid" ] && kill -0 "$(cat "$DIR/haproxy.pid")" 2>/dev/null; }; then
        PAGEWIRE_PROXY_BIND="127.0.0.1:$PROXY_PORT" PAGEWIRE_A="127.0.0.1:$A_PORT" PAGEWIRE_B="127.0.0.1:$B_PORT" \
            haproxy -D -p "$DIR/haproxy.pid" -f "$HERE/haproxy.cfg"
    fi
    wait_health "$PROXY_PORT" haproxy
    cat <<MSG
cluster up (all on 127.0.0.1):
  proxy      http://127.0.0.1:$PROXY_PORT   (consistent hash on X-Session-Id / body "user" / ?session=)
  replica a  http://127.0.0.1:$A_PORT   log $DIR/a.log
  replica b  http://127.0.0.1:$B_PORT   log $DIR/b.log
  ledger     $URL
try:  curl -s -H 'X-Session-Id: conv-1' http://127.0.0.1:$PROXY_PORT/v1/completions \\
        -H 'content-type: application/json' -d '{"model": "pagewire-demo", "prompt": "hi", "max_tokens": 8}' -D - | grep -i x-pagewire-replica
      $PY -m server.cli requests list --db $URL
stop: $0 stop
MSG
}

stop() {
    if [ -f "$DIR/haproxy.pid" ]; then kill "$(cat "$DIR/haproxy.pid")" 2>/dev/null || true; rm -f "$DIR/haproxy.pid"; fi
    for r in a b; do
        if [ -f "$DIR/$r.pid" ]; then
            pid=$(cat "$DIR/$r.pid"); kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            rm -f "$DIR/$r.pid"
        fi
    done
    if [ -n "$BIN" ] && [ -f "$DIR/pg/data/PG_VERSION" ]; then
        as_pg "$BIN/pg_ctl" -D "$DIR/pg/data" -m fast -w stop >/dev/null 2>&1 || true
    fi
    echo "cluster stopped (data kept in $DIR; delete it to start afresh)"
}

case "${1:-start}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
