#!/usr/bin/env python3
"""Record real vLLM request/response exchanges as JSON fixtures for tokenonce's Rust tests.

Sends a fixed list of requests to a vLLM OpenAI-compatible server (started with
tests/e2e/vllm/start.sh: model "tiny-qwen3", seeded weights, real Qwen3 tokenizer, NixlConnector)
and writes one file per exchange, OUT/<name>.json, with this envelope (keys in this order):

    {"name", "vllm_version", "method", "path", "request_headers", "request_body",
     "status", "response_headers", "response_body"}

request_body and response_body hold the exact bytes sent and received (decoded as UTF-8;
SSE streams byte for byte). Python 3 standard library only.

Usage:
    python3 tests/e2e/record_fixtures.py --port 8311 --out tests/fixtures/vllm [--port2 8312]
        [--only apis]   (only the /v1/responses and /v1/messages group, names responses_*, messages_*)
        [--only generate]   (only /inference/v1/generate, names generate_*; the servers run
                             with --enable-scale-out, as start.sh starts them)
        [--only refusals]   (only the requests vLLM refuses when it reads them, names refuse_*,
                             and their token-in forms, names tokenin_*; one server, no KV
                             connector needed, no --tool-call-parser: as start.sh starts it)

With --port2, every decode leg (the names containing "decode") is sent to the second
server, as a P/D sidecar would; everything else goes to --port. A token-in decode leg carries
a real handoff: the `kv_transfer_params` of a prefill of the same prompt sent just before it
(not recorded; a handoff is pulled once) with the ids added, so the decode pulls the prompt's
KV over NIXL as it does behind tokenonce. Prints one line per fixture (name, status, bytes,
milliseconds), then the result of a few consistency checks; exits 1 if a check fails (the
fixtures are written anyway).

The tier's pair records them: `E2E_TRACING=0 bash tests/e2e/stack.sh up`, then
`python3 tests/e2e/record_fixtures.py --port 18100 --port2 18200 --out tests/fixtures/vllm`.
"""

import argparse
import http.client
import json
import os
import sys
import time

MODEL = "tiny-qwen3"
HOST = "127.0.0.1"  # loopback only
TIMEOUT_S = 120

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there!"},
]

# What a P/D sidecar (vLLM's toy proxy) puts on the prefill leg.
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

STREAM_USAGE = {"stream": True, "stream_options": {"include_usage": True}}

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

TOOLS_MESSAGES = [
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
]

MULTITURN_MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there!"},
    # Qwen3's template drops the <think> part of assistant turns before the last user turn.
    {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHi."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
    {"role": "user", "content": "Thanks, bye."},
]


def dumps(obj):
    """Compact JSON, as a proxy would send it."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def chat(messages=MESSAGES, **fields):
    return {"model": MODEL, "messages": messages, **fields}


def completion(prompt, **fields):
    return {"model": MODEL, "prompt": prompt, **fields}


def prefill(body):
    """Shape a request as the prefill leg of P/D."""
    return {**body, "max_tokens": 1, "temperature": 0, "stream": False,
            "return_token_ids": True, "kv_transfer_params": dict(PREFILL_KV)}


def decode_chat(ids, kv=None, **fields):
    """The chat decode leg in token-in form, with the prefill's handoff `kv` when given."""
    return chat(max_tokens=5, temperature=0, **fields,
                kv_transfer_params={**(kv or {}), "prompt_token_ids": ids})


def responses(**fields):
    """A Responses API request with the chat fixtures' conversation as `input`."""
    return {"model": MODEL, "input": MESSAGES, **fields}


def responses_prefill(body):
    """The Responses prefill leg as tokenonce sends it: `enable_response_messages` is what
    makes vLLM 0.32 echo the prompt ids (`input_messages[0].tokens`); `return_token_ids` is
    ignored on this path; `store: false` keeps the 1-token answer out of the prefill's store."""
    return {**body, "max_output_tokens": 1, "temperature": 0, "stream": False, "store": False,
            "enable_response_messages": True, "kv_transfer_params": dict(PREFILL_KV)}


def messages(**fields):
    """An Anthropic Messages API request (system prompt as a top-level field)."""
    return {"model": MODEL, "system": MESSAGES[0]["content"], "messages": MESSAGES[1:], **fields}


def record_apis(r):
    """/v1/responses and /v1/messages: prefill legs, token-in decodes, plain references."""
    D = 2
    RESP, MSG = "/v1/responses", "/v1/messages"
    r.record("responses_prefill", RESP, responses_prefill(responses()))
    ids = r.json_body("responses_prefill")["input_messages"][0]["tokens"]
    kv = lambda: r.handoff(RESP, responses_prefill(responses()))  # noqa: E731 (a fresh one per decode)
    mkv = lambda: r.handoff(MSG, {**messages(), "max_tokens": 1, "temperature": 0, "stream": False,  # noqa: E731
                                  "kv_transfer_params": dict(PREFILL_KV)})
    r.record("responses_prefill_return_token_ids", RESP,
             {**responses(), "max_output_tokens": 1, "temperature": 0, "stream": False, "store": False,
              "return_token_ids": True, "kv_transfer_params": dict(PREFILL_KV)})
    r.record("responses_plain", RESP, responses(max_output_tokens=5, temperature=0))
    r.record("responses_plain_stream", RESP, responses(max_output_tokens=5, temperature=0, stream=True))
    r.record("responses_decode_ids", RESP,
             responses(max_output_tokens=5, temperature=0, kv_transfer_params={**kv(), "prompt_token_ids": ids}),
             which=D)
    r.record("responses_decode_ids_stream", RESP,
             responses(max_output_tokens=5, temperature=0, stream=True,
                       kv_transfer_params={**kv(), "prompt_token_ids": ids}), which=D)
    r.record("responses_decode_short_ids", RESP,
             responses(max_output_tokens=5, temperature=0,
                       kv_transfer_params={**kv(), "prompt_token_ids": ids[:10]}), which=D)
    r.record("messages_prefill", MSG,
             {**messages(), "max_tokens": 1, "temperature": 0, "stream": False, "return_token_ids": True,
              "kv_transfer_params": dict(PREFILL_KV)})
    r.record("messages_plain", MSG, messages(max_tokens=5, temperature=0))
    r.record("messages_plain_stream", MSG, messages(max_tokens=5, temperature=0, stream=True))
    r.record("messages_decode_ids", MSG,
             messages(max_tokens=5, temperature=0, kv_transfer_params={**mkv(), "prompt_token_ids": ids}), which=D)
    r.record("messages_decode_short_ids", MSG,
             messages(max_tokens=5, temperature=0, kv_transfer_params={**mkv(), "prompt_token_ids": ids[:10]}),
             which=D)
    return ids


def generate(ids, **fields):
    """A token-in generate request (vLLM's /inference/v1/generate): ids in, limits in
    sampling_params, token ids out (output_mode "tokens", the default)."""
    return {"model": MODEL, "token_ids": ids, **fields}


def record_generate(r, ids):
    """/inference/v1/generate: the prefill leg tokenonce sends (sampling_params.max_tokens 1,
    not streamed, the remote-decode kv_transfer_params), token-in decodes with a real handoff,
    plain references and the 400 of a body without sampling_params."""
    D, GEN = 2, "/inference/v1/generate"
    sp = {"max_tokens": 5, "temperature": 0}
    pre = lambda: generate(ids, sampling_params={**sp, "max_tokens": 1}, stream=False,  # noqa: E731
                           kv_transfer_params=dict(PREFILL_KV))
    r.record("generate_prefill", GEN, pre())
    r.record("generate_plain", GEN, generate(ids, sampling_params=sp))
    r.record("generate_plain_stream", GEN,
             generate(ids, sampling_params=sp, stream=True, stream_options={"include_usage": True}))
    r.record("generate_decode", GEN, generate(ids, sampling_params=sp, kv_transfer_params=r.handoff(GEN, pre())),
             which=D)
    r.record("generate_decode_stream", GEN,
             generate(ids, sampling_params=sp, stream=True, stream_options={"include_usage": True},
                      kv_transfer_params=r.handoff(GEN, pre())), which=D)
    r.record("err_generate_no_sampling_params", GEN, generate(ids))


# Requests vLLM 0.32 refuses when it reads them (its request models' validators, or the
# chat serving's tool-choice check before any rendering), each sent as a client sends it.
REFUSED_CHAT = {
    "refuse_tool_choice_unknown_tool":
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    "refuse_tool_choice_required_without_tools": {"tool_choice": "required"},
    "refuse_tool_choice_auto_without_tools": {"tool_choice": "auto"},
    "refuse_tool_choice_named_without_tools":
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "refuse_tool_choice_empty_name":
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": ""}}},
    "refuse_tool_choice_unknown_string": {"tools": [WEATHER_TOOL], "tool_choice": "sometimes"},
    "refuse_tools_empty": {"tools": []},
    "refuse_tools_empty_choice_none": {"tools": [], "tool_choice": "none"},
    # accepted by the request model; refused by the serving without --tool-call-parser
    "refuse_tool_choice_required_no_parser": {"tools": [WEATHER_TOOL], "tool_choice": "required"},
    "refuse_top_logprobs_without_logprobs": {"top_logprobs": 2},
}
REFUSED_CONTINUE = {"messages": MESSAGES + [{"role": "assistant", "content": "Hi"}],
                    "continue_final_message": True, "add_generation_prompt": True}
REFUSED_COMPLETIONS = {
    "refuse_completions_empty_prompt": {"prompt": ""},
    "refuse_completions_stream_options_without_stream":
        {"prompt": "Hello there!", "stream_options": {"include_usage": True}},
    "refuse_completions_prompt_logprobs_with_stream":
        {"prompt": "Hello there!", "prompt_logprobs": 1, "stream": True},
}


def prefill_token_in(body, prompt_ids):
    """The prefill leg as tokenonce sends it token-in (local ids): no echo asked, the ids in
    kv_transfer_params (chat) or as the prompt (completions)."""
    leg = {**body, "max_tokens": 1, "temperature": 0, "stream": False, "kv_transfer_params": dict(PREFILL_KV)}
    if "messages" in body:
        leg["kv_transfer_params"]["prompt_token_ids"] = prompt_ids
    else:
        leg["prompt"] = prompt_ids
    return leg


def record_refusals(r, check):
    """What vLLM answers the requests it refuses before rendering (as a client sends them), and
    what it would answer their token-in forms: the chat validators run on the token-in body
    too; an empty completions prompt is refused as text but its ids are not (a BOS-only
    prompt, which is what "" tokenizes to for a family whose tokenizer adds BOS, is answered)."""
    CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
    _, _, raw = r.send(1, "POST", CHAT, dumps(prefill(chat())).encode("utf-8"))
    chat_ids = json.loads(raw)["prompt_token_ids"]  # the chat fixtures' prompt, not recorded again
    for name, fields in REFUSED_CHAT.items():
        r.record(name, CHAT, chat(max_tokens=5, temperature=0, **fields))
    r.record("refuse_continue_final_with_generation_prompt", CHAT, {**chat(max_tokens=5, temperature=0),
                                                                    **REFUSED_CONTINUE})
    for name, fields in REFUSED_COMPLETIONS.items():
        r.record(name, COMPL, {"model": MODEL, "max_tokens": 5, "temperature": 0, **fields})
    for name in ("refuse_tool_choice_unknown_tool", "refuse_tool_choice_required_no_parser"):
        r.record("tokenin_" + name[len("refuse_"):], CHAT,
                 prefill_token_in(chat(max_tokens=5, temperature=0, **REFUSED_CHAT[name]), chat_ids))
    empty = {"model": MODEL, "prompt": "", "max_tokens": 5, "temperature": 0}
    r.record("tokenin_completions_empty_ids", COMPL, prefill_token_in(empty, []))
    # Qwen3's <|endoftext|>, standing in for a BOS a tokenizer adds to "".
    r.record("tokenin_completions_bos_only", COMPL, prefill_token_in(empty, [151643]))
    for name in list(REFUSED_CHAT) + ["refuse_continue_final_with_generation_prompt"] + list(REFUSED_COMPLETIONS):
        f = r.results[name]
        check(f"{name} is a 400", f["status"] == 400, f["response_body"][:200])
    for name in ("tool_choice_unknown_tool", "tool_choice_required_no_parser"):
        check(f"tokenin_{name} answers as refuse_{name}",
              r.results["tokenin_" + name]["response_body"] == r.results["refuse_" + name]["response_body"])
    check("tokenin_completions_bos_only is answered (200)", r.results["tokenin_completions_bos_only"]["status"] == 200)
    for name in sorted(r.results):
        f = r.results[name]
        print(f"INFO  {name}: {f['status']} {f['response_body'][:160]}")


def check_generate(r, ids, check):
    pre = r.json_body("generate_prefill")
    check("generate_prefill hands over kv_transfer_params with remote blocks",
          bool((pre.get("kv_transfer_params") or {}).get("remote_block_ids")), json.dumps(pre)[:300])
    plain, dec = r.json_body("generate_plain"), r.json_body("generate_decode")
    check("generate_decode token_ids == generate_plain token_ids",
          dec["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
          and dec["usage"]["prompt_tokens"] == len(ids))
    streamed = [t for ev in sse_events(r.results["generate_decode_stream"]["response_body"])
                for ch in ev.get("choices", []) for t in ch.get("token_ids") or []]
    check("generate_decode_stream token_ids == generate_plain token_ids",
          streamed == plain["choices"][0]["token_ids"], str(streamed))
    check("err_generate_no_sampling_params is a 400",
          r.results["err_generate_no_sampling_params"]["status"] == 400)


def check_apis(r, ids, check):
    pre = r.json_body("responses_prefill")
    check("responses_prefill echoes input_messages[0].tokens, as many as usage.input_tokens",
          len(ids) == pre["usage"]["input_tokens"] and len(ids) > 0, f"{len(ids)} ids")
    rti = r.json_body("responses_prefill_return_token_ids")
    check("responses: return_token_ids alone echoes no ids", rti.get("input_messages") is None
          and "prompt_token_ids" not in rti)
    plain, dec = r.json_body("responses_plain"), r.json_body("responses_decode_ids")
    check("responses_decode_ids output == responses_plain output",
          json.dumps([o.get("content") for o in dec["output"]]) == json.dumps([o.get("content") for o in plain["output"]])
          and dec["usage"]["input_tokens"] == plain["usage"]["input_tokens"])
    check("responses_decode_short_ids usage.input_tokens follows the ids (10)",
          r.json_body("responses_decode_short_ids")["usage"]["input_tokens"] == 10)
    last = sse_events(r.results["responses_decode_ids_stream"]["response_body"])[-1]
    check("responses_decode_ids_stream ends with response.completed carrying usage",
          last.get("type") == "response.completed" and last["response"]["usage"]["input_tokens"] == len(ids))
    mp = r.json_body("messages_prefill")
    check("messages_prefill echoes no prompt ids", "prompt_token_ids" not in mp, json.dumps(mp)[:200])
    mplain, mdec = r.json_body("messages_plain"), r.json_body("messages_decode_ids")
    check("messages_decode_ids text == messages_plain text (signature aside)",
          [b.get("thinking", b.get("text")) for b in mdec["content"]]
          == [b.get("thinking", b.get("text")) for b in mplain["content"]] and mdec["usage"] == mplain["usage"])
    check("messages_decode_short_ids usage.input_tokens follows the ids (10)",
          r.json_body("messages_decode_short_ids")["usage"]["input_tokens"] == 10)


class Recorder:
    def __init__(self, port, port2, out):
        self.ports = {1: port, 2: port2 or port}
        self.out = out
        self.versions = {}
        self.results = {}
        self.timings = []

    def version(self, which):
        if which not in self.versions:
            status, _, body = self.send(which, "GET", "/version", None)
            if status != 200:
                sys.exit(f"GET /version on port {self.ports[which]} answered {status}")
            self.versions[which] = json.loads(body)["version"]
        return self.versions[which]

    def send(self, which, method, path, body, extra_headers=None):
        conn = http.client.HTTPConnection(HOST, self.ports[which], timeout=TIMEOUT_S)
        try:
            headers = {} if body is None else {"Content-Type": "application/json"}
            headers.update(extra_headers or {})
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()  # de-chunked, otherwise untouched (no Accept-Encoding sent)
            return resp.status, resp.getheader("content-type"), raw
        finally:
            conn.close()

    def record(self, name, path, body, method="POST", which=1, headers=None):
        """body: a dict (sent as compact JSON), a str (sent as is), or None (GET); `headers`
        are sent and recorded too."""
        if isinstance(body, dict):
            body = dumps(body)
        body_bytes = None if body is None else body.encode("utf-8")
        version = self.version(which)
        t0 = time.monotonic()
        status, ctype, raw = self.send(which, method, path, body_bytes, headers)
        ms = (time.monotonic() - t0) * 1000.0
        text = raw.decode("utf-8")  # strict: fixtures must hold the exact bytes
        fixture = {
            "name": name,
            "vllm_version": version,
            "method": method,
            "path": path,
            "request_headers": {**({} if body is None else {"content-type": "application/json"}),
                                **{k.lower(): v for k, v in (headers or {}).items()}},
            "request_body": "" if body is None else body,
            "status": status,
            "response_headers": {} if ctype is None else {"content-type": ctype},
            "response_body": text,
        }
        with open(os.path.join(self.out, name + ".json"), "w", encoding="utf-8") as f:
            json.dump(fixture, f, indent=2, ensure_ascii=False)
            f.write("\n")
        self.results[name] = fixture
        self.timings.append((name, ms))
        print(f"{name:36s} {status:3d} {len(raw):7d} bytes {ms:8.1f} ms  (port {self.ports[which]})",
              flush=True)
        return fixture

    def handoff(self, path, prefill_body, headers=None):
        """A prefill leg sent, not recorded: its `kv_transfer_params` (None without a connector)."""
        status, _, raw = self.send(1, "POST", path, dumps(prefill_body).encode("utf-8"), headers)
        if status != 200:
            sys.exit(f"prefill for a handoff answered {status}: {raw[:300]!r}")
        return json.loads(raw).get("kv_transfer_params") or {}

    def json_body(self, name):
        return json.loads(self.results[name]["response_body"])


def sse_events(body):
    """The JSON payloads of an SSE body, without the final [DONE]."""
    events = []
    for block in body.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: "):]))
    return events


def stream_text(body, kind):
    parts = []
    for ev in sse_events(body):
        for ch in ev.get("choices", []):
            if kind == "chat":  # the reasoning parser splits the output: both parts, in order
                delta = ch.get("delta", {})
                parts.append((delta.get("reasoning") or "") + (delta.get("content") or ""))
            else:
                parts.append(ch.get("text") or "")
    return "".join(parts)


def stream_usage(body):
    usages = [ev["usage"] for ev in sse_events(body) if ev.get("usage")]
    return usages[-1] if usages else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True, help="vLLM server on 127.0.0.1 (prefill and plain requests)")
    ap.add_argument("--port2", type=int, help="optional second server on 127.0.0.1 for the decode legs")
    ap.add_argument("--out", required=True, help="output folder, e.g. tests/fixtures/vllm")
    ap.add_argument("--only", choices=["apis", "generate", "refusals"],
                    help="record only the /v1/responses and /v1/messages group, only generate, or only refusals")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    r = Recorder(args.port, args.port2, args.out)
    failures = []

    def check(label, ok, detail=""):
        print(f"CHECK {'ok  ' if ok else 'FAIL'} {label}{(': ' + detail) if detail else ''}")
        if not ok:
            failures.append(label)

    if args.only == "refusals":
        record_refusals(r, check)
        sys.exit(1 if failures else 0)
    if args.only == "generate":
        _, _, raw = r.send(1, "POST", "/v1/chat/completions", dumps(prefill(chat())).encode("utf-8"))
        ids = json.loads(raw)["prompt_token_ids"]  # the chat fixtures' prompt, not recorded again
        record_generate(r, ids)
        check_generate(r, ids, check)
        sys.exit(1 if failures else 0)
    check_apis(r, record_apis(r), check)
    if args.only == "apis":
        sys.exit(1 if failures else 0)
    D = 2  # decode legs go to port2 when given
    CHAT, COMPL = "/v1/chat/completions", "/v1/completions"

    # ---- P/D prefill legs
    r.record("chat_prefill", CHAT, prefill(chat()))
    chat_ids = r.json_body("chat_prefill")["prompt_token_ids"]
    record_generate(r, chat_ids)
    check_generate(r, chat_ids, check)
    r.record("completions_prefill", COMPL, prefill(completion("Hello there!")))
    compl_ids = r.json_body("completions_prefill")["choices"][0]["prompt_token_ids"]

    # The handoff as the prefill names it after the client's X-Request-Id (remote_request_id).
    r.record("chat_prefill_nixl", CHAT, prefill(chat()), headers={"X-Request-Id": "fixture-rid-0001"})

    # ---- decode legs, token-in, each with the handoff of a prefill of its own
    kv = lambda: r.handoff(CHAT, prefill(chat()))  # noqa: E731
    ckv = lambda: r.handoff(COMPL, prefill(completion("Hello there!")))  # noqa: E731
    r.record("chat_decode_ids", CHAT, decode_chat(chat_ids, kv()), which=D)
    r.record("chat_decode_ids_stream", CHAT, decode_chat(chat_ids, kv(), **STREAM_USAGE), which=D)
    r.record("chat_decode_short_ids", CHAT, decode_chat(chat_ids[:10], kv()), which=D)
    r.record("completions_decode_ids", COMPL,
             completion(compl_ids, max_tokens=5, temperature=0, kv_transfer_params=ckv()), which=D)
    r.record("completions_decode_ids_stream", COMPL,
             completion(compl_ids, max_tokens=5, temperature=0, kv_transfer_params=ckv(), **STREAM_USAGE), which=D)

    # ---- plain (no kv_transfer_params), for comparison
    r.record("chat_plain", CHAT, chat(max_tokens=5, temperature=0))
    r.record("chat_plain_stream", CHAT, chat(max_tokens=5, temperature=0, **STREAM_USAGE))
    r.record("chat_stream_return_ids", CHAT,
             chat(max_tokens=5, temperature=0, **STREAM_USAGE, return_token_ids=True))
    r.record("completions_plain_stream", COMPL,
             completion("Hello there!", max_tokens=5, temperature=0, **STREAM_USAGE))

    # ---- more prefill shapes (template features)
    # tool_choice "none": the default "auto" needs --enable-auto-tool-choice and
    # --tool-call-parser on the server (see err_tools_auto_without_parser); with "none"
    # the tools are still rendered into the prompt (vLLM's default).
    r.record("chat_tools_prefill", CHAT,
             prefill(chat(TOOLS_MESSAGES, tools=[WEATHER_TOOL], tool_choice="none")))
    r.record("chat_thinking_off_prefill", CHAT,
             prefill(chat(chat_template_kwargs={"enable_thinking": False})))
    r.record("chat_multiturn_prefill", CHAT, prefill(chat(MULTITURN_MESSAGES)))

    # ---- errors
    r.record("err_unknown_model", CHAT, {**chat(max_tokens=5, temperature=0), "model": "nope"})
    r.record("err_invalid_json", CHAT, '{"model":"tiny-qwen3","messages":[')
    r.record("err_decode_oov_id", CHAT, decode_chat([151644, 999999]), which=D)
    r.record("err_decode_negative_id", CHAT, decode_chat([1, -2]), which=D)
    r.record("err_decode_empty_ids", CHAT, decode_chat([]), which=D)
    r.record("err_prompt_too_long", COMPL, completion([9707] * 50000, max_tokens=5, temperature=0))
    r.record("err_stream_options_without_stream", CHAT,
             chat(max_tokens=5, temperature=0, stream_options={"include_usage": True}))
    r.record("err_min_tokens_gt_max", CHAT, chat(max_tokens=1, min_tokens=5, temperature=0))
    # err_tools_auto_without_parser (tool_choice "auto" on a server without --enable-auto-tool-choice)
    # was recorded on such a server; the tier's servers have the parser, so it is not recorded here.

    # ---- GET endpoints
    r.record("get_version", "/version", None, method="GET")
    r.record("get_models", "/v1/models", None, method="GET")
    r.record("get_health", "/health", None, method="GET")

    # ---- consistency checks
    plain = r.json_body("chat_plain")
    dec = r.json_body("chat_decode_ids")
    plain_message = plain["choices"][0]["message"]
    plain_text = (plain_message.get("reasoning") or "") + (plain_message.get("content") or "")
    ids_stream = sse_events(r.results["chat_stream_return_ids"]["response_body"])
    plain_out_ids = [i for ev in ids_stream for ch in ev.get("choices", []) for i in (ch.get("token_ids") or [])]
    check("chat_prefill prompt ids", len(chat_ids) > 0, f"{len(chat_ids)} ids {chat_ids}")
    check("chat_stream_return_ids prompt ids == chat_prefill ids",
          ids_stream[0].get("prompt_token_ids") == chat_ids)
    dec_message = dec["choices"][0]["message"]
    check("chat_decode_ids text == chat_plain text",
          (dec_message.get("reasoning") or "") + (dec_message.get("content") or "") == plain_text, repr(plain_text))
    check("chat_decode_ids usage == chat_plain usage",
          (dec["usage"]["prompt_tokens"], dec["usage"]["completion_tokens"])
          == (plain["usage"]["prompt_tokens"], plain["usage"]["completion_tokens"]),
          json.dumps(dec["usage"]))
    check("chat_decode_ids_stream text == chat_plain text",
          stream_text(r.results["chat_decode_ids_stream"]["response_body"], "chat") == plain_text)
    check("chat_plain_stream text == chat_plain text",
          stream_text(r.results["chat_plain_stream"]["response_body"], "chat") == plain_text)
    check("chat_stream_return_ids text == chat_plain text",
          stream_text(r.results["chat_stream_return_ids"]["response_body"], "chat") == plain_text,
          f"output ids {plain_out_ids}")
    check("chat_decode_ids_stream usage == chat_plain usage",
          stream_usage(r.results["chat_decode_ids_stream"]["response_body"])["prompt_tokens"]
          == plain["usage"]["prompt_tokens"])
    short = r.json_body("chat_decode_short_ids")
    check("chat_decode_short_ids usage.prompt_tokens follows the ids (10)",
          short.get("usage", {}).get("prompt_tokens") == 10,
          f"usage {json.dumps(short.get('usage'))}, text {short['choices'][0]['message']['content']!r}")
    cdec = r.json_body("completions_decode_ids")
    ctext = cdec["choices"][0]["text"]
    check("completions_decode_ids text == completions_plain_stream text",
          stream_text(r.results["completions_plain_stream"]["response_body"], "completions") == ctext,
          repr(ctext))
    check("completions_decode_ids_stream text == completions_decode_ids text",
          stream_text(r.results["completions_decode_ids_stream"]["response_body"], "completions") == ctext)
    for name in ("chat_prefill", "completions_prefill", "chat_tools_prefill",
                 "chat_thinking_off_prefill", "chat_multiturn_prefill"):
        b = r.json_body(name)
        ok = r.results[name]["status"] == 200 and "choices" in b
        check(f"{name} answered 200", ok, "" if ok else r.results[name]["response_body"][:200])
        if ok:
            ids = b.get("prompt_token_ids") or b["choices"][0].get("prompt_token_ids")
            print(f"INFO  {name}: {len(ids)} prompt ids, "
                  f"kv_transfer_params={json.dumps(b.get('kv_transfer_params'))}")
    for name in sorted(r.results):
        if name.startswith("err_"):
            f = r.results[name]
            print(f"INFO  {name}: {f['status']} {f['response_body'][:160]}")
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
