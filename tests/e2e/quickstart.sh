#!/usr/bin/env bash
# quickstart.sh: README's quick start, line for line: two vLLM servers moving the prompt's KV
# over NIXL (prefill 127.0.0.1:8100, decode 127.0.0.1:8200), tokenonce on its embedded default
# config in front of them (clients :8000, admin :9000), one chat, and the metric line that
# shows the decode took the prefill's ids. tests/e2e/run.sh runs this file as its last phase,
# so a change that breaks the quick start breaks CI; tests/docs.rs checks that README shows
# exactly the lines between the markers.
#
# Usage: bash tests/e2e/quickstart.sh   (stops what it started when it ends; ports 8000, 8100,
#        8200, 9000, 9100 and 9200 must be free). Env: QUICKSTART_KEEP=1 leaves it all running.
set -euo pipefail
cd "$(dirname "$0")/../.."

stop() {
  local rc=$?
  if [ "${QUICKSTART_KEEP:-0}" != 1 ]; then
    # Every job still running (`cargo run` and the tokenonce it started), also when a line
    # of the quick start failed before the last one: a tokenonce left behind would hold :8000.
    for job in $(jobs -p); do
      pkill -TERM -P "$job" 2>/dev/null || true
      kill "$job" 2>/dev/null || true
    done
    bash tests/e2e/vllm/stop.sh 8100 >/dev/null || true
    bash tests/e2e/vllm/stop.sh 8200 >/dev/null || true
  fi
  [ "$rc" = 0 ] && echo "[quickstart] PASS" || echo "[quickstart] FAIL (exit $rc)"
  exit "$rc"
}
trap stop EXIT

# --- quick start ---
bash .ci/setup                         # once: the build's Debian packages (cmake, libssl-dev, ...)
bash tests/e2e/vllm/setup.sh           # once: vLLM CPU 0.32 + NIXL 1.5.1 + a tiny Qwen3 (~3 min)
bash tests/e2e/vllm/start.sh 8100 &    # the prefill vLLM, NixlConnector on CPU
bash tests/e2e/vllm/start.sh 8200 &    # the decode vLLM, the same
wait                                   # both answer /health (~1 min)
cargo run --locked &                   # tokenonce, embedded default: :8000 -> prefill 8100, decode 8200
for _ in $(seq 60); do curl -fs http://127.0.0.1:9000/readyz && break; sleep 1; done
curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}'
curl -s http://127.0.0.1:9000/metrics | grep 'tokenonce_token_reuse_total{.*result="applied"'
# --- end ---

# What the lines above must have shown: one request reused its ids, and the decode pulled the
# prompt's KV over NIXL (its own counters).
# (Each page is fetched whole before grep reads it: `curl | grep -q` under pipefail fails when
# grep stops reading early and curl's write hits the closed pipe, exit 23.)
tokenonce_metrics=$(curl -fsS http://127.0.0.1:9000/metrics)
decode_metrics=$(curl -fsS http://127.0.0.1:8200/metrics)
grep -q 'tokenonce_token_reuse_total{reason="none",result="applied",route="pd"} 1$' <<<"$tokenonce_metrics"
grep -q '^vllm:nixl_xfer_time_seconds_count{.*} 1.0$' <<<"$decode_metrics"
