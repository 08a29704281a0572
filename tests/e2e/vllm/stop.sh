#!/usr/bin/env bash
# stop.sh: stop a server started by start.sh: SIGTERM to its pid (vLLM shuts its engine
# processes down in ~5 s), then SIGKILL to its process group if anything is left.
# Usage: stop.sh [PORT]   (same PORT / TOKENONCE_VLLM_PIDFILE as start.sh; default 8311)
set -euo pipefail
PORT="${1:-${TOKENONCE_VLLM_PORT:-8311}}"
PIDFILE="${TOKENONCE_VLLM_PIDFILE:-${TMPDIR:-/tmp}/tokenonce-vllm-$PORT.pid}"
[ -f "$PIDFILE" ] || { echo "[tokenonce-vllm stop] no pid file $PIDFILE"; exit 0; }
PID="$(cat "$PIDFILE")"
case "$PID" in ''|*[!0-9]*) rm -f "$PIDFILE"; exit 0 ;; esac
# a stale pid file must not make us signal an unrelated process that reused the pid
if [ -r "/proc/$PID/cmdline" ] && ! tr '\0' ' ' <"/proc/$PID/cmdline" | grep -q vllm; then
  rm -f "$PIDFILE"; echo "[tokenonce-vllm stop] pid $PID is not vllm; removed stale $PIDFILE"; exit 0
fi
kill -TERM "$PID" 2>/dev/null || true
for _ in $(seq 1 30); do
  kill -0 -- "-$PID" 2>/dev/null || break   # whole process group gone?
  sleep 1
done
kill -KILL -- "-$PID" 2>/dev/null || true
rm -f "$PIDFILE"
echo "[tokenonce-vllm stop] stopped pid $PID"
