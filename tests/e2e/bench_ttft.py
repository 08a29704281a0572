#!/usr/bin/env python3
"""Time to first token with token reuse off vs on, through tokenonce, against real vLLM.

A benchmark command, not a test. Uses the end-to-end stack of tests/e2e/stack.sh (prefill vLLM
:18100, decode vLLM :18200, tokenonce :18000 with tests/e2e/tokenonce-e2e.toml, where the header
`x-e2e-route: off` selects the route with token_reuse = false). If the stack is not up, it is
started and stopped again at the end; a stack that was already up is left up.

The prompt is a long code-review chat (default ~37k Qwen3 tokens, ~58 messages) built from the
source files of the installed vllm package, as /work/shared's bench_tokenize.py does, so it is
the same for a pinned vLLM. For each of two phases -- the decode's prefix cache warm (the same
prompt sent first, so the decode's first token isolates rendering + tokenizing), then the decode
restarted with --no-enable-prefix-caching -- it times N interleaved runs of:

  client off   streaming chat through tokenonce, header x-e2e-route: off   (text decode leg)
  client on    streaming chat through tokenonce, default route             (token-in decode leg)
  decode off   the decode leg tokenonce sends with reuse off, straight to :18200: the plain chat
  decode on    the decode leg tokenonce sends with reuse on, straight to :18200: the same chat
               plus kv_transfer_params.prompt_token_ids = the ids a prefill call returned

TTFT = from sending the request to the first SSE chunk that carries generated text (delta
content or reasoning: the server runs the qwen3 reasoning parser, and with thinking on the
output is reasoning). Prints a markdown table of median and p90 (ms) and the on/off ratios.

Usage: VENV/bin/python tests/e2e/bench_ttft.py [--runs 15] [--tokens 37000] [--cold-runs N]
       [--skip-cold] [--json FILE]
"""

import argparse
import http.client
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

HOST = "127.0.0.1"
TOKENONCE, PREFILL, DECODE, ADMIN = 18000, 18100, 18200, 18900
MODEL = "tiny-qwen3"
HERE = os.path.dirname(os.path.abspath(__file__))
STACK = os.path.join(HERE, "stack.sh")
TIMEOUT_S = 300
MAX_TOKENS = 2


def post(port, path, body, headers=None, stream=False):
    """Non-streaming: (seconds, parsed body). Streaming: (seconds to first text chunk, None)."""
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    hdrs = {"Content-Type": "application/json", "Connection": "close", **(headers or {})}
    t0 = time.perf_counter()
    conn.request("POST", path, body=data, headers=hdrs)
    resp = conn.getresponse()
    if not stream:
        raw = resp.read()
        t1 = time.perf_counter()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"{port}{path}: HTTP {resp.status}: {raw[:300]!r}")
        return t1 - t0, json.loads(raw)
    if resp.status != 200:
        raise RuntimeError(f"{port}{path}: HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft = None
    for _ in range(10_000):  # bounded: a few chunks are expected
        line = resp.fp.readline()
        if not line:
            break
        line = line.strip()
        if line == b"data: [DONE]":
            break
        if not line.startswith(b"data: "):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(f"{port}{path}: stream error {ev}")
        for ch in ev.get("choices") or []:
            d = ch.get("delta") or {}
            if ttft is None and (d.get("content") or d.get("reasoning") or d.get("reasoning_content")):
                ttft = time.perf_counter() - t0
    conn.close()
    if ttft is None:
        raise RuntimeError(f"{port}{path}: no generated text in the stream")
    return ttft, None


def build_messages(target, src_root):
    """bench_tokenize.py's prompt: code-review turns over vllm's own sources, ~target tokens."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src_root) for f in fs if f.endswith(".py"))
    tok = lambda msgs: post(DECODE, "/tokenize", {"model": MODEL, "messages": msgs, "add_generation_prompt": True})[1]
    messages = [{"role": "system", "content": "You are a careful senior engineer reviewing code."}]
    count, i = 0, 0
    while count < target and i < len(files):
        with open(files[i], encoding="utf-8", errors="replace") as fh:
            text = fh.read()[:12000]
        rel = os.path.relpath(files[i], src_root)
        messages.append({"role": "user", "content": f"Review {rel}:\n```python\n{text}\n```"})
        messages.append({"role": "assistant", "content": f"The file {rel} looks fine; "
                         f"it has {text.count(chr(10))} lines. Next?"})
        i += 1
        if i % 4 == 0:
            count = tok(messages + [{"role": "user", "content": "Summarize."}])["count"]
    for _ in range(40):  # shorten the last reviewed file until within 1% of the target
        msgs = messages + [{"role": "user", "content": "Summarize all reviews in one line."}]
        r = tok(msgs)
        over = r["count"] - target
        if over <= target * 0.01 or len(messages) < 4:
            break
        last = messages[-2]["content"]
        cut = int(over * 3.5) + 1
        if cut >= len(last) - 100:
            messages = messages[:-2]
        else:
            messages[-2] = dict(messages[-2], content=last[:-cut])
    return msgs, r["tokens"]


def pct(xs, q):
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def summary(xs):
    ms = [x * 1000 for x in xs]
    return {"median": statistics.median(ms), "p90": pct(ms, 90), "min": min(ms), "max": max(ms), "n": len(ms)}


def measure(chat, ids, runs, pause):
    """Interleaved runs of the four measurements; returns {name: [seconds]}."""
    decode_on = dict(chat, kv_transfer_params={"prompt_token_ids": ids})
    kinds = {
        "client_off": lambda: post(TOKENONCE, "/v1/chat/completions", chat, {"x-e2e-route": "off"}, True)[0],
        "client_on": lambda: post(TOKENONCE, "/v1/chat/completions", chat, None, True)[0],
        "decode_off": lambda: post(DECODE, "/v1/chat/completions", chat, None, True)[0],
        "decode_on": lambda: post(DECODE, "/v1/chat/completions", decode_on, None, True)[0],
    }
    names = list(kinds)
    out = {k: [] for k in names}
    for i in range(runs):
        order = names[i % 4:] + names[:i % 4]  # rotate, so no kind always follows another
        if i % 2:
            order.reverse()
        for k in order:
            time.sleep(pause)
            out[k].append(kinds[k]())
        print(f"  run {i + 1}/{runs}: " + "  ".join(f"{k} {out[k][-1] * 1000:.0f}" for k in names),
              file=sys.stderr, flush=True)
    return out


def cpu_pressure_total():
    """Microseconds some task waited for a CPU (Linux PSI), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None


def timed_phase(fn):
    """Runs fn(); returns (its result, % of the time some task waited for a CPU)."""
    p0, t0 = cpu_pressure_total(), time.perf_counter()
    out = fn()
    p1, t1 = cpu_pressure_total(), time.perf_counter()
    share = None if p0 is None or p1 is None else 100.0 * (p1 - p0) / 1e6 / (t1 - t0)
    return out, share


def stack(*args):
    # no trace export in a benchmark run unless asked for (E2E_TRACING=1)
    env = {**os.environ, "E2E_TRACING": os.environ.get("E2E_TRACING", "0")}
    subprocess.run(["bash", STACK, *args], check=True, env=env)


def stack_up():
    probe = subprocess.run(["bash", STACK, "status"], capture_output=True, text=True)
    return "not ready" not in probe.stdout and "down" not in probe.stdout


def row(label, what, res):
    off, on = summary(res[f"{what}_off"]), summary(res[f"{what}_on"])
    return (f"| {label} | {off['median']:.0f} | {off['p90']:.0f} | {on['median']:.0f} | {on['p90']:.0f} | "
            f"{on['median'] / off['median']:.2f} | {on['p90'] / off['p90']:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=15, help="runs of each measurement, prefix cache warm")
    ap.add_argument("--cold-runs", type=int, default=None, help="runs with prefix caching off (default --runs)")
    ap.add_argument("--tokens", type=int, default=37000)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between requests (noisier when > 0 here)")
    ap.add_argument("--skip-cold", action="store_true", help="no run with the decode's prefix caching off")
    ap.add_argument("--json", help="also write the raw samples here")
    a = ap.parse_args()
    cold_runs = a.runs if a.cold_runs is None else a.cold_runs
    t_start = time.perf_counter()

    started_here = not stack_up()
    if started_here:
        stack("up")
    try:
        spec = importlib.util.find_spec("vllm")
        if spec is None:
            sys.exit("run with the vLLM venv's python (vllm's sources make the prompt)")
        msgs, tokenized = build_messages(a.tokens, os.path.dirname(spec.origin))
        chars = sum(len(m["content"]) for m in msgs)
        chat = {"model": MODEL, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        # the ids tokenonce relays: a prefill call with return_token_ids
        _, pre = post(PREFILL, "/v1/chat/completions",
                      dict(chat, stream=False, max_tokens=1, return_token_ids=True))
        ids = pre["prompt_token_ids"]
        assert ids == tokenized, "the prefill's ids differ from /tokenize"
        print(f"prompt: {len(msgs)} messages, {chars} chars, {len(ids)} tokens", file=sys.stderr)
        # the decode gives the same output from the ids as from the messages
        _, plain = post(DECODE, "/v1/chat/completions", dict(chat, stream=False, return_token_ids=True))
        _, token_in = post(DECODE, "/v1/chat/completions",
                           dict(chat, stream=False, return_token_ids=True, kv_transfer_params={"prompt_token_ids": ids}))
        assert plain["choices"][0]["token_ids"] == token_in["choices"][0]["token_ids"]
        assert plain["usage"]["prompt_tokens"] == token_in["usage"]["prompt_tokens"] == len(ids)

        results, pressure = {}, {}
        print("phase 1: decode prefix cache warm", file=sys.stderr)
        for _ in range(2):  # warm both servers' prefix caches and code paths
            measure(chat, ids, 1, a.pause)
        results["warm"], pressure["warm"] = timed_phase(lambda: measure(chat, ids, a.runs, a.pause))
        if not a.skip_cold:
            print("phase 2: decode restarted with --no-enable-prefix-caching", file=sys.stderr)
            stack("restart-decode", "--no-enable-prefix-caching")
            try:
                measure(chat, ids, 1, a.pause)  # warm the code paths (no cache to warm)
                results["nocache"], pressure["nocache"] = timed_phase(
                    lambda: measure(chat, ids, cold_runs, a.pause))
            finally:
                if not started_here:
                    stack("restart-decode")  # give the stack back as it was
    finally:
        if started_here:
            stack("down")

    print()
    print(f"Prompt: {len(msgs)} messages, {chars} characters, {len(ids)} tokens; "
          f"{a.runs} runs each (prefix caching off: {cold_runs}), interleaved; max_tokens {MAX_TOKENS}; "
          f"TTFT in ms; wall time {time.perf_counter() - t_start:.0f} s.")
    print()
    print("| TTFT (ms) | reuse off median | off p90 | reuse on median | on p90 | on/off median | on/off p90 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    labels = {"warm": "decode prefix cache warm", "nocache": "decode prefix caching off"}
    for phase, res in results.items():
        print(row(f"client, through tokenonce ({labels[phase]})", "client", res))
        print(row(f"decode alone, its leg sent directly ({labels[phase]})", "decode", res))
    print()
    for phase, res in results.items():
        d = {k: summary(v)["median"] for k, v in res.items()}
        psi = "n/a" if pressure[phase] is None else f"{pressure[phase]:.0f}%"
        lo = {k: summary(v)["min"] for k, v in res.items()}
        print(f"- {labels[phase]}: reuse saved {d['client_off'] - d['client_on']:.0f} ms of the client's median "
              f"TTFT and {d['decode_off'] - d['decode_on']:.0f} ms of the decode's; min off/on: client "
              f"{lo['client_off']:.0f}/{lo['client_on']:.0f}, decode {lo['decode_off']:.0f}/{lo['decode_on']:.0f} ms; "
              f"CPU pressure (PSI some) during the runs {psi}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"prompt_tokens": len(ids), "messages": len(msgs), "chars": chars, "cpu_pressure": pressure,
                       "samples_ms": {p: {k: [round(x * 1000, 2) for x in v] for k, v in r.items()}
                                      for p, r in results.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
