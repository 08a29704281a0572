#!/usr/bin/env python3
"""The prefill decision on the tier's real NIXL pair (issue 45 point 4): always P/D against
deciding per request (`prefill.skip_below_tokens` swept) and vLLM's toy proxy, on an agentic
trace, rounds interleaved.

A benchmark command, not a test; not in CI. Uses the tier's stack (tests/e2e/stack.sh up, with
E2E_TRACING=0): prefill :18100, decode :18200, NixlConnector; the decode publishes its KV
events on :18210 (stack.sh). It starts its own tokenonce (the release build if there is one,
else the debug one, said in the output) on :18022 (admin :18922): prefill pool with local ids on
(trusted after one match), decode pool `decode-kv` following the decode's events, and one route
per threshold, chosen by `x-bench-skip: N` (0: always P/D). vLLM's toy proxy
($TOKENONCE_PEERS/toy_proxy_server.py, from benches/peers.sh) on :18510, when present.

The trace: --sessions agentic sessions run --concurrency at a time; each starts from a history
of --history-min to --history-max tokens (random words: nothing shared between sessions or
runs) and runs --turns turns, each adding a user message of --add-min to --add-max tokens (a
tool result, say) after the previous answer; streamed, --max-tokens generated. Lengths come
from --seed, the same for every policy; the words are new per run, so no run finds another's
blocks cached.

Per run: client TTFT (request sent to the first chunk with text) p50 / p90, over every turn
and over the turns after the first (those the decode may hold); the prompt tokens each engine
computed (`vllm:prompt_tokens_by_source_total{source="local_compute"}` moved) and the decode's
NIXL bytes pulled; the gaps between a stream's chunks (inter-token latency of streams running
on the decode while other turns arrive) p50 / p90 / p99; tokenonce's decisions.

Usage: VENV/bin/python tests/e2e/bench_prefill_skip.py [--rounds 3] [--thresholds 0,128,512,2048]
       [--sessions 8] [--concurrency 8] [--turns 4] [--json FILE]
"""

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

from bench_kv_routing import wait_http  # same directory: the harness's readiness wait

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
HOST = "127.0.0.1"
PREFILL, DECODE, DECODE_EVENTS = 18100, 18200, 18210
TOKENONCE, ADMIN, TOY = 18022, 18922, 18510
VENV = os.environ.get("TOKENONCE_VLLM_VENV", os.path.expanduser("~/.cache/tokenonce-vllm-venv"))
MODEL_DIR = os.environ.get("TOKENONCE_VLLM_MODEL_DIR", os.path.join(VENV, "models", "tiny-qwen3"))
PEERS = os.environ.get("TOKENONCE_PEERS", os.path.expanduser("~/.cache/tokenonce-peers"))
MODEL = "tiny-qwen3"
TIMEOUT_S = 300.0
WORDS = ("amber basil cedar delta ember fjord garnet harbor indigo juniper kelp lumen meadow nectar orchid "
         "pepper quartz raven sable thistle umber violet walnut yonder zephyr").split()

CONFIG = """
[server]
listen = "{host}:{port}"
admin_listen = "{host}:{admin}"
log_level = "warn"

[pools.prefill]
endpoints = ["{host}:{prefill}"]
tokenizer = "{model_dir}"
local_ids = "on"
local_ids_verify_after = 1
local_ids_recheck = 0.0

[pools.decode]
endpoints = ["{host}:{decode}"]
tokenizer = "{model_dir}"
balance = "cache_aware"
[pools.decode.cache_aware]
block_size = 128
hash_seed = "0"
[pools.decode.kv_events]
port = {events}
replay_port = {replay}
topic = "kv"
block_size = 128
hash_seed = "0"

[defaults]
passthrough_pool = "decode"
"""

ROUTE = """
[[routes]]
name = "skip-{n}"
mode = "orchestrate"
decode_pool = "decode"
prefill = {{ pool = "prefill", skip_below_tokens = {n} }}
# Eight cold 37k-token histories queue at the one CPU prefill past the default 30 s.
prefill_timeout_ms = 120000
[routes.match]
paths = ["/v1/chat/completions"]
headers = {{ "x-bench-skip" = "{n}" }}
"""


def start_tokenonce(tmp, thresholds):
    binary = next((b for b in (os.path.join(ROOT, "target/release/tokenonce"), os.path.join(ROOT, "target/debug/tokenonce"))
                   if os.access(b, os.X_OK)), None)
    if binary is None:
        sys.exit("no tokenonce binary: cargo build --release")
    text = CONFIG.format(host=HOST, port=TOKENONCE, admin=ADMIN, prefill=PREFILL, decode=DECODE, model_dir=MODEL_DIR,
                         events=DECODE_EVENTS, replay=DECODE_EVENTS + 1)
    text += "".join(ROUTE.format(n=n) for n in thresholds)
    conf = os.path.join(tmp, "bench-prefill-skip.toml")
    with open(conf, "w") as f:
        f.write(text)
    subprocess.run([binary, "check", conf], check=True, stdout=subprocess.DEVNULL)
    proc = subprocess.Popen([binary, "--config", conf], stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(tmp, "tokenonce.log"), "w"))
    wait_http(ADMIN, "/readyz", proc=proc)
    return proc, binary


def start_toy(tmp):
    toy = os.path.join(PEERS, "toy_proxy_server.py")
    if not os.path.exists(toy):
        print(f"\n*** vLLM's toy proxy SKIPPED: no {toy}; `bash benches/peers.sh` fetches it ***\n", flush=True)
        return None
    proc = subprocess.Popen([sys.executable, toy, "--port", str(TOY), "--prefiller-host", HOST, "--prefiller-port",
                             str(PREFILL), "--decoder-host", HOST, "--decoder-port", str(DECODE)],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "toy.log"), "w"))
    wait_http(TOY, "/healthcheck", proc=proc)
    return proc


def stream(port, body, headers):
    """One streamed chat request: (TTFT s, gaps between content chunks s, generated text, prompt
    tokens from the final usage chunk)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", "Connection": "close", **headers})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f":{port}: HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, last, gaps, text, prompt_tokens = None, None, [], [], None
    for _ in range(100_000):  # bounded: one line per token or so
        line = resp.fp.readline()
        if not line or line.strip() == b"data: [DONE]":
            break
        if not line.startswith(b"data: "):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(f":{port}: stream error {ev}")
        if ev.get("usage"):
            prompt_tokens = ev["usage"].get("prompt_tokens")
        for ch in ev.get("choices") or []:
            d = ch.get("delta") or {}
            piece = d.get("content") or d.get("reasoning") or d.get("reasoning_content")
            if piece:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
                if d.get("content"):
                    text.append(d["content"])
    conn.close()
    if ttft is None:
        raise RuntimeError(f":{port}: no generated text")
    return ttft, gaps, "".join(text), prompt_tokens


def words(rng, tokens):
    # One word of WORDS is one token of Qwen3's tokenizer with the space before it, near enough.
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def engine_counters(port):
    conn = http.client.HTTPConnection(HOST, port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    out = {"computed": 0.0, "nixl_bytes": 0.0}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="local_compute"' in line:
            out["computed"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:nixl_bytes_transferred_sum"):
            out["nixl_bytes"] += float(line.rsplit(" ", 1)[1])
    return out


def run(policy, args, run_seed):
    """One pass of the trace through `policy`: per-turn TTFTs, stream gaps, engine deltas."""
    lengths = random.Random(args.seed)  # the same shapes for every policy
    plans = [(lengths.randint(args.history_min, args.history_max),
              [lengths.randint(args.add_min, args.add_max) for _ in range(args.turns)]) for _ in range(args.sessions)]
    if policy == "toy":
        port, headers = TOY, {}
    else:
        port, headers = TOKENONCE, {"x-bench-skip": policy.removeprefix("skip-")}
    before = {p: engine_counters(p) for p in (PREFILL, DECODE)}
    first, later, gaps, errors = [], [], [], []
    turns = {}  # (session, turn) -> (TTFT s, estimated tokens the decode lacked)
    small, large = [], []  # later turns' TTFTs by what they added: up to --small tokens, or more

    def session(k):
        rng = random.Random(f"{run_seed}-{k}")  # words of its own: nothing cached from another run
        history, adds = plans[k]
        prev_prompt = [None]
        messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": words(rng, history)}]
        for t, add in enumerate(adds):
            if t > 0:
                messages.append({"role": "user", "content": "Tool result: " + words(rng, add)})
            body = {"model": MODEL, "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            try:
                ttft, g, text, prompt = stream(port, body, headers)
            except Exception as e:  # noqa: BLE001  (counted, shown after the run)
                errors.append(repr(e))
                return
            (first if t == 0 else later).append(ttft)
            # What the decode lacks, estimated as the decision sees it: this prompt past the full
            # blocks of the previous one (which the decode held after answering it).
            held = 128 * (prev_prompt[0] // 128) if t > 0 and prev_prompt[0] else 0
            turns[(k, t)] = (ttft, (prompt or 0) - held)
            prev_prompt[0] = prompt
            if t > 0:
                (small if add <= args.small else large).append(ttft)
            gaps.extend(g)
            messages.append({"role": "assistant", "content": text})

    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for f in [pool.submit(session, k) for k in range(args.sessions)]:
            f.result()
    time.sleep(1.0)  # the engines count a step after answering
    after = {p: engine_counters(p) for p in (PREFILL, DECODE)}
    q = lambda xs, p: 1000 * statistics.quantiles(xs, n=100)[p - 1] if len(xs) > 1 else float("nan")  # noqa: E731
    return {"policy": policy, "errors": errors,
            "ttft_p50": q(first + later, 50), "ttft_p90": q(first + later, 90),
            "later_p50": q(later, 50), "later_p90": q(later, 90),
            "small_p50": q(small, 50), "large_p50": q(large, 50), "small_n": len(small), "large_n": len(large),
            "itl_p50": q(gaps, 50), "itl_p90": q(gaps, 90), "itl_p99": q(gaps, 99),
            "turns": {f"{k}/{t}": v for (k, t), v in turns.items()},
            "prefill_computed": after[PREFILL]["computed"] - before[PREFILL]["computed"],
            "decode_computed": after[DECODE]["computed"] - before[DECODE]["computed"],
            "nixl_mb": (after[DECODE]["nixl_bytes"] - before[DECODE]["nixl_bytes"]) / 1e6}


def decisions():
    conn = http.client.HTTPConnection(HOST, ADMIN, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return [line for line in text.splitlines()
            if re.match(r"^tokenonce_prefill_decisions_total\{", line) and not line.endswith(" 0")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--thresholds", default="0,128,512,2048")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--history-min", type=int, default=4000)
    ap.add_argument("--history-max", type=int, default=26000)
    ap.add_argument("--add-min", type=int, default=50)
    ap.add_argument("--add-max", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=45)
    ap.add_argument("--small", type=int, default=512, help="later turns adding at most this many tokens are 'small'")
    ap.add_argument("--no-toy", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    thresholds = [int(n) for n in args.thresholds.split(",")]
    tmp = tempfile.mkdtemp(prefix="bench-prefill-skip-")
    proc, binary = start_tokenonce(tmp, thresholds)
    toy = None if args.no_toy else start_toy(tmp)
    policies = [f"skip-{n}" for n in thresholds] + (["toy"] if toy else [])
    print(f"tokenonce {binary}; {args.sessions} sessions ({args.concurrency} at once) x {args.turns} turns, "
          f"histories {args.history_min}-{args.history_max} tokens, turns adding {args.add_min}-{args.add_max}, "
          f"{args.max_tokens} tokens generated; load average {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    try:
        # Trust: the shapes' first requests go as text with the echo.
        for n in thresholds[:1]:
            for messages in ([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}],
                             [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                              {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]):
                stream(TOKENONCE, {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True},
                       {"x-bench-skip": str(n)})
        time.sleep(1.0)
        for r in range(args.rounds):
            for policy in policies[r % len(policies):] + policies[:r % len(policies)]:
                res = run(policy, args, f"{r}-{policy}-{time.time_ns()}")
                res["round"] = r
                results.append(res)
                print(f"  r{r} {policy:9} TTFT p50 {res['ttft_p50']:7.1f} p90 {res['ttft_p90']:7.1f}"
                      f"  later turns p50 {res['later_p50']:7.1f} p90 {res['later_p90']:7.1f} ms"
                      f" (adding <= {args.small}: p50 {res['small_p50']:7.1f} of {res['small_n']}, more: {res['large_p50']:7.1f})"
                      f"  ITL p50 {res['itl_p50']:5.1f} p90 {res['itl_p90']:5.1f} p99 {res['itl_p99']:6.1f} ms"
                      f"  computed prefill {res['prefill_computed']:7.0f} decode {res['decode_computed']:7.0f}"
                      f"  NIXL {res['nixl_mb']:6.1f} MB  errors {len(res['errors'])}", flush=True)
                for e in res["errors"][:3]:
                    print(f"    {e[:200]}")
        print("\ntokenonce decisions:")
        for line in decisions():
            print("  " + line)
    finally:
        for p in (proc, toy):
            if p is not None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
    keys = ("ttft_p50", "ttft_p90", "later_p50", "later_p90", "small_p50", "large_p50", "itl_p50", "itl_p90", "itl_p99",
            "prefill_computed", "decode_computed", "nixl_mb")
    print("\nmedians over rounds:")
    print(f"| policy | TTFT p50 / p90 ms | later turns p50 / p90 ms | later turns adding <= {args.small} / more, p50 ms "
          "| ITL p50 / p90 / p99 ms | prompt tokens computed prefill / decode | NIXL MB |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for policy in policies:
        mine = [r for r in results if r["policy"] == policy]
        if not mine:
            continue
        m = {k: statistics.median(r[k] for r in mine) for k in keys}
        base = base or m
        print(f"| {policy} | {m['ttft_p50']:.0f} / {m['ttft_p90']:.0f} | {m['later_p50']:.0f} / {m['later_p90']:.0f} "
              f"| {m['small_p50']:.0f} / {m['large_p50']:.0f} "
              f"| {m['itl_p50']:.1f} / {m['itl_p90']:.1f} / {m['itl_p99']:.1f} "
              f"| {m['prefill_computed']:,.0f} / {m['decode_computed']:,.0f} | {m['nixl_mb']:.1f} |")
        if policy != policies[0]:
            print(f"    later-turn TTFT p50 x{m['later_p50'] / base['later_p50']:.2f} of {policies[0]}'s "
                  f"(adding <= {args.small}: x{m['small_p50'] / base['small_p50']:.2f}), "
                  f"ITL p50 x{m['itl_p50'] / base['itl_p50']:.2f}")
    # Issue 45's measure: on the turns a threshold sends to the decode alone (by the estimate),
    # their median TTFT against always-P/D's on the same turns of the same round.
    pd = {r["round"]: r["turns"] for r in results if r["policy"] == "skip-0"}
    for n in thresholds:
        if n == 0:
            continue
        ratios, over, itl, count = [], [], [], 0
        for r in results:
            if r["policy"] != f"skip-{n}" or r["round"] not in pd:
                continue
            same = pd[r["round"]]
            mine = [(key, v[0]) for key, v in r["turns"].items() if not key.endswith("/0") and v[1] <= n]
            both = [(t, same[key][0]) for key, t in mine if key in same]
            count += len(both)
            if both:
                ratios.append(statistics.median(t for t, _ in both) / statistics.median(p for _, p in both))
            # Every other turn (first turns and those lacking more): what the decision costs them.
            rest = [(v[0], same[key][0]) for key, v in r["turns"].items()
                    if key in same and (key.endswith("/0") or v[1] > n)]
            if rest:
                over.append(statistics.median(t for t, _ in rest) / statistics.median(p for _, p in rest))
            base_run = next(x for x in results if x["policy"] == "skip-0" and x["round"] == r["round"])
            itl.append(r["itl_p50"] / base_run["itl_p50"])
        if ratios:
            print(f"  skip-{n}: turns under the threshold (est.) {count}; their TTFT p50 / always-P/D's on the same "
                  f"turns, per round: {', '.join(f'{x:.2f}' for x in ratios)}; every other turn: "
                  f"{', '.join(f'{x:.2f}' for x in over)}; running streams' ITL p50: "
                  f"{', '.join(f'{x:.2f}' for x in itl)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "binary": binary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
