"""tokenonce's own errors as the official SDKs read them: the Anthropic SDK on `/v1/messages`
and the OpenAI SDK on `/v1/responses` each raise their typed error for a request tokenonce
refuses (400) or cannot serve (502), and see the API's own error event when a decode stream
breaks mid-way (Anthropic: `event: error` raised as `APIStatusError`; Responses: the typed
`ResponseErrorEvent`, numbered after the last event).

Self-contained: no vLLM. It starts a fake engine in this process (a Python HTTP server on
127.0.0.1, port 0: a prefill answer with `kv_transfer_params`, then a decode stream that
breaks after two events) and the tokenonce binary on it (127.0.0.1, port 0).

Run (after `cargo build --locked --bin tokenonce`):
    ~/.cache/tokenonce-vllm-venv/bin/python -m pytest -q tests/e2e/test_error_formats_e2e.py
TOKENONCE_BIN names the binary (default: $CARGO_TARGET_DIR or target/, then debug/tokenonce).
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL = "tiny-qwen3"
KV = {"do_remote_prefill": True, "remote_engine_id": "fake", "remote_block_ids": [[1]], "remote_request_id": "r1"}


def sse(kind, data):
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def responses_events():
    response = {"id": "resp_1", "object": "response", "created_at": 0, "model": MODEL, "status": "in_progress",
                "output": [], "tools": [], "parallel_tool_calls": True, "tool_choice": "none"}
    return [
        sse("response.created", {"type": "response.created", "response": response, "sequence_number": 0}),
        sse("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1",
                                           "output_index": 0, "content_index": 0, "delta": "Hi",
                                           "logprobs": [], "sequence_number": 1}),
    ]


def messages_events():
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL,
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
    return [
        sse("message_start", {"type": "message_start", "message": message}),
        sse("content_block_start", {"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "text", "text": ""}}),
    ]


class Engine(BaseHTTPRequestHandler):
    """A prefill and decode in one: a prefill leg (`do_remote_decode`) gets JSON with
    `kv_transfer_params`; a decode leg gets two SSE events and then a cut connection."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body):
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/version":
            self.reply(200, b'{"version":"0.32.0"}')
        elif self.path == "/v1/models":
            model = {"id": MODEL, "object": "model", "root": MODEL, "max_model_len": 49152}
            self.reply(200, json.dumps({"object": "list", "data": [model]}).encode())
        else:
            self.reply(200, b"")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        usage = {"input_tokens": 3, "output_tokens": 1}
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            answer = {"id": "x", "object": "response", "type": "message", "status": "completed", "output": [],
                      "content": [], "model": MODEL, "usage": usage, "kv_transfer_params": KV}
            self.reply(200, json.dumps(answer).encode())
            return
        events = responses_events() if self.path == "/v1/responses" else messages_events()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for event in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.flush()
        time.sleep(0.05)
        # The engine dies: no last chunk, the connection is cut.
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)


def tokenonce_binary():
    if os.environ.get("TOKENONCE_BIN"):
        return pathlib.Path(os.environ["TOKENONCE_BIN"])
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "debug" / "tokenonce"


@pytest.fixture(scope="module")
def proxy():
    binary = tokenonce_binary()
    if not binary.is_file():
        pytest.fail(f"no tokenonce binary at {binary}: cargo build --locked --bin tokenonce, or set TOKENONCE_BIN")
    engine = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    refused = socket.socket()  # bound, never listening: connects are refused
    refused.bind(("127.0.0.1", 0))
    live, dead = f"127.0.0.1:{engine.server_address[1]}", f"127.0.0.1:{refused.getsockname()[1]}"
    paths = '["/v1/responses", "/v1/messages"]'
    config = f"""
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
threads = 1
grace_period_seconds = 1
graceful_shutdown_timeout_seconds = 1

[pools.prefill]
endpoints = ["{live}"]

[pools.decode]
endpoints = ["{live}"]

[pools.dead]
endpoints = ["{dead}"]

[[routes]]
name = "dead"
mode = "orchestrate"
decode_pool = "dead"
prefill = {{ pool = "prefill" }}
[routes.match]
paths = {paths}
headers = {{ "x-route" = "dead" }}

[[routes]]
name = "pd"
mode = "orchestrate"
decode_pool = "decode"
prefill = {{ pool = "prefill" }}
client_kv_transfer_params = "reject"
[routes.match]
paths = {paths}
"""
    with tempfile.TemporaryDirectory() as tmp:
        conf, log = pathlib.Path(tmp) / "tokenonce.toml", pathlib.Path(tmp) / "tokenonce.log"
        conf.write_text(config)
        env = dict(os.environ, TOKENONCE_LOG="info", NO_COLOR="1")
        with open(log, "wb") as err:
            child = subprocess.Popen([str(binary), "--config", str(conf)], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            deadline, url = time.monotonic() + 15, None
            while url is None and time.monotonic() < deadline and child.poll() is None:
                found = re.search(r"tokenonce listening listen=(\S+)", log.read_text(errors="replace"))
                url = f"http://{found.group(1)}" if found else time.sleep(0.05)
            assert url, f"tokenonce did not start:\n{log.read_text(errors='replace')}"
            yield url
        finally:
            child.terminate()
            child.wait(timeout=10)
            engine.shutdown()
            refused.close()


def anthropic_client(url, **headers):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, default_headers=headers)


def openai_client(url, **headers):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, default_headers=headers)


def message(client, **kw):
    return client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}], **kw)


def test_anthropic_sdk_raises_bad_request_for_a_refused_body(proxy):
    with pytest.raises(anthropic.BadRequestError) as err:
        message(anthropic_client(proxy), extra_body={"kv_transfer_params": {"do_remote_prefill": True}})
    assert err.value.status_code == 400
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "kv_transfer_params" in err.value.body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_sdk_raises_server_error_for_an_unreachable_decode(proxy, stream):
    with pytest.raises(anthropic.InternalServerError) as err:
        message(anthropic_client(proxy, **{"x-route": "dead"}), stream=stream)
    assert err.value.status_code == 502
    assert err.value.body["error"] == {"type": "api_error", "message": "decode engine unavailable: connection refused"}


def test_anthropic_sdk_raises_the_error_event_of_a_broken_stream(proxy):
    seen = []
    with pytest.raises(anthropic.APIStatusError) as err:
        for event in message(anthropic_client(proxy), stream=True):
            seen.append(event.type)
    assert seen == ["message_start", "content_block_start"]
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "api_error"
    assert err.value.body["error"]["message"].startswith("decode engine stream failed")


def test_openai_sdk_raises_bad_request_on_responses(proxy):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(proxy).responses.create(model=MODEL, input="Hi", max_output_tokens=5,
                                              extra_body={"kv_transfer_params": {"do_remote_prefill": True}})
    assert err.value.status_code == 400
    assert err.value.code == "invalid_request"
    assert err.value.param == "kv_transfer_params"


def test_openai_sdk_raises_server_error_for_an_unreachable_decode_on_responses(proxy):
    with pytest.raises(openai.InternalServerError) as err:
        openai_client(proxy, **{"x-route": "dead"}).responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    assert err.value.status_code == 502
    assert err.value.code == "decode_unavailable"


def test_openai_sdk_sees_the_typed_error_event_of_a_broken_responses_stream(proxy):
    stream = openai_client(proxy).responses.create(model=MODEL, input="Hi", max_output_tokens=5, stream=True)
    events = list(stream)
    assert [e.type for e in events] == ["response.created", "response.output_text.delta", "error"]
    error = events[-1]
    assert isinstance(error, openai.types.responses.ResponseErrorEvent)
    assert error.code == "decode_stream_failed"
    assert error.message.startswith("decode engine stream failed")
    assert error.sequence_number == 2
