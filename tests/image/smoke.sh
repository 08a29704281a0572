#!/usr/bin/env bash
# Smoke-runs the image from tests/image/build.sh with rootful podman: `tokenonce check` on the
# image's default and on every conf/*.toml mounted in; then the server with no arguments (the
# embedded default) in the container's own network namespace (--network none: only its
# loopback), where the two fake engines of fake_engine.py are started on 127.0.0.1:8100/8200
# (nsenter into that namespace, host python). It checks /healthz and /readyz on :9000, one chat
# request through :8000 (prefill leg, then the decode leg on the prefill's prompt ids, the
# metrics of it), the uid it runs as, and a clean exit 0 on `podman stop` (SIGTERM).
#
#   bash tests/image/smoke.sh        # after build.sh; TOKENONCE_IMAGE_TAG, TOKENONCE_IMAGE_DIR as there
#
# Two work-arounds for this machine kind (docs/container.md): runc instead of crun (crun 1.8
# refuses this kernel's hybrid cgroups: "cgroups in hybrid mode not supported, drop all
# controllers from cgroupv2"), and --ulimit at or below the limits podman itself runs with
# (its default nofile 1048576 is above the hard limit here: "setrlimit `RLIMIT_NOFILE`:
# Operation not permitted"). TOKENONCE_PODMAN_RUNTIME=crun tries crun.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${TOKENONCE_IMAGE_DIR:-$HOME/.cache/tokenonce-image}
TAG=${TOKENONCE_IMAGE_TAG:-localhost/tokenonce:dev}
NAME=tokenonce-smoke
say() { echo "[smoke] $*"; }
die() { echo "[smoke] FAILED: $*" >&2; exit 1; }
T0=$SECONDS

missing=()
command -v podman >/dev/null 2>&1 || missing+=(podman)
command -v runc >/dev/null 2>&1 || missing+=(runc)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
podman image exists "$TAG" || die "no image $TAG: run tests/image/build.sh first"

# A limit no higher than this shell's hard limit nor the cap podman sets on itself.
cap() { local h; h=$(ulimit -H "$1"); if [ "$h" = unlimited ] || [ "$h" -gt "$2" ]; then echo "$2"; else echo "$h"; fi; }
nofile=$(cap -n 1048576) nproc=$(cap -u 32768)
PODMAN=(podman --runtime "${TOKENONCE_PODMAN_RUNTIME:-runc}")
RUN_OPTS=(--network none --ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")

# 1. `tokenonce check` inside the image: its copy of the default, and each shipped config
#    (files a deployment provides, such as a model folder under /models, skipped).
"${PODMAN[@]}" run --rm "${RUN_OPTS[@]}" "$TAG" check /etc/tokenonce/tokenonce.toml \
  || die "podman run $TAG check /etc/tokenonce/tokenonce.toml (the error above is podman's or tokenonce's)"
for conf in "$ROOT"/conf/*.toml; do
  "${PODMAN[@]}" run --rm "${RUN_OPTS[@]}" -v "$ROOT/conf:/conf:ro" "$TAG" check --skip-missing-files "/conf/$(basename "$conf")" \
    || die "tokenonce check /conf/$(basename "$conf") inside the image"
done

# 2. The server on the embedded default, alone in its network namespace.
fake_pid=""
metrics_file=""
cleanup() {
  [ -n "$fake_pid" ] && kill "$fake_pid" 2>/dev/null
  [ -n "$metrics_file" ] && rm -f "$metrics_file"
  "${PODMAN[@]}" rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
}
trap cleanup EXIT
"${PODMAN[@]}" rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
"${PODMAN[@]}" run -d --name "$NAME" "${RUN_OPTS[@]}" "$TAG" >/dev/null
pid=$("${PODMAN[@]}" inspect -f '{{.State.Pid}}' "$NAME")
[ "$pid" -gt 0 ] || die "container $NAME has no pid"
logs() { "${PODMAN[@]}" logs "$NAME" 2>&1 | tail -n 20 >&2; }
in_ns() { nsenter -t "$pid" -n "$@"; }
uid=$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")
[ "$uid" = 10001 ] || die "the server runs as uid $uid, not 10001"

LOG=$OUT/smoke-requests.jsonl
rm -f "$LOG"
# The interpreter itself, not a wrapper (a pyenv shim would leave python behind on kill).
py=$(python3 -c 'import sys; print(sys.executable)')
nsenter -t "$pid" -n "$py" "$ROOT/tests/image/fake_engine.py" --prefill-port 8100 --decode-port 8200 --log "$LOG" \
  --max-seconds 120 >"$OUT/smoke-fake.log" 2>&1 &
fake_pid=$!

# Poll: at most 100 tries 0.2 s apart (20 s) for each answer.
wait_for() {
  local url=$1 code=""
  for _ in $(seq 1 100); do
    code=$(in_ns curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$url" || true)
    [ "$code" = 200 ] && return 0
    sleep 0.2
  done
  logs; die "$url answered ${code:-nothing}, not 200, within 20 s"
}
wait_for http://127.0.0.1:9000/healthz
wait_for http://127.0.0.1:9000/readyz
say "server up as uid $uid: /healthz and /readyz 200 (engines found healthy)"

# 3. One chat request through the proxy: prefill leg, then decode on the prefill's ids.
body='{"model":"tiny-qwen3","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hello there!"}],"max_tokens":5,"temperature":0}'
answer=$(in_ns curl -s --max-time 10 -w '\n%{http_code}' -H 'content-type: application/json' -d "$body" \
  http://127.0.0.1:8000/v1/chat/completions) || { logs; die "chat request: curl failed"; }
# The scrape goes through a file: it is larger than one argument may be (128 KiB).
metrics_file=$(mktemp)
in_ns curl -s --max-time 5 http://127.0.0.1:9000/metrics >"$metrics_file"
python3 - "$LOG" "$ROOT/tests/fixtures/vllm/chat_prefill.json" "$answer" "$metrics_file" <<'EOF' || { logs; die "proxied request"; }
import json, sys
log, prefill_fixture, answer, metrics_file = sys.argv[1:5]
metrics = open(metrics_file).read()
text, status = answer.rsplit("\n", 1)
assert status == "200", f"chat answered {status}: {text[:300]}"
reply = json.loads(text)["choices"][0]["message"]["reasoning"]
assert reply == " Aircraft Aircraft Aircraft Aircraft殘", f"reply is not the decode engine's: {reply!r}"
posts = [r for r in map(json.loads, open(log)) if r["method"] == "POST"]
roles = [r["role"] for r in posts]
assert roles == ["prefill", "decode"], f"engine legs were {roles}"
pre, dec = (json.loads(r["body"]) for r in posts)
assert pre["max_tokens"] == 1 and pre["kv_transfer_params"]["do_remote_decode"] is True, f"prefill leg: {pre}"
ids = json.loads(json.load(open(prefill_fixture))["response_body"])["prompt_token_ids"]
kv = dec["kv_transfer_params"]
assert kv["prompt_token_ids"] == ids, f"decode got ids {kv.get('prompt_token_ids')}, prefill gave {ids}"
assert kv["remote_block_ids"] == [[21]] and dec["max_tokens"] == 5, f"decode leg: {dec}"
def counted(name, *labels):
    """Sum of a counter's series carrying all these label pairs."""
    rows = [l for l in metrics.splitlines() if l.startswith(name + "{") and all(x in l for x in labels)]
    return sum(float(l.split()[-1]) for l in rows)
done = counted("tokenonce_requests_total", 'route="pd"', 'api="chat"', 'outcome="success"')
reused = counted("tokenonce_token_reuse_total", 'route="pd"', 'result="applied"')
assert (done, reused) == (1, 1), f"metrics: {done} successful pd chat requests, {reused} reuses applied"
print(f"[smoke] chat via :8000: 200 from the decode engine, which got the prefill's {len(ids)} ids;"
      " /metrics counts 1 success, 1 reuse applied")
EOF

# 4. SIGTERM (podman stop) ends it cleanly within the default config's grace period.
t=$SECONDS
"${PODMAN[@]}" stop -t 30 "$NAME" >/dev/null
code=$("${PODMAN[@]}" inspect -f '{{.State.ExitCode}}' "$NAME")
[ "$code" = 0 ] || { logs; die "exit status $code after podman stop"; }
say "podman stop: exit 0 after $((SECONDS - t)) s; smoke passed in $((SECONDS - T0)) s"
