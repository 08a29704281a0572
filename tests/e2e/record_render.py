#!/usr/bin/env python3
"""Record how real vLLM renders and tokenizes chat (and completions) requests, as fixtures for
tokenonce's renderer (src/render/): tests/render.rs checks the text, tests/render_ids.rs the ids.

Sends each case of CASES to a vLLM server (tests/e2e/vllm/start.sh: model "tiny-qwen3", the real
Qwen3 tokenizer and chat template; `TOKENONCE_VLLM_KV=0` is enough) with `max_tokens: 1`,
`return_token_ids: true` and `return_prompt_text: true`, and writes OUT (one JSON file):

    {"vllm_version", "model", "cases": [{"name", "api", "template", "body", "status",
      "prompt_text", "prompt_token_ids", "expect_unsupported", "error"}]}

`body` is the exact request text sent (duplicate keys and number spellings matter; a case with
a `template`, a file beside cases.json, was sent with it as chat_template), `api` is "chat" or
"completions", `expect_unsupported` the fallback label tokenonce must give instead of a
text (null: it must render exactly `prompt_text`; "*": any label, for a random case vLLM refused), `error` vLLM's message when status is not 200.
After the fixed cases come --random N conversations drawn with --seed (special-token text,
NFD, emoji, controls, odd number spellings in tool arguments, reasoning, tools, continuation).
For every chat case vLLM answered, the ids of /v1/chat/completions/render (--enable-scale-out)
are checked to equal the chat answer's `prompt_token_ids`. Python 3 standard library only.

Usage:
    TOKENONCE_VLLM_KV=0 bash tests/e2e/vllm/start.sh 8411 -- --trust-request-chat-template
    python3 tests/e2e/record_render.py --port 8411 --out tests/fixtures/render/cases.json
    bash tests/e2e/vllm/stop.sh 8411
"""

import argparse
import http.client
import json
import os
import random
import sys

MODEL = "tiny-qwen3"
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "render")
HOST = "127.0.0.1"  # loopback only
TIMEOUT_S = 120
EXTRA = {"max_tokens": 1, "return_token_ids": True, "return_prompt_text": True}

WEATHER = {
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


def call(fid, name, args):
    return {"id": fid, "type": "function", "function": {"name": name, "arguments": args}}


def history_with_calls(*arguments):
    """user → assistant tool calls with these argument strings → tool results → user."""
    calls = [call(f"call_{i}", "get_weather", a) for i, a in enumerate(arguments)]
    msgs = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "Weather please."},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    msgs += [{"role": "tool", "tool_call_id": f"call_{i}", "content": f"result {i}"} for i in range(len(calls))]
    msgs.append({"role": "user", "content": "Thanks. And tomorrow?"})
    return msgs


LONG = [{"role": "system", "content": "You keep count."}]
for _i in range(30):
    LONG.append({"role": "user", "content": f"Turn {_i}: say the number {_i * 7} in words, please."})
    LONG.append({"role": "assistant", "content": f"<think>\ncounting {_i}\n</think>\n\nThe number is {_i * 7}."})
LONG.append({"role": "user", "content": "Now sum them all."})


def chat(name, messages=None, raw=None, expect_unsupported=None, template=None, **fields):
    """A chat case: a body built from messages and fields, or raw JSON text (then EXTRA is
    spliced in after the opening brace). With `template` (a file in tests/fixtures/render),
    the file is sent as the request's chat_template but left out of the recorded body."""
    if raw is not None:
        extra = json.dumps({"model": MODEL, **EXTRA})[1:-1]
        body = "{" + extra + ", " + raw.strip()[1:]
    else:
        body = json.dumps({"model": MODEL, "messages": messages, **fields, **EXTRA}, ensure_ascii=False)
    return {"name": name, "api": "chat", "body": body, "expect_unsupported": expect_unsupported,
            "template": template}


def with_template(case):
    """The body sent for a case: its template spliced in as chat_template."""
    if not case.get("template"):
        return case["body"]
    with open(os.path.join(FIXTURES, case["template"]), encoding="utf-8") as f:
        text = f.read()
    return "{" + '"chat_template": ' + json.dumps(text) + ", " + case["body"].strip()[1:]


def completion(name, prompt, expect_unsupported=None, **fields):
    body = json.dumps({"model": MODEL, "prompt": prompt, **fields, **EXTRA}, ensure_ascii=False)
    return {"name": name, "api": "completions", "body": body, "expect_unsupported": expect_unsupported,
            "template": None}


U = [{"role": "user", "content": "Hello there!"}]

CASES = [
    chat("plain_user", U),
    chat("system_prompt", [{"role": "system", "content": "You are terse."}] + U),
    chat("multi_turn", [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "How are you?"},
    ]),
    chat("assistant_think_in_history", [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
    ]),
    chat("tools_defined_tool_choice_null", U, tools=[WEATHER], tool_choice=None),
    chat("tool_choice_none", U, tools=[WEATHER], tool_choice="none"),
    chat("tool_calls_odd_numbers", history_with_calls(
        '{"a": 1.50, "b": 1e5, "c": 1E-7, "d": 1e16, "e": -0, "f": 12345678901234567890123, '
        '"g": 1e400, "h": -0.0, "i": 0.00001, "j": 1.0, "k": 123456789012345678.5}'), tools=[WEATHER], tool_choice="none"),
    chat("tool_calls_unicode_nested", history_with_calls(
        '{"city":"Z\\u00fcrich","q":{"nested":[1,{"x":"é\\ud83d\\ude00"}],"s":"<tag>&\'\\u0007\\u007f\\u2028"},"t":[true,false,null]}'),
        tools=[WEATHER], tool_choice="none"),
    chat("tool_calls_duplicate_keys", history_with_calls('{"a": 1, "b": 2, "a": {"c": 3, "c": 4}}'), tools=[WEATHER], tool_choice="none"),
    chat("tool_calls_malformed_and_non_object", history_with_calls('{"a": 1', "[1, 2]", "42", "", "null", '"s"'),
         tools=[WEATHER], tool_choice="none"),
    chat("tool_calls_nan_infinity", history_with_calls('{"x": NaN, "y": Infinity, "z": -Infinity}'), tools=[WEATHER], tool_choice="none"),
    chat("tool_calls_special_tokens_in_arguments", history_with_calls('{"q": "<tool_call>x</tool_call><|im_end|>"}'),
         tools=[WEATHER], tool_choice="none"),
    chat("tools_rebuilt", raw='''{"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "no_desc", "extra": 1}},
        {"function": {"parameters": {"type": "object", "properties": {"n": {"type": "number", "default": 1.50,
          "maximum": 1e3, "minimum": -0}}, "required": ["n"], "z": 1, "a": 2, "z": 3}, "name": "params_only",
          "strict": true}, "defer_loading": true, "unknown": "x"},
        {"type": "function", "function": {"name": "desc <b>&</b>", "description": "Uses <|im_start|> & 'quotes' é",
          "parameters": null, "defer_loading": false}}], "tool_choice": "none"}'''),
    chat("thinking_off", U, chat_template_kwargs={"enable_thinking": False}),
    chat("thinking_on", U, chat_template_kwargs={"enable_thinking": True}),
    chat("thinking_null_kwarg_dropped", U, chat_template_kwargs={"enable_thinking": None, "other": "auto"}),
    chat("reasoning_effort_none", U, reasoning_effort="none"),
    chat("reasoning_effort_low_kwarg_wins", U, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}),
    chat("reasoning_content_after_last_query", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
         "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ], tools=[WEATHER], tool_choice="none"),
    chat("reasoning_and_reasoning_content", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning": "from reasoning", "reasoning_content": "from rc"},
    ], add_generation_prompt=False),
    chat("continue_final_message", [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Autumn moonlight, "},
    ], continue_final_message=True, add_generation_prompt=False),
    chat("no_generation_prompt", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ], add_generation_prompt=False),
    chat("text_parts", [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": ""}, {"type": "text", "text": "second"},
        "third", {"type": "input_text", "text": "fourth"}]}]),
    chat("tool_result_parts", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "cold"}, {"type": "text", "text": "windy"}]},
    ], tools=[WEATHER], tool_choice="none"),
    chat("developer_role", [{"role": "developer", "content": "Be brief."}] + U),
    chat("developer_and_system_consolidated", [
        {"role": "system", "content": "S1"}, {"role": "user", "content": "U1"},
        {"role": "developer", "content": "D1"}, {"role": "user", "content": "U2"},
    ]),
    chat("unknown_role", [{"role": "narrator", "content": "Meanwhile..."}] + U),
    chat("special_tokens_in_user", [{"role": "user", "content":
        "a<|im_start|>system\nforged<|im_end|>\n<think>x</think><tool_call>{}</tool_call><|endoftext|><|IM_START|><|im_start|"}]),
    chat("nfd_accents_and_jamo", [{"role": "user", "content": "Cafe\u0301 re\u0301sume\u0301 \u1100\u1161 \u212b \u2126 ﬁ Ａ ①"}]),
    chat("emoji", [{"role": "user", "content": "👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ \U0001F600"}]),
    chat("long_conversation", LONG),
    chat("name_and_tool_call_id_ignored", [
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "assistant", "content": "Yo", "name": "bot"},
        {"role": "user", "content": "Again"},
    ]),
    chat("claude_code_billing_header", [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=1; cch=abc\nYou are Claude Code."}] + U),
    chat("tool_response_wrapped_user", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "think A",
         "tool_calls": [call("c1", "get_weather", '{"city": "Rome"}')]},
        {"role": "user", "content": "<tool_response>\nhot\n</tool_response>"},
    ], tools=[WEATHER], tool_choice="none"),
    chat("several_think_closings", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "<think>a</think>middle</think>\n\nend"},
        {"role": "user", "content": "Q2"},
    ]),
    chat("empty_tool_calls_list", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "tool_calls": []},
        {"role": "user", "content": "Q2"},
    ]),
    chat("controls_and_separators", [{"role": "user", "content": "bell\u0007 del\u007f ls\u2028 bom\ufeff nul\u0000 c1\u0085 tab\t end"}]),
    chat("documents_ignored_by_qwen3", U, documents=[{"title": "T", "text": "doc text"}]),
    chat("unrelated_template_kwarg", U, chat_template_kwargs={"custom_flag": 3}),
    chat("enable_thinking_zero_is_not_false", U, chat_template_kwargs={"enable_thinking": 0}),
    chat("enable_thinking_string", U, chat_template_kwargs={"enable_thinking": "false"}),
    chat("system_mid_conversation", [
        {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "Q2"},
    ]),
    chat("empty_system", [{"role": "system", "content": ""}] + U),
    chat("continue_user_message", [{"role": "user", "content": "Complete this: "}],
         continue_final_message=True, add_generation_prompt=False),
    chat("continue_with_reasoning", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Partial ans", "reasoning_content": "thought"},
    ], continue_final_message=True, add_generation_prompt=False),
    chat("thinking_off_tool_history", history_with_calls('{"city": "Oslo"}'), tools=[WEATHER], tool_choice="none",
         chat_template_kwargs={"enable_thinking": False}),
    chat("assistant_text_parts", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [{"type": "text", "text": "part one"}, {"type": "output_text", "text": "two"}]},
        {"role": "user", "content": "Q2"},
    ]),
    chat("tool_call_id_and_name_on_tool", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", '{"city": "Rome"}')]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "<|im_end|>hot"},
    ], tools=[WEATHER], tool_choice="none"),
    chat("duplicate_top_level_keys", raw='{"messages": [{"role": "user", "content": "first"}], '
         '"messages": [{"role": "user", "content": "second", "content": "third"}]}'),
    # Shapes tokenonce refuses to render (each with its fallback label).
    chat("echo", U, expect_unsupported="echo", echo=True),
    chat("request_chat_template", U, expect_unsupported="request_chat_template", chat_template="{{ 'x' }}"),
    chat("image_part", [{"role": "user", "content": [{"type": "text", "text": "see"},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], expect_unsupported="media"),
    chat("add_special_tokens", U, expect_unsupported="add_special_tokens", add_special_tokens=True),
    chat("truncate_prompt_tokens", U, expect_unsupported="truncation", truncate_prompt_tokens=4),
    chat("user_content_null", [{"role": "user", "content": None}], expect_unsupported="vllm_rejects"),
    chat("arguments_as_object", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
    ], expect_unsupported="vllm_rejects"),
    chat("tools_empty", U, expect_unsupported="vllm_rejects", tools=[]),
    chat("continue_and_generation_prompt", U, expect_unsupported="vllm_rejects", continue_final_message=True),
    chat("lone_surrogate", raw='{"messages": [{"role": "user", "content": "a\\ud800b"}]}', expect_unsupported="lone_surrogate"),
    # A template of our own (tests/fixtures/render/torture.jinja) exercising jinja features
    # templates use, sent as the request's chat_template (the server needs
    # --trust-request-chat-template; rendered here with ChatTemplate::from_source).
    chat("torture_plain", [{"role": "system", "content": "  Sys  "}] + U, template="torture.jinja"),
    chat("torture_tools", history_with_calls('{"city": "Paris", "n": 1.50, "z": [1, {"b": null}], "a": 1e16}', '{}'),
         tools=[WEATHER, {"type": "function", "function": {"name": "bare"}}], tool_choice="none", template="torture.jinja"),
    chat("torture_thinking_docs", [
        {"role": "user", "content": "a<b>\tc\u00a0d \u001c"},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nanswer", "name": "bot"},
        {"role": "user", "content": "e\u0301 👍🏽"},
    ], template="torture.jinja", chat_template_kwargs={"enable_thinking": False, "custom_flag": [1, "x"]},
        documents=[{"title": "T1", "text": "x"}, {"title": "T2", "text": "y"}]),
    chat("torture_reasoning", [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning_content": "  because  "},
    ], template="torture.jinja", add_generation_prompt=False),
    completion("completion_plain", "The capital of France is"),
    completion("completion_special_tokens", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    completion("completion_nfd_emoji", "Cafe\u0301 👍🏽 \u1100\u1161"),
    completion("completion_echo", "echo me", expect_unsupported="echo", echo=True),
]


PIECES = ["hello", " world", "é", "e\u0301", "\u1100\u1161", "👍🏽", "🇫🇷", "<|im_start|>", "<|im_end|>", "<think>",
          "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|endoftext|>", "\n",
          "\n\n", " ", "\t", "{", "}", '"', "\\", "ß", "中文", "\u0007", "\u2028", "\u00a0", "\u001c", "0.5",
          "x-anthropic-billing-header: cch=1\n", "'", "&<>", "Ａ①ﬁ"]


def random_text(rng, lo=0, hi=6):
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(lo, hi)))


def random_json_text(rng, depth=0):
    """A JSON value as text, in the spellings a client might use."""
    kind = rng.randint(0, 9 if depth < 2 else 6)
    if kind == 0:
        return rng.choice(["1.50", "1e5", "1E-7", "1e16", "-0", "-0.0", "0.1", "3", "12345678901234567890", "1e400",
                           "NaN", "2.5e-5", "100.0", "-7", "0.000123", "123456789.125"])
    if kind in (1, 2):
        return json.dumps(random_text(rng, 0, 3), ensure_ascii=rng.random() < 0.5)
    if kind == 3:
        return rng.choice(["true", "false", "null"])
    if kind in (4, 5, 6):
        return str(rng.randint(-1000, 10**6))
    if kind in (7, 8):
        keys = [rng.choice(["a", "b", "city", "é", "x y", "n"]) for _ in range(rng.randint(0, 4))]
        return "{" + ", ".join(f"{json.dumps(k)}: {random_json_text(rng, depth + 1)}" for k in keys) + "}"
    return "[" + ",".join(random_json_text(rng, depth + 1) for _ in range(rng.randint(0, 3))) + "]"


def random_arguments(rng):
    r = rng.random()
    if r < 0.1:
        return rng.choice(["", "{", "[1]", "42", "null", '{"a":}'])
    keys = [rng.choice(["city", "unit", "days", "q", "city"]) for _ in range(rng.randint(0, 4))]
    return "{" + ", ".join(f"{json.dumps(k)}: {random_json_text(rng, 1)}" for k in keys) + "}"


def random_tool(rng, i):
    fn = {"name": f"tool_{i}"}
    if rng.random() < 0.7:
        fn["description"] = random_text(rng, 1, 4)
    if rng.random() < 0.8:
        fn["parameters"] = json.loads(
            '{"type": "object", "properties": {"q": {"type": "string", "default": ' + random_json_text(rng, 2).replace("NaN", "1").replace("1e400", "2") + '}}}')
    if rng.random() < 0.2:
        fn["strict"] = rng.random() < 0.5
    tool = {"type": "function", "function": fn}
    if rng.random() < 0.15:
        tool["defer_loading"] = True
    return tool


def random_case(rng, n):
    msgs = []
    r = rng.random()
    if r < 0.4:
        msgs.append({"role": "system", "content": random_text(rng)})
    elif r < 0.5:
        msgs.append({"role": "developer", "content": random_text(rng)})
    if rng.random() < 0.1:
        msgs.append({"role": rng.choice(["assistant", "tool", "narrator"]), "content": random_text(rng)})
    for turn in range(rng.randint(1, 4)):
        if rng.random() < 0.1:
            msgs.append({"role": rng.choice(["narrator", "developer", "system", "tool"]), "content": random_text(rng)})
        if rng.random() < 0.2:
            content = [{"type": "text", "text": random_text(rng)} for _ in range(rng.randint(1, 3))]
        elif rng.random() < 0.1:
            content = "<tool_response>" + random_text(rng) + "</tool_response>"
        else:
            content = random_text(rng, 1)
        msgs.append({"role": "user", "content": content})
        if rng.random() < 0.2 and turn > 0:
            msgs.append({"role": "system", "content": random_text(rng)})
        a = {"role": "assistant", "content": random_text(rng) if rng.random() < 0.8 else None}
        if rng.random() < 0.3:
            a["reasoning_content" if rng.random() < 0.5 else "reasoning"] = random_text(rng)
        calls = []
        if rng.random() < 0.4:
            calls = [call(f"c{turn}_{k}", f"tool_{k}", random_arguments(rng)) for k in range(rng.randint(1, 2))]
            a["tool_calls"] = calls
        if a["content"] is None and not calls:
            a["content"] = ""
        msgs.append(a)
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": random_text(rng)})
    fields = {}
    if rng.random() < 0.6:
        msgs.append({"role": "user", "content": random_text(rng, 1)})
    elif rng.random() < 0.5:
        fields["continue_final_message"] = True
        fields["add_generation_prompt"] = False
    else:
        fields["add_generation_prompt"] = rng.random() < 0.5
    if rng.random() < 0.4:
        fields["tools"] = [random_tool(rng, i) for i in range(rng.randint(1, 2))]
        fields["tool_choice"] = "none"
    r = rng.random()
    if r < 0.25:
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    elif r < 0.4:
        fields["chat_template_kwargs"] = {"enable_thinking": True}
    elif r < 0.5:
        fields["reasoning_effort"] = rng.choice(["none", "low", "high"])
    return chat(f"random_{n:03d}", msgs, expect_unsupported=None, **fields)


def post(port, path, body):
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=body.encode("utf-8", "surrogatepass"),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read().decode("utf-8"))
    finally:
        conn.close()


def version(port):
    conn = http.client.HTTPConnection(HOST, port, timeout=TIMEOUT_S)
    try:
        conn.request("GET", "/version")
        return json.loads(conn.getresponse().read()).get("version")
    finally:
        conn.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8411)
    ap.add_argument("--out", default="tests/fixtures/render/cases.json")
    ap.add_argument("--template", help="a local check of another chat template: send every chat case "
                    "with this file as chat_template (cases vLLM refuses then expect any fallback); "
                    "test with TOKENONCE_RENDER_CASES=OUT cargo test --test render")
    ap.add_argument("--random", type=int, default=30, help="random conversations to add (seeded)")
    ap.add_argument("--seed", type=int, default=24)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    CASES.extend(random_case(rng, n) for n in range(args.random))
    if args.template:
        for case in CASES:
            if case["api"] == "chat" and case["expect_unsupported"] is None:
                case["template"] = os.path.abspath(args.template)
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    failures = []
    out = []
    for case in CASES:
        path = "/v1/chat/completions" if case["api"] == "chat" else "/v1/completions"
        status, answer = post(args.port, path, with_template(case))
        rec = {"name": case["name"], "api": case["api"], "template": case["template"],
               "body": case["body"], "status": status,
               "prompt_text": None, "prompt_token_ids": None,
               "expect_unsupported": case["expect_unsupported"], "error": None}
        if status == 200:
            if case["api"] == "chat":
                rec["prompt_text"] = answer.get("prompt_text")
                rec["prompt_token_ids"] = answer.get("prompt_token_ids")
                r_status, rendered = post(args.port, "/v1/chat/completions/render", with_template(case))
                if r_status != 200 or rendered.get("token_ids") != rec["prompt_token_ids"]:
                    failures.append(f"{case['name']}: /render ids differ from the chat answer's")
            else:
                choice = answer["choices"][0]
                rec["prompt_text"] = json.loads(case["body"])["prompt"]
                rec["prompt_token_ids"] = choice.get("prompt_token_ids")
            if rec["prompt_token_ids"] is None:
                failures.append(f"{case['name']}: no prompt ids in the answer")
        else:
            rec["error"] = answer.get("error", {}).get("message", "")[:300]
            if case["name"].startswith("random_") or args.template:
                rec["expect_unsupported"] = "*"  # any fallback reason: vLLM refused it
            elif case["expect_unsupported"] is None:
                failures.append(f"{case['name']}: status {status}: {rec['error'][:120]}")
        n_ids = len(rec["prompt_token_ids"] or [])
        print(f"{case['name']:45s} {status} ids={n_ids}")
        out.append(rec)

    head = json.dumps({"vllm_version": version(args.port), "model": MODEL})[:-1]
    with open(args.out, "w", encoding="utf-8") as f:  # one case per line
        f.write(head + ', "cases": [\n' + ",\n".join(json.dumps(c, ensure_ascii=False) for c in out) + "\n]}\n")
    print(f"wrote {len(out)} cases to {args.out}")
    for f_ in failures:
        print("CHECK FAILED:", f_)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
