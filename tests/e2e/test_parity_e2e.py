"""The parity watch on real vLLM traffic (runs after test_e2e.py and test_relay_e2e.py).

tokenonce-e2e.toml gives the decode pool the model's real Qwen3 tokenizer.json and samples
every reused request (parity_sample = 1.0) on the default route and on the relay route; the
`wrongtok` route reads the same ids with a deliberately wrong tokenizer (ids rotated,
tests/e2e/wrong_tokenizer.py) under on_parity_mismatch = "disable_reuse".

- the wrong tokenizer produces mismatches, and reuse turns off for that route (counted once);
- honest text with decomposed accents (NFD: macOS input, Vietnamese, Korean jamo), which the
  Qwen3 tokenizer composes (NFC) so its ids decode composed, matches;
- every check of the earlier tests' real traffic (single and multi-turn chat, system prompts,
  tools with a tool call in the history, thinking on and off, completions, streamed or not,
  relay mode) matched: a correct request never reads as a mismatch.

Run: bash tests/e2e/run.sh (it starts the stack); by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_parity_e2e.py
"""

import time

import openai

from engine_metrics import DecodePull

from test_e2e import ADMIN_PORT, HOST, MODEL, TIMEOUT_S, TOKENONCE_PORT, ROUTE_HEADER, client, metric, salted, scrape

WRONG = "e2e-wrongtok"
CHECKED_ROUTES = ("e2e-reuse", "e2e-relay")


def checks(snapshot, route, result):
    return metric(snapshot, "tokenonce_parity_checks_total", route=route, result=result)


def settled(deadline_s=30.0):
    """A scrape once the watch has caught up (its counts stopped moving for 1 s; bounded)."""
    deadline = time.monotonic() + deadline_s
    last = None
    while True:
        snap = scrape()
        now = sum(v for (n, _), v in snap.items() if n == "tokenonce_parity_checks_total")
        if now == last or time.monotonic() > deadline:
            return snap
        last = now
        time.sleep(1.0)


def wrongtok_chat(text):
    """One chat on the `wrongtok` route; its decode pulls the prompt's KV like any other."""
    c = openai.OpenAI(base_url=f"http://{HOST}:{TOKENONCE_PORT}/v1", api_key="x", max_retries=0,
                      timeout=TIMEOUT_S, default_headers={ROUTE_HEADER: "wrongtok"})
    with DecodePull() as pull:
        r = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                      messages=[{"role": "user", "content": text}])
    pull.assert_pulled(r.usage.prompt_tokens)
    return r


def test_a_wrong_tokenizer_mismatches_and_disable_reuse_turns_reuse_off():
    before = scrape()
    r = wrongtok_chat("Name three colours of the rainbow.")
    assert r.choices[0].message is not None
    snap = settled()
    assert checks(snap, WRONG, "mismatch") - checks(before, WRONG, "mismatch") >= 1, snap
    assert metric(snap, "tokenonce_parity_reuse_off", route=WRONG) == 1
    # Reuse is off now: the next decode goes text, its ids are still checked (and mismatch).
    r = wrongtok_chat("Name three animals of the sea.")
    assert r.choices[0].message is not None
    snap = settled()
    held = metric(snap, "tokenonce_token_reuse_total", route=WRONG, result="fallback", reason="parity_reuse_off")
    assert held - metric(before, "tokenonce_token_reuse_total", route=WRONG, result="fallback",
                         reason="parity_reuse_off") >= 1, snap
    assert metric(snap, "tokenonce_parity_reuse_disabled_total", route=WRONG) == 1, "logged and counted once"
    assert checks(snap, WRONG, "mismatch") - checks(before, WRONG, "mismatch") >= 2


def test_decomposed_accents_of_honest_traffic_match():
    """vLLM's real Qwen3 tokenizer composes NFD text, so the prefill's honest ids decode to
    `Café` while the request reads `Cafe\u0301`: the watch compares both normalized and
    counts a match (comparing the raw texts counted these as mismatches)."""
    before = settled()
    c = client(TOKENONCE_PORT)
    texts = ["Cafe\u0301 cre\u0300me bru\u0302le\u0301e", "Vie\u0323\u0302t Nam and Caf\u00e9 cre\u0300me",
             "\u1100\u1161\u11a8 \u1102\u1165"]
    for i, text in enumerate(texts):
        with DecodePull() as pull:
            r = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": text}],
                                          extra_body=salted(f"nfd-{i}"))
        pull.assert_pulled(r.usage.prompt_tokens)
    snap = settled()
    assert checks(snap, "e2e-reuse", "mismatch") == checks(before, "e2e-reuse", "mismatch"), snap
    assert checks(snap, "e2e-reuse", "match") - checks(before, "e2e-reuse", "match") == len(texts), snap


def test_every_check_of_real_traffic_matched():
    snap = settled()
    for route in CHECKED_ROUTES:
        matched = checks(snap, route, "match")
        assert checks(snap, route, "mismatch") == 0, (route, {k: v for k, v in snap.items()
                                                              if k[0] == "tokenonce_parity_checks_total"})
        assert checks(snap, route, "dropped") == 0, route
        assert matched >= 1, (route, matched)
    # On the default route every reused request was checked (sample share 1.0).
    applied = metric(snap, "tokenonce_token_reuse_total", route="e2e-reuse", result="applied")
    done = sum(checks(snap, "e2e-reuse", r) for r in ("match", "mismatch", "skipped", "dropped"))
    assert done == applied, (done, applied)
    assert metric(snap, "tokenonce_pool_models_differ", route="e2e-reuse") == 0
    print(f"parity: e2e-reuse {checks(snap, 'e2e-reuse', 'match'):.0f} match, "
          f"{checks(snap, 'e2e-reuse', 'skipped'):.0f} skipped; e2e-relay {checks(snap, 'e2e-relay', 'match'):.0f} match")
