#!/usr/bin/env bash
# Installs the peers the side-by-side bench (`cargo bench --bench peers`) compares tokenonce
# with, outside the repository (never committed), into ${TOKENONCE_PEERS:-~/.cache/tokenonce-peers}:
#   venv/                     a Python venv with fastapi, httpx, uvicorn and PyPI `vllm-router`
#   toy_proxy_server.py       vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py,
#                             from GitHub, or else from the vLLM sdist on PyPI
# Re-running it is cheap: what is there is kept. Versions: VLLM_ROUTER_VERSION (default 0.1.17),
# VLLM_REF (git ref for the toy proxy, default main), VLLM_SDIST_VERSION (default 0.33.0).
set -euo pipefail
DIR="${TOKENONCE_PEERS:-$HOME/.cache/tokenonce-peers}"
ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
REF="${VLLM_REF:-main}"
SDIST_VERSION="${VLLM_SDIST_VERSION:-0.33.0}"
TOY_PATH="tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
mkdir -p "$DIR"
cd "$DIR"

if [ ! -x venv/bin/python ]; then
    python3 -m venv venv
fi
if [ ! -x venv/bin/vllm-router ] || ! venv/bin/python -c 'import fastapi, httpx, uvicorn' 2>/dev/null; then
    venv/bin/pip install --quiet "vllm-router==$ROUTER_VERSION" fastapi httpx uvicorn
fi

if [ ! -s toy_proxy_server.py ]; then
    url="https://raw.githubusercontent.com/vllm-project/vllm/$REF/$TOY_PATH"
    if ! curl -fsS --max-time 30 -o toy_proxy_server.py.part "$url"; then
        echo "peers.sh: $url unreachable; taking the file from the vLLM $SDIST_VERSION sdist" >&2
        tmp="$(mktemp -d)"
        trap 'rm -rf "$tmp"' EXIT
        # The sdist's URL from PyPI's JSON API (pip download would build the package); the
        # project's document lists every release (the per-version one answered 404 here), and
        # a mirror may give its file addresses relative to the document.
        sdist_url="$(curl -fsS --max-time 30 "https://pypi.org/pypi/vllm/json" | SDIST_VERSION="$SDIST_VERSION" python3 -c \
            'import json,os,sys,urllib.parse as up; r=json.load(sys.stdin)["releases"][os.environ["SDIST_VERSION"]]; print(up.urljoin("https://pypi.org/pypi/vllm/json", next(u["url"] for u in r if u["packagetype"] == "sdist")))')"
        curl -fsS --max-time 300 -o "$tmp/vllm.tar.gz" "$sdist_url"
        tar -xzf "$tmp/vllm.tar.gz" -O "vllm-$SDIST_VERSION/$TOY_PATH" > toy_proxy_server.py.part
    fi
    [ -s toy_proxy_server.py.part ] || { echo "peers.sh: no toy proxy fetched; copy vLLM's $TOY_PATH (vLLM >= 0.32) to $DIR/toy_proxy_server.py" >&2; exit 1; }
    mv toy_proxy_server.py.part toy_proxy_server.py
fi

echo "peers installed in $DIR:"
echo "  toy proxy: $DIR/toy_proxy_server.py (sha256 $(sha256sum toy_proxy_server.py | cut -c1-16)...)"
echo "  vllm-router: $DIR/venv/bin/vllm-router ($(venv/bin/pip show vllm-router 2>/dev/null | sed -n 's/^Version: //p'))"
