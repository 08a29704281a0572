#!/usr/bin/env python3
"""Prefill choice policies side by side on the tier's real engines (issue 32 point 6, a start):
round robin, least in flight, cache-aware (by the prefills' KV events) and the sticky oracle
(every turn of a conversation on one prefill, named by llm-d's `x-prefiller-host-port`).

A benchmark command, not a test; not in CI. Uses the tier's stack (tests/e2e/stack.sh: prefills
:18100 and :18300 publishing KV events, decode :18200; start it first, E2E_TRACING=0 is fine)
and starts its own tokenonce (the release build if there is one, else the debug one, said in the
output) on :18020 (admin :18920) with one route per policy, chosen by `x-bench-policy`:

  round_robin      pool `rr`   balance = "round_robin" over both prefills
  least_in_flight  pool `lif`  balance = "least_in_flight"
  cache_aware      pool `kv`   balance = "cache_aware" with the prefills' kv_events (local ids
                               on: a shape is trusted after one match, so each pick knows the
                               prompt's blocks before the prefill)
  oracle           the prefill named per request by `x-prefiller-host-port`: conversation c
                   always on prefill c mod 2

The workload: --conversations chat conversations (a shared system prompt, then distinct user
turns of --words words each), --turns turns each, sent by --clients client threads; a client
takes the next conversation whose previous turn has been answered, so turns of different
conversations interleave. Runs rotate over the policies (--rounds of each), every run with
conversations of its own (a fresh seed), so no run finds another's history cached.

Per run: the prefix hit rate the prefills themselves report (the sum over both of
`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total`, moved by the run),
the prefill tokens computed (queries - hits), and client time to first token (request sent to
the first streamed chunk with text), p50 and p90.

Limits, to be lifted in point 6 proper: the engines' KV caches (1 GiB each) hold every
conversation of a run, so nothing is evicted and round robin is favoured against a real fleet;
vLLM Router is not in the set yet.

Usage: VENV/bin/python tests/e2e/bench_kv_routing.py [--rounds 2] [--conversations 12]
       [--turns 5] [--clients 4] [--words 200] [--json FILE]
"""

import argparse
import concurrent.futures
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HOST = "127.0.0.1"
PREFILLS = (18100, 18300)
DECODE = 18200
TOKENONCE, ADMIN = 18020, 18920
VENV = os.environ.get("TOKENONCE_VLLM_VENV", os.path.expanduser("~/.cache/tokenonce-vllm-venv"))
MODEL_DIR = os.environ.get("TOKENONCE_VLLM_MODEL_DIR", os.path.join(VENV, "models", "tiny-qwen3"))
MODEL = "tiny-qwen3"
POLICIES = ("round_robin", "least_in_flight", "cache_aware", "oracle")
TIMEOUT_S = 300.0

CONFIG = """
[server]
listen = "{host}:{port}"
admin_listen = "{host}:{admin}"
log_level = "warn"

[pools.decode]
endpoints = ["{host}:{decode}"]

[pools.rr]
endpoints = [{prefills}]
balance = "round_robin"

[pools.lif]
endpoints = [{prefills}]
balance = "least_in_flight"

# As tokenonce-e2e.toml's prefill-kv (the engines stack.sh starts).
[pools.kv]
endpoints = [{prefills}]
tokenizer = "{model_dir}"
local_ids = "on"
local_ids_verify_after = 1
local_ids_recheck = 0.0
balance = "cache_aware"
[pools.kv.cache_aware]
block_size = 128
hash_seed = "0"
[pools.kv.kv_events]
port = 18110
replay_port = 18111
endpoint_ports = {{ "{host}:18300" = 18310 }}
endpoint_replay_ports = {{ "{host}:18300" = 18311 }}
topic = "kv"
block_size = 128
hash_seed = "0"

[defaults]
passthrough_pool = "decode"
"""

ROUTE = """
[[routes]]
name = "{name}"
mode = "orchestrate"
decode_pool = "decode"
prefill = {prefill}
[routes.match]
paths = ["/v1/chat/completions"]
headers = {{ "x-bench-policy" = "{name}" }}
"""

PREFILL_OF = {
    "round_robin": '{ pool = "rr" }',
    "least_in_flight": '{ pool = "lif" }',
    "cache_aware": '{ pool = "kv" }',
    "oracle": '{ header = "x-prefiller-host-port", allow = ["127.0.0.0/8"] }',
}

WORDS = ("amber basalt cedar delta ember fjord garnet harbor indigo juniper kelp lantern meadow nickel orchard "
         "pewter quartz river saffron timber umber velvet willow xenon yarrow zephyr").split()
SYSTEM = {"role": "system", "content": "You keep a ledger of facts. " + " ".join(
    f"Rule {i}: write each {WORDS[i % len(WORDS)]} entry in order." for i in range(40))}


def wait_http(port, path, deadline_s=90):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://{HOST}:{port}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"nothing answered 200 on :{port}{path} within {deadline_s} s")


def start_tokenonce(tmp):
    binary = next((b for b in (os.path.join(ROOT, "target/release/tokenonce"), os.path.join(ROOT, "target/debug/tokenonce"))
                   if os.access(b, os.X_OK)), None)
    if binary is None:
        sys.exit("no tokenonce binary: cargo build --release")
    prefills = ", ".join(f'"{HOST}:{p}"' for p in PREFILLS)
    text = CONFIG.format(host=HOST, port=TOKENONCE, admin=ADMIN, decode=DECODE, prefills=prefills, model_dir=MODEL_DIR)
    text += "".join(ROUTE.format(name=name, prefill=PREFILL_OF[name]) for name in POLICIES)
    conf = os.path.join(tmp, "bench-kv-routing.toml")
    with open(conf, "w") as f:
        f.write(text)
    subprocess.run([binary, "check", conf], check=True, stdout=subprocess.DEVNULL)
    log = open(os.path.join(tmp, "tokenonce.log"), "w")
    proc = subprocess.Popen([binary, "--config", conf], stdout=subprocess.DEVNULL, stderr=log)
    wait_http(ADMIN, "/readyz")
    return proc, binary


_SAMPLE = re.compile(r'^(vllm:[a-zA-Z0-9_:]+)(?:\{[^}]*\})?\s+(\S+)$')


def prefix_counters():
    """(hits, queries) summed over both prefills, from their own /metrics."""
    hits = queries = 0.0
    for port in PREFILLS:
        for line in httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).text.splitlines():
            m = _SAMPLE.match(line)
            if m and m.group(1) == "vllm:prefix_cache_hits_total":
                hits += float(m.group(2))
            elif m and m.group(1) == "vllm:prefix_cache_queries_total":
                queries += float(m.group(2))
    return hits, queries


def user_turn(rng, words, tag):
    return {"role": "user", "content": f"{rng.choice(WORDS)} {' '.join(rng.choice(WORDS) for _ in range(words))} ({tag})"}


def ttft(client, messages, headers):
    """Seconds from sending a streamed chat request to its first chunk with text."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    first = None
    with client.stream("POST", f"http://{HOST}:{TOKENONCE}/v1/chat/completions", json=body, headers=headers,
                       timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                first = time.monotonic() - t0
    return first if first is not None else time.monotonic() - t0


def run(policy, seed, args):
    """One run of the workload through `policy`: its hit rate, computed tokens and TTFTs."""
    rng = random.Random(seed)
    conversations = [{"id": c, "history": [SYSTEM], "turn": 0, "rng": random.Random(rng.random())}
                     for c in range(args.conversations)]
    ready = list(conversations)  # whose next turn may be sent
    lock = threading.Condition()
    ttfts = []
    hits0, queries0 = prefix_counters()

    def client():
        with httpx.Client() as http:
            while True:
                with lock:
                    while not ready and any(c["turn"] < args.turns for c in conversations):
                        lock.wait(timeout=1.0)
                    if not ready:
                        return
                    conv = ready.pop(0)
                conv["turn"] += 1
                conv["history"].append(user_turn(conv["rng"], args.words, f"{seed}/{conv['id']}/{conv['turn']}"))
                headers = {"x-bench-policy": policy}
                if policy == "oracle":
                    headers["x-prefiller-host-port"] = f"{HOST}:{PREFILLS[conv['id'] % len(PREFILLS)]}"
                took = ttft(http, conv["history"], headers)
                conv["history"].append({"role": "assistant", "content": f"Noted {conv['turn']}."})
                with lock:
                    ttfts.append(took)
                    if conv["turn"] < args.turns:
                        ready.append(conv)
                    lock.notify_all()

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        for f in [pool.submit(client) for _ in range(args.clients)]:
            f.result()
    wall = time.monotonic() - t0
    time.sleep(1.0)  # the engines count a step or so after answering
    hits1, queries1 = prefix_counters()
    hits, queries = hits1 - hits0, queries1 - queries0
    return {"policy": policy, "seed": seed, "requests": len(ttfts), "wall_s": wall,
            "hit_rate": hits / queries if queries else 0.0, "computed_tokens": queries - hits,
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * statistics.quantiles(ttfts, n=10)[-1] if len(ttfts) > 1 else 1000 * ttfts[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="runs of each policy, interleaved")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--words", type=int, default=200, help="words per user turn (about a token each)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        sys.exit(f"unknown policies {sorted(unknown)}: choose from {POLICIES}")
    for port in (*PREFILLS, DECODE):
        wait_http(port, "/health", deadline_s=5)
    with tempfile.TemporaryDirectory(prefix="bench-kv-routing-") as tmp:
        proc, binary = start_tokenonce(tmp)
        try:
            print(f"tokenonce {binary}; {args.conversations} conversations x {args.turns} turns, "
                  f"{args.clients} clients, {args.words} words a turn")
            # One warm-up conversation per policy route: the cache-aware pool's shapes earn trust.
            run("cache_aware", 0, argparse.Namespace(**{**vars(args), "conversations": 1, "turns": 2, "clients": 1}))
            results = []
            for r in range(args.rounds):
                for policy in policies:
                    res = run(policy, 1000 * (r + 1) + policies.index(policy), args)
                    results.append(res)
                    print(f"  {policy:16} hit rate {100 * res['hit_rate']:5.1f} %  computed {res['computed_tokens']:9.0f}"
                          f"  TTFT p50 {res['ttft_p50_ms']:7.1f} ms  p90 {res['ttft_p90_ms']:7.1f} ms  ({res['wall_s']:.0f} s)")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print("\nmedian over rounds:")
    for policy in policies:
        mine = [r for r in results if r["policy"] == policy]
        print(f"  {policy:16} hit rate {100 * statistics.median(r['hit_rate'] for r in mine):5.1f} %"
              f"  TTFT p50 {statistics.median(r['ttft_p50_ms'] for r in mine):7.1f} ms"
              f"  p90 {statistics.median(r['ttft_p90_ms'] for r in mine):7.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "binary": binary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
