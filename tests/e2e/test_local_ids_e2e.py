"""Local ids in shadow on real vLLM traffic (runs after test_parity_e2e.py).

tokenonce-e2e.toml gives the prefill pool the model folder (real Qwen3 tokenizer.json and chat
template) with local_ids = "shadow": for every chat and completions request whose prefill
echoed its ids, tokenonce renders and tokenizes the request itself and compares with the echo.

- one request of each shape (a user turn, a system prompt, several turns, tools with a tool
  call and its result in the history, thinking off, a continued final message, completions)
  matches, each counted under its shape;
- every check of the whole tier's traffic so far (test_e2e.py's cases, streamed or not, the
  parity tests' accented text, the wrong-tokenizer route's requests) matched: a mismatch
  anywhere fails this test, with the counts per shape printed.

Run: bash tests/e2e/run.sh (it starts the stack); by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_local_ids_e2e.py
"""

import time

import httpx

from test_e2e import HOST, MODEL, TIMEOUT_S, TOKENONCE_PORT, metric, salted, scrape

CHECKS = "tokenonce_local_ids_checks_total"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1.50}"}}]}

CHAT_SHAPES = {
    "chat": [{"messages": [{"role": "user", "content": "Name a colour."}]},
             {"messages": [{"role": "user", "content": "Café crème, s'il vous plaît"}],
              "chat_template_kwargs": {"enable_thinking": False}}],
    "chat_system": [{"messages": [{"role": "system", "content": "You are terse."},
                                  {"role": "user", "content": "Hello there!"}]}],
    "chat_multi_turn": [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                      {"role": "user", "content": "And now?"}]}],
    "chat_tools": [{"messages": [{"role": "user", "content": "Weather in Paris?"}, CALL,
                                 {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}],
                    "tools": TOOLS, "tool_choice": "none"}],
    "chat_continue": [{"messages": [{"role": "user", "content": "Count to three."},
                                    {"role": "assistant", "content": "One, two,"}],
                       "add_generation_prompt": False, "continue_final_message": True}],
}


def settled(deadline_s=30.0):
    """A scrape once the verifier has caught up (its counts stopped moving for 1 s; bounded)."""
    deadline = time.monotonic() + deadline_s
    last = None
    while True:
        snap = scrape()
        now = sum(v for (n, _), v in snap.items() if n == CHECKS)
        if now == last or time.monotonic() > deadline:
            return snap
        last = now
        time.sleep(1.0)


def by_shape(snapshot):
    """{shape: {result: count}} of the prefill pool's checks."""
    out = {}
    for (name, labels), value in snapshot.items():
        if name == CHECKS and ("pool", "prefill") in labels:
            d = dict(labels)
            out.setdefault(d["shape"], {})[d["result"]] = value
    return out


def post(path, body):
    r = httpx.post(f"http://{HOST}:{TOKENONCE_PORT}{path}", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_shape_matches_and_no_check_of_the_tiers_traffic_differs():
    before = settled()
    sent = {}
    for shape, bodies in CHAT_SHAPES.items():
        for i, extra in enumerate(bodies):
            post("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "temperature": 0,
                                          **salted(f"local-{shape}-{i}"), **extra})
            sent[shape] = sent.get(shape, 0) + 1
    post("/v1/completions", {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                             "temperature": 0, **salted("local-completions")})
    sent["completions"] = 1
    after = settled()
    table = by_shape(after)
    print("\nlocal ids on the tier's traffic, per shape:")
    for shape, results in sorted(table.items()):
        total = sum(results.values())
        print(f"  {shape:16} {results}  match rate {results.get('match', 0) / total:.3f}" if total else shape)
    for shape, n in sent.items():
        grew = (metric(after, CHECKS, pool="prefill", shape=shape, result="match")
                - metric(before, CHECKS, pool="prefill", shape=shape, result="match"))
        assert grew == n, f"{shape}: {grew} of {n} requests matched; {table}"
    mismatches = metric(after, CHECKS, pool="prefill", result="mismatch")
    assert mismatches == 0, f"local ids differ from vLLM's echo: {table}"
