#!/usr/bin/env python3
"""tokenonce and vLLM's toy proxy side by side, in front of the same two NIXL servers.

A benchmark command, not a test. Uses the tier's pair (tests/e2e/stack.sh: prefill vLLM :18100,
decode vLLM :18200, NixlConnector on CPU; started here with E2E_TRACING=0 if not up, and stopped
again at the end). In front of them, one at a time, interleaved:

  tokenonce  the release build (target/release/tokenonce, else the debug one, said in the output)
             on :18010 with the prefill pool :18100 and the decode pool :18202
  toy proxy  vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py on :18300, prefill
             :18100, decode :18202 (found at $TOKENONCE_PEERS/toy_proxy_server.py; benches/peers.sh
             installs it, or copy that file from any vLLM >= 0.32 checkout there)

:18202 is a timing pipe to the decode (this process): for each decode leg it notes when the
request's last byte passed and when the first generated text came back, so "decode TTFT" is
the decode engine's own time to first token as the wire sees it, the same hop for both.
"Client TTFT" is from sending the request to the first SSE chunk with generated text.

The prompt: a multi-turn code-review chat built from vllm's own sources (bench_ttft.py's),
at --tokens (default 45,000, near the model's 49,152 limit). Warm prefix: the conversation is
sent once first, and every measured run appends one new user turn, so both engines find the
history in their prefix caches and only the new turn is computed (prefill) or pulled (decode).

Usage: VENV/bin/python tests/e2e/bench_pd.py [--runs 16] [--tokens 45000] [--json FILE]
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import bench_ttft  # noqa: E402  (post, build_messages, summary)

HOST = "127.0.0.1"
PREFILL, DECODE, PIPE, TOKENONCE, TOKENONCE_ADMIN, TOY = 18100, 18200, 18202, 18010, 18910, 18300
STACK = os.path.join(HERE, "stack.sh")
TEXT = re.compile(rb'"(?:content|reasoning|reasoning_content)":"[^"]')
PEERS = os.environ.get("TOKENONCE_PEERS", os.path.expanduser("~/.cache/tokenonce-peers"))


class TimingPipe:
    """127.0.0.1:PIPE -> the decode; per connection, the last request's end and its first
    generated text, as perf_counter times."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, PIPE))
        self.sock.listen(64)
        self.last = None  # (request end, first text)
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            inbound, _ = self.sock.accept()
            outbound = socket.create_connection((HOST, DECODE))
            state = {"sent": None}
            threading.Thread(target=self.upstream, args=(inbound, outbound, state), daemon=True).start()
            threading.Thread(target=self.downstream, args=(outbound, inbound, state), daemon=True).start()

    def upstream(self, src, dst, state):
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                state["sent"] = time.perf_counter()  # the last byte so far of this request
                state["seen"] = False
        except OSError:
            pass
        finally:
            dst.close()

    def downstream(self, src, dst, state):
        try:
            while data := src.recv(1 << 16):
                if not state.get("seen") and state["sent"] is not None and TEXT.search(data):
                    state["seen"] = True
                    self.last = (state["sent"], time.perf_counter())
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
        f.write(f'''[server]
listen = "{HOST}:{TOKENONCE}"
admin_listen = "{HOST}:{TOKENONCE_ADMIN}"
threads = 2
log_level = "warn"

[pools.prefill]
endpoints = ["{HOST}:{PREFILL}"]

[pools.decode]
endpoints = ["{HOST}:{PIPE}"]

[[routes]]
name = "pd"
mode = "orchestrate"
decode_pool = "decode"
prefill = {{ pool = "prefill" }}
prefill_timeout_ms = 600000
decode_first_byte_timeout_ms = 600000
[routes.match]
paths = ["/v1/chat/completions"]
''')
    proc = subprocess.Popen([binary, "--config", conf], stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "tokenonce.log"), "w"))
    wait_http(TOKENONCE_ADMIN, "/readyz")
    return proc, binary


def start_toy(tmp):
    toy = os.path.join(PEERS, "toy_proxy_server.py")
    if not os.path.exists(toy):
        sys.exit(f"no {toy}: run benches/peers.sh, or copy vLLM's tests/v1/kv_connector/nixl_integration/"
                 f"toy_proxy_server.py (vLLM >= 0.32) there")
    proc = subprocess.Popen([sys.executable, toy, "--port", str(TOY), "--prefiller-host", HOST, "--prefiller-port",
                             str(PREFILL), "--decoder-host", HOST, "--decoder-port", str(PIPE)],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "toy.log"), "w"))
    wait_http(TOY, "/healthcheck")
    return proc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=45000)
    ap.add_argument("--json")
    args = ap.parse_args()
    was_up = subprocess.run(["bash", STACK, "status"], capture_output=True, text=True).stdout.count(" up") >= 2
    if not was_up:
        subprocess.run(["bash", STACK, "up"], check=True, env={**os.environ, "E2E_TRACING": "0"})
    pipe = TimingPipe()
    tmp = tempfile.mkdtemp(prefix="bench-pd-")
    procs = []
    try:
        tok_proc, binary = start_tokenonce(tmp)
        procs += [tok_proc, start_toy(tmp)]
        import vllm  # noqa: F401  (the prompt is built from the installed vllm's sources)
        src = os.path.dirname(sys.modules["vllm"].__file__)
        history, ids = bench_ttft.build_messages(args.tokens, src)
        history = history[:-1]  # build_messages ends with a "Summarize" turn: ours replaces it
        print(f"prompt: {len(history)} messages, ~{len(ids)} tokens; tokenonce {binary}", flush=True)
        proxies = {"tokenonce": TOKENONCE, "toy proxy": TOY}

        def run(port, turn):
            body = {"model": bench_ttft.MODEL, "max_tokens": 2, "temperature": 0, "stream": True,
                    "messages": history + [{"role": "user", "content": f"Question {turn}: what did file {turn} do?"}]}
            pipe.last = None
            client, _ = bench_ttft.post(port, "/v1/chat/completions", body, None, True)
            for _ in range(50):  # the pipe saw the text just before the client did
                if pipe.last:
                    break
                time.sleep(0.01)
            sent, first = pipe.last
            return client, first - sent

        for name, port in reversed(proxies.items()):  # warm both engines' prefix caches, and each path
            run(port, "warm")
            run(port, "warm-2")
        got = {name: {"client": [], "decode": []} for name in proxies}
        for i in range(args.runs):
            order = list(proxies.items()) if i % 2 == 0 else list(reversed(proxies.items()))
            for name, port in order:
                client, decode = run(port, f"{i}-{name}")
                got[name]["client"].append(client)
                got[name]["decode"].append(decode)
        print(f"\n{args.runs} interleaved runs each, ~{len(ids)}-token multi-turn chat, warm prefix, "
              f"max_tokens 2, streamed\n")
        print("| ms | client TTFT p50 | client TTFT p90 | decode TTFT p50 | decode TTFT p90 |")
        print("|---|---|---|---|---|")
        out = {}
        for name in proxies:
            c, d = bench_ttft.summary(got[name]["client"]), bench_ttft.summary(got[name]["decode"])
            out[name] = {"client": c, "decode": d}
            print(f"| {name} | {c['median']:.1f} | {c['p90']:.1f} | {d['median']:.1f} | {d['p90']:.1f} |")
        t, y = out["tokenonce"], out["toy proxy"]
        print(f"| tokenonce / toy | {t['client']['median'] / y['client']['median']:.2f} | "
              f"{t['client']['p90'] / y['client']['p90']:.2f} | {t['decode']['median'] / y['decode']['median']:.2f} | "
              f"{t['decode']['p90'] / y['decode']['p90']:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tokens": len(ids), "runs": args.runs, "binary": binary, **out}, f, indent=2)
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


if __name__ == "__main__":
    main()
