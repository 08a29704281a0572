#!/usr/bin/env python3
"""A two-port fake vLLM for the image smoke (tests/image/smoke.sh), stdlib only: a prefill and
a decode engine on 127.0.0.1 that answer with the recorded bodies in tests/fixtures/vllm/
(health, version, models, a chat prefill and a chat decode on prompt ids) and append every
request they get to a JSON-lines log, so the smoke can check what tokenonce sent each leg.

    fake_engine.py --prefill-port 8100 --decode-port 8200 --log requests.jsonl [--max-seconds 300]
"""

import argparse
import json
import pathlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "vllm"


def recorded(name):
    """(status, content-type, body bytes) of one recording."""
    rec = json.loads((FIXTURES / f"{name}.json").read_text())
    ctype = rec.get("response_headers", {}).get("content-type", "application/json")
    return rec["status"], ctype, rec["response_body"].encode()


def answer(role, method, path, body):
    """The recording a vLLM prefill or decode engine would answer this request with."""
    if method == "GET":
        gets = {"/health": "get_health", "/version": "get_version", "/v1/models": "get_models"}
        return recorded(gets[path]) if path in gets else (404, "application/json", b'{"detail":"Not Found"}')
    if path != "/v1/chat/completions":
        return 404, "application/json", b'{"detail":"Not Found"}'
    kv = json.loads(body or b"{}").get("kv_transfer_params") or {}
    if role == "prefill" and kv.get("do_remote_decode") is True:
        return recorded("chat_prefill")
    if role == "decode" and kv.get("do_remote_prefill") is True:
        return recorded("chat_decode_ids")
    # Anything else means tokenonce sent a leg to the wrong engine or without its P/D fields.
    return 400, "application/json", b'{"error":{"message":"fake: not a P/D leg","code":400}}'


def serve(role, port, log, lock):
    """Starts one engine on 127.0.0.1:port in a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def handle_one(self, method):
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            with lock, open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"role": role, "method": method, "path": self.path,
                                    "body": body.decode("utf-8", "replace")}) + "\n")
            status, ctype, out = answer(role, method, self.path, body)
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_GET(self):
            self.handle_one("GET")

        def do_POST(self):
            self.handle_one("POST")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill-port", type=int, default=8100)
    ap.add_argument("--decode-port", type=int, default=8200)
    ap.add_argument("--log", required=True)
    ap.add_argument("--max-seconds", type=float, default=300, help="exit after this long (a bound for CI)")
    args = ap.parse_args()
    lock = threading.Lock()
    serve("prefill", args.prefill_port, args.log, lock)
    serve("decode", args.decode_port, args.log, lock)
    print("fake engines ready", flush=True)
    time.sleep(args.max_seconds)


if __name__ == "__main__":
    main()
