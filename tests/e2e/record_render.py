#!/usr/bin/env python3
"""Record how real vLLM renders and tokenizes chat (and completions) requests, as fixtures for
tokenonce's renderer (src/render/): tests/render.rs checks the text, tests/render_ids.rs the ids.

Sends each case of CASES to a vLLM server (tests/e2e/vllm/start.sh: model "tiny-qwen3", the real
Qwen3 tokenizer and chat template; `TOKENONCE_VLLM_KV=0` is enough) with `max_tokens: 1`,
`return_token_ids: true` and `return_prompt_text: true`, and writes OUT (one JSON file):

    {"vllm_version", "model", "cases": [{"name", "api", "body", "status",
      "prompt_text", "prompt_token_ids", "expect_unsupported", "error"}]}

`body` is the exact request text sent (duplicate keys and number spellings matter), `api` is
"chat" or "completions", `expect_unsupported` the fallback label tokenonce must give instead of a
text (null: it must render exactly `prompt_text`), `error` vLLM's message when status is not 200.
For every chat case vLLM answered, the ids of /v1/chat/completions/render (--enable-scale-out)
are checked to equal the chat answer's `prompt_token_ids`. Python 3 standard library only.

Usage:
    TOKENONCE_VLLM_KV=0 bash tests/e2e/vllm/start.sh 8411
    python3 tests/e2e/record_render.py --port 8411 --out tests/fixtures/render/cases.json
    bash tests/e2e/vllm/stop.sh 8411
"""

import argparse
import http.client
import json
import sys

MODEL = "tiny-qwen3"
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


def chat(name, messages=None, raw=None, expect_unsupported=None, **fields):
    """A chat case: a body built from messages and fields, or raw JSON text (then EXTRA is
    spliced in after the opening brace)."""
    if raw is not None:
        extra = json.dumps({"model": MODEL, **EXTRA})[1:-1]
        body = "{" + extra + ", " + raw.strip()[1:]
    else:
        body = json.dumps({"model": MODEL, "messages": messages, **fields, **EXTRA}, ensure_ascii=False)
    return {"name": name, "api": "chat", "body": body, "expect_unsupported": expect_unsupported}


def completion(name, prompt, expect_unsupported=None, **fields):
    body = json.dumps({"model": MODEL, "prompt": prompt, **fields, **EXTRA}, ensure_ascii=False)
    return {"name": name, "api": "completions", "body": body, "expect_unsupported": expect_unsupported}


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
    completion("completion_plain", "The capital of France is"),
    completion("completion_special_tokens", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    completion("completion_nfd_emoji", "Cafe\u0301 👍🏽 \u1100\u1161"),
    completion("completion_echo", "echo me", expect_unsupported="echo", echo=True),
]


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
    args = ap.parse_args()

    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names)), "duplicate case names"
    failures = []
    out = []
    for case in CASES:
        path = "/v1/chat/completions" if case["api"] == "chat" else "/v1/completions"
        status, answer = post(args.port, path, case["body"])
        rec = {"name": case["name"], "api": case["api"], "body": case["body"], "status": status,
               "prompt_text": None, "prompt_token_ids": None,
               "expect_unsupported": case["expect_unsupported"], "error": None}
        if status == 200:
            if case["api"] == "chat":
                rec["prompt_text"] = answer.get("prompt_text")
                rec["prompt_token_ids"] = answer.get("prompt_token_ids")
                r_status, rendered = post(args.port, "/v1/chat/completions/render", case["body"])
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
            if case["expect_unsupported"] is None:
                failures.append(f"{case['name']}: status {status}: {rec['error'][:120]}")
        n_ids = len(rec["prompt_token_ids"] or [])
        print(f"{case['name']:45s} {status} ids={n_ids}")
        out.append(rec)

    doc = {"vllm_version": version(args.port), "model": MODEL, "cases": out}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(out)} cases to {args.out}")
    for f_ in failures:
        print("CHECK FAILED:", f_)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
