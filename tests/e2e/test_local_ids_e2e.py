"""Local ids in shadow on real vLLM traffic (runs after test_parity_e2e.py).

tokenonce-e2e.toml gives the prefill pool the model folder (real Qwen3 tokenizer.json and chat
template) with local_ids = "shadow": for every chat and completions request whose prefill
echoed its ids, tokenonce renders and tokenizes the request itself and compares with the echo.

- one request of each shape (a user turn, a system prompt, several turns, tools with a tool
  call and its result in the history, thinking off, a continued final message, completions)
  matches, each counted under its shape;
- every check of the whole tier's traffic so far (test_e2e.py's cases, streamed or not, the
  parity tests' accented text, the wrong-tokenizer route's requests) matched: a mismatch
  anywhere fails this test, with the counts per shape printed;
- with local_ids = "on" (pool `prefill-local`, route `local`), each shape's second request
  goes token-in (tokenonce's ids to the prefill, no echo), the decode pulls the KV over NIXL,
  and the answer equals the text path's and a direct call's.

Run: bash tests/e2e/run.sh (it starts the stack); by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_local_ids_e2e.py
"""

import time

import httpx

from engine_metrics import DecodePull

from test_e2e import DECODE_PORT, HOST, MODEL, TIMEOUT_S, TOKENONCE_PORT, metric, salted, scrape

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


def test_on_sends_trusted_shapes_token_in_with_answers_equal_to_text_and_direct():
    """The `local` route (local_ids = "on", trusted after one match): each shape's first
    request goes as text with the echo and matches; its second goes token-in (the prefill
    rendered and tokenized nothing: tokenonce sent its ids) with the decode pulling the KV over
    NIXL, and answers exactly as the text path (`off` route) and a direct call to the decode."""
    before = settled()
    shapes = {**{s: b[0] for s, b in CHAT_SHAPES.items()}}
    for shape, extra in shapes.items():
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, **extra}
        first = post_route("/v1/chat/completions", {**body, **salted(f"on-{shape}-1")}, "local")
        trusted = wait_trusted("prefill-local", shape)
        assert trusted, f"{shape}: not trusted after its first request matched"
        with DecodePull() as pull:
            second = post_route("/v1/chat/completions", {**body, **salted(f"on-{shape}-2")}, "local")
        pull.assert_pulled(second["usage"]["prompt_tokens"])
        text = post_route("/v1/chat/completions", {**body, **salted(f"on-{shape}-3")}, "off")
        direct = httpx.post(f"http://{HOST}:{DECODE_PORT}/v1/chat/completions",
                            json={**body, **salted(f"on-{shape}-4")}, timeout=TIMEOUT_S).json()
        answer = lambda r: (r["choices"][0]["message"].get("content"), r["choices"][0]["message"].get("reasoning"),  # noqa: E731
                            r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"])
        assert answer(second) == answer(text) == answer(direct) == answer(first), (shape, second, text, direct)
    after = settled()
    token_in = (metric(after, "tokenonce_local_ids_token_in_total", pool="prefill-local")
                - metric(before, "tokenonce_local_ids_token_in_total", pool="prefill-local"))
    assert token_in == len(shapes), f"{token_in} token-in prefills for {len(shapes)} shapes"
    assert metric(after, CHECKS, pool="prefill-local", result="mismatch") == 0


def post_route(path, body, route):
    r = httpx.post(f"http://{HOST}:{TOKENONCE_PORT}{path}", json=body, headers={"x-e2e-route": route},
                   timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def wait_trusted(pool, shape, deadline_s=20.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if metric(scrape(), "tokenonce_local_ids_trusted", pool=pool, shape=shape) == 1:
            return True
        time.sleep(0.2)
    return False
