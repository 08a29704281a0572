#!/usr/bin/env python3
"""vLLM's toy proxy, tokenonce as today, and tokenonce with local ids, side by side in front of
the same two NIXL servers, at concurrency 1 and 16.

A benchmark command, not a test. Uses the tier's pair (tests/e2e/stack.sh: prefill vLLM :18100,
decode vLLM :18200, NixlConnector on CPU; started here with E2E_TRACING=0 if not up, and stopped
again at the end). In front of them, interleaved round by round:

  toy proxy          vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py on :18500
                     (found at $TOKENONCE_PEERS/toy_proxy_server.py; benches/peers.sh fetches it)
  tokenonce          the release build (target/release/tokenonce, else the debug one, said in
                     the output) on :18010: prefill with the echo, decode token-in
  tokenonce local    the same process, route chosen by `x-bench-route: local`: its prefill pool
                     has `local_ids = "on"` (verify after 1 match, no recheck), so once the
                     shape matched, both legs go token-in with tokenonce's own ids
  by hand            this script sending both legs token-in itself (ids from /tokenize, asked
                     before the round and outside its CPU window): the floor

Every proxy reaches the engines through two timing pipes of this process, :18102 -> prefill and
:18202 -> decode, which note per request when its last byte passed and when the answer came
back: "prefill leg" is the prefill engine's time from the request's end to its answer, "decode
TTFT" the decode engine's to its first generated text. "Client TTFT" is from sending the
request to the first SSE chunk with generated text. "API CPU" is the utime+stime that each vLLM
server's API-server process (the pid start.sh wrote; its EngineCore is another process) spent
over a round, per request: rendering and tokenizing live there.

The prompt: a multi-turn code-review chat built from vllm's own sources (bench_ttft.py's), at
--tokens (default 45,000, near the model's 49,152 limit). Warm prefix: the conversation is
sent first, and every measured request appends one new user turn of its own, so the engines
find the history in their prefix caches and only the new turn is computed (prefill) or pulled
(decode). A round is C requests at once through one proxy; rounds rotate over the proxies.

Usage: VENV/bin/python tests/e2e/bench_pd.py [--runs 16] [--tokens 45000] [--concurrency 1,16]
       [--json FILE]
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bench_ttft  # noqa: E402  (post, build_messages, summary)

HOST = "127.0.0.1"
PREFILL, DECODE, PREFILL_PIPE, DECODE_PIPE = 18100, 18200, 18102, 18202
TOKENONCE, TOKENONCE_ADMIN, TOY = 18010, 18910, 18500  # 18300: the second prefill
STACK = os.path.join(HERE, "stack.sh")
RUN_DIR = os.environ.get("E2E_RUN_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenonce-e2e"))
VENV = os.environ.get("TOKENONCE_VLLM_VENV", os.path.expanduser("~/.cache/tokenonce-vllm-venv"))
MODEL_DIR = os.environ.get("TOKENONCE_VLLM_MODEL_DIR", os.path.join(VENV, "models", "tiny-qwen3"))
TEXT = re.compile(rb'"(?:content|reasoning|reasoning_content)":"[^"]')
REQUEST_LINE = re.compile(rb"^(?:GET|POST|PUT|DELETE|HEAD|OPTIONS|PATCH) /")
PEERS = os.environ.get("TOKENONCE_PEERS", os.path.expanduser("~/.cache/tokenonce-peers"))
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
TICK = os.sysconf("SC_CLK_TCK")
ROUTE = ('mode = "orchestrate"\ndecode_pool = "decode"\n'
         'prefill_timeout_ms = 600000\ndecode_first_byte_timeout_ms = 600000\n')
CONFIG = """[server]
listen = "{host}:{port}"
admin_listen = "{host}:{admin}"
threads = 2
log_level = "warn"

[pools.prefill]
endpoints = ["{host}:{prefill}"]

[pools.prefill_local]
endpoints = ["{host}:{prefill}"]
tokenizer = "{model_dir}"
local_ids = "on"
local_ids_verify_after = 1
local_ids_recheck = 0.0

[pools.decode]
endpoints = ["{host}:{decode}"]

[[routes]]
name = "local"
{route}prefill = {{ pool = "prefill_local" }}
[routes.match]
paths = ["/v1/chat/completions"]
headers = {{ "x-bench-route" = "local" }}

[[routes]]
name = "pd"
{route}prefill = {{ pool = "prefill" }}
[routes.match]
paths = ["/v1/chat/completions"]
"""


class TimingPipe:
    """127.0.0.1:listen -> upstream; per POST on each connection (the proxies' health polls are
    not timed), the seconds from its last byte to the answer (its first byte, or with `text`
    its first generated text), collected in `samples` (taken by the caller between rounds)."""

    def __init__(self, listen, upstream, text):
        self.upstream, self.text = upstream, text
        self.samples, self.lock = [], threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, listen))
        self.sock.listen(256)
        threading.Thread(target=self.serve, daemon=True).start()

    def take(self):
        with self.lock:
            out, self.samples = self.samples, []
        return out

    def serve(self):
        while True:
            inbound, _ = self.sock.accept()
            outbound = socket.create_connection((HOST, self.upstream))
            state = {"sent": None, "seen": True}
            threading.Thread(target=self.forward_request, args=(inbound, outbound, state), daemon=True).start()
            threading.Thread(target=self.forward_answer, args=(outbound, inbound, state), daemon=True).start()

    def forward_request(self, src, dst, state):
        try:
            while data := src.recv(1 << 16):
                if REQUEST_LINE.match(data):  # a request begins: only POSTs are timed (not polls)
                    state["post"] = data.startswith(b"POST ")
                dst.sendall(data)
                state["sent"] = time.perf_counter()  # the last byte so far of this request
                state["seen"] = not state.get("post")
        except OSError:
            pass
        finally:
            dst.close()

    def forward_answer(self, src, dst, state):
        try:
            while data := src.recv(1 << 16):
                if not state["seen"] and state["sent"] is not None and (not self.text or TEXT.search(data)):
                    state["seen"] = True
                    with self.lock:
                        self.samples.append(time.perf_counter() - state["sent"])
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()


def wait_http(port, path, deadline_s=60):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with socket.create_connection((HOST, port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                if s.recv(12).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.3)
    sys.exit(f"nothing answered 200 on :{port}{path} within {deadline_s} s")


def start_tokenonce(tmp):
    binary = next((b for b in (os.path.join(ROOT, "target/release/tokenonce"), os.path.join(ROOT, "target/debug/tokenonce"))
                   if os.access(b, os.X_OK)), None)
    if binary is None:
        sys.exit("no tokenonce binary: cargo build --release")
    conf = os.path.join(tmp, "bench-pd.toml")
    with open(conf, "w") as f:
        f.write(CONFIG.format(host=HOST, port=TOKENONCE, admin=TOKENONCE_ADMIN, prefill=PREFILL_PIPE,
                              decode=DECODE_PIPE, model_dir=MODEL_DIR, route=ROUTE))
    proc = subprocess.Popen([binary, "--config", conf], stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(tmp, "tokenonce.log"), "w"))
    wait_http(TOKENONCE_ADMIN, "/readyz")
    return proc, binary


def start_toy(tmp):
    toy = os.path.join(PEERS, "toy_proxy_server.py")
    if not os.path.exists(toy):
        sys.exit(f"no {toy}: run benches/peers.sh, or copy vLLM's tests/v1/kv_connector/nixl_integration/"
                 f"toy_proxy_server.py (vLLM >= 0.32) there")
    proc = subprocess.Popen([sys.executable, toy, "--port", str(TOY), "--prefiller-host", HOST, "--prefiller-port",
                             str(PREFILL_PIPE), "--decoder-host", HOST, "--decoder-port", str(DECODE_PIPE)],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "toy.log"), "w"))
    wait_http(TOY, "/healthcheck")
    return proc


def cpu_seconds(pid):
    """utime + stime of one process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def server_pid(port):
    with open(os.path.join(RUN_DIR, f"vllm-{port}.pid")) as f:
        return int(f.read().strip())


def metric_sum(text, name, **labels):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Bench:
    """The proxies, the pipes and the prompt; `round_of` runs C requests through one proxy."""

    def __init__(self, history, pids):
        self.history, self.pids = history, pids
        self.prefill_pipe = TimingPipe(PREFILL_PIPE, PREFILL, False)
        self.decode_pipe = TimingPipe(DECODE_PIPE, DECODE, True)
        self.proxy_pid = {}
        self.proxies = {"toy proxy": self.via(TOY), "tokenonce": self.via(TOKENONCE),
                        "tokenonce local": self.via(TOKENONCE, {"x-bench-route": "local"}), "by hand": self.by_hand}

    def body(self, turn, **extra):
        return {"model": bench_ttft.MODEL, "max_tokens": 2, "temperature": 0, "stream": True, **extra,
                "messages": self.history + [{"role": "user", "content": f"Question {turn}: what did file {turn} do?"}]}

    def via(self, port, headers=None):
        return lambda turn, _ids: bench_ttft.post(port, "/v1/chat/completions", self.body(turn), headers, True)[0]

    def by_hand(self, turn, prompt):
        """Both legs token-in, sent by this script: from the prefill's send to the first text."""
        t0 = time.perf_counter()
        kv = dict(REMOTE_DECODE, prompt_token_ids=prompt)
        _, pre = bench_ttft.post(PREFILL_PIPE, "/v1/chat/completions",
                                 self.body(turn, stream=False, max_tokens=1, kv_transfer_params=kv))
        t1 = time.perf_counter()
        handoff = dict(pre["kv_transfer_params"], prompt_token_ids=prompt)
        ttft, _ = bench_ttft.post(DECODE_PIPE, "/v1/chat/completions", self.body(turn, kv_transfer_params=handoff),
                                  None, True)
        return t1 - t0 + ttft

    def tokenize(self, turn):
        body = {"model": bench_ttft.MODEL, "messages": self.body(turn)["messages"], "add_generation_prompt": True}
        return bench_ttft.post(DECODE, "/tokenize", body)[1]["tokens"]

    def round_of(self, name, c, tag):
        """C requests at once through `name`: client TTFTs, the pipes' samples, CPU per request."""
        turns = [f"{tag}-{k}" for k in range(c)]
        prompts = [self.tokenize(t) for t in turns] if name == "by hand" else [None] * c
        self.prefill_pipe.take(), self.decode_pipe.take()
        watched = dict(self.pids, proxy=self.proxy_pid.get(name))
        before = {k: cpu_seconds(p) for k, p in watched.items() if p}
        client, errors = [None] * c, []

        def one(k):
            try:
                client[k] = self.proxies[name](turns[k], prompts[k])
            except Exception as e:  # noqa: BLE001  (reported after the round)
                errors.append(repr(e))

        threads = [threading.Thread(target=one, args=(k,)) for k in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        if len(errors) == c:
            sys.exit(f"{name}: every request failed: {errors[0]}")
        for e in errors:  # counted and shown: a proxy's failures are part of its result
            print(f"  {name}: {e[:200]}", flush=True)
        time.sleep(0.05)  # the pipes saw the answers just before the client did
        cpu = {k: (cpu_seconds(p) - before[k]) / c for k, p in watched.items() if p}
        answered = [t for t in client if t is not None]
        return answered, self.prefill_pipe.take(), self.decode_pipe.take(), cpu, c - len(answered)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=16, help="rounds per proxy and concurrency")
    ap.add_argument("--tokens", type=int, default=45000)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--json")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    was_up = subprocess.run(["bash", STACK, "status"], capture_output=True, text=True).stdout.count(" up") >= 2
    if not was_up:
        subprocess.run(["bash", STACK, "up"], check=True, env={**os.environ, "E2E_TRACING": "0"})
    tmp = tempfile.mkdtemp(prefix="bench-pd-")
    procs = []
    try:
        import vllm  # noqa: F401  (the prompt is built from the installed vllm's sources)
        src = os.path.dirname(sys.modules["vllm"].__file__)
        history, ids = bench_ttft.build_messages(args.tokens, src)
        history = history[:-1]  # build_messages ends with a "Summarize" turn: ours replaces it
        bench = Bench(history, {"prefill": server_pid(PREFILL), "decode": server_pid(DECODE)})
        tok_proc, binary = start_tokenonce(tmp)
        toy_proc = start_toy(tmp)
        procs += [tok_proc, toy_proc]
        bench.proxy_pid = {"toy proxy": toy_proc.pid, "tokenonce": tok_proc.pid, "tokenonce local": tok_proc.pid}
        print(f"prompt: {len(history)} messages, ~{len(ids)} tokens; tokenonce {binary}", flush=True)
        results = {}
        names = list(bench.proxies)
        for c in levels:
            for name in names:  # warm every path (and let local ids verify the shape)
                bench.round_of(name, 1, f"warm-{c}-{name}")
                bench.round_of(name, 1, f"warm2-{c}-{name}")
            got = {n: {"client": [], "prefill": [], "decode": [], "cpu": [], "errors": 0} for n in names}
            for i in range(args.runs):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    client, pre, dec, cpu, failed = bench.round_of(name, c, f"c{c}-r{i}-{name}")
                    got[name]["errors"] += failed
                    got[name]["client"] += client
                    got[name]["prefill"] += pre
                    got[name]["decode"] += dec
                    got[name]["cpu"].append(cpu)
                print(f"  C={c} round {i + 1}/{args.runs} done", flush=True)
            results[c] = got
        metrics = urllib.request.urlopen(f"http://{HOST}:{TOKENONCE_ADMIN}/metrics", timeout=10).read().decode()
        local = {"token_in": metric_sum(metrics, "tokenonce_local_ids_token_in_total"),
                 "matches": metric_sum(metrics, "tokenonce_local_ids_checks_total", result="match"),
                 "mismatches": metric_sum(metrics, "tokenonce_local_ids_checks_total", result="mismatch")}
        report(results, args, len(ids), binary, local)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if not was_up:
            subprocess.run(["bash", STACK, "down"])


def report(results, args, tokens, binary, local):
    out = {"tokens": tokens, "runs": args.runs, "binary": binary, "local_ids": local, "levels": {}}
    print(f"\n~{tokens}-token multi-turn chat, warm prefix, max_tokens 2, streamed; {args.runs} interleaved "
          f"rounds per proxy and concurrency; tokenonce local ids: {local['token_in']:.0f} prefills token-in, "
          f"{local['matches']:.0f} matches, {local['mismatches']:.0f} mismatches\n")
    print("| C | proxy | client TTFT p50 ms | p90 | prefill leg p50 ms | decode TTFT p50 ms | "
          "prefill API CPU ms/req | decode API CPU ms/req | proxy CPU ms/req | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c, got in results.items():
        level = {}
        for name, g in got.items():
            cl, pre, dec = (bench_ttft.summary(g[k]) for k in ("client", "prefill", "decode"))
            cpu = {k: 1000 * statistics.mean(r.get(k, 0.0) for r in g["cpu"]) for k in ("prefill", "decode", "proxy")}
            level[name] = {"client": cl, "prefill": pre, "decode": dec, "cpu_ms": cpu, "failed": g["errors"]}
            proxy_cpu = "-" if name == "by hand" else f"{cpu['proxy']:.1f}"
            print(f"| {c} | {name} | {cl['median']:.1f} | {cl['p90']:.1f} | {pre['median']:.1f} | {dec['median']:.1f} | "
                  f"{cpu['prefill']:.1f} | {cpu['decode']:.1f} | {proxy_cpu} | {g['errors']} |")
        toy = level["toy proxy"]["client"]
        for name in ("tokenonce", "tokenonce local", "by hand"):
            mine = level[name]["client"]
            print(f"| {c} | {name} / toy proxy | {mine['median'] / toy['median']:.2f} | "
                  f"{mine['p90'] / toy['p90']:.2f} | | | | | | |")
        out["levels"][c] = level
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
