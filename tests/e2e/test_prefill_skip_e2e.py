"""The prefill decision on real engines (issue 45): route `skip` (pool `prefill-local`, local ids
trusted after one match; decode pool `decode-kv`, which follows the decode vLLM's own KV
events; `skip_below_tokens = 512`).

- a conversation's first turn (~600 tokens, nothing of it on the decode) goes P/D: the decode
  pulls its KV over NIXL and, being vLLM, publishes the blocks it then holds;
- its second turn (the first's messages, its answer, a short user message: ~100 tokens past the
  blocks the decode holds) goes to the decode alone, token-in: no prefill request, nothing over
  NIXL, the decode computing only what it lacks and finding the rest in its prefix cache;
- that answer equals, at temperature 0, the same turn's answer through route `local` (always
  P/D, token-in) and a direct call to the decode;
- each decision counted by reason.

Run: bash tests/e2e/run.sh (it starts the stack); by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_prefill_skip_e2e.py
"""

import random
import time

import httpx

from engine_metrics import EXTERNAL, LOCAL, PREFILL_PORT, TRANSFERS, DecodePull

from test_e2e import DECODE_PORT, HOST, MODEL, TIMEOUT_S, TOKENONCE_PORT, metric, scrape
from test_local_ids_e2e import wait_trusted

WORDS = ("amber basil cedar delta ember fjord garnet harbor indigo juniper kelp lumen meadow nectar "
         "orchid pepper quartz raven sable thistle umber violet walnut yonder zephyr").split()
DECISIONS = "tokenonce_prefill_decisions_total"


def post(body, route):
    r = httpx.post(f"http://{HOST}:{TOKENONCE_PORT}/v1/chat/completions", json=body,
                   headers={"x-e2e-route": route}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


def decisions(decision, reason):
    return metric(scrape(), DECISIONS, route="e2e-skip", decision=decision, reason=reason)


def decision_counts():
    """Every decision of route `skip` by (decision, reason), and what tokenonce believes of the
    decode engine's queue: the facts a failed assertion prints."""
    snap = scrape()
    counts = {tuple(sorted(dict(ls).items())): v for (n, ls), v in snap.items()
              if n == DECISIONS and ("route", "e2e-skip") in ls}
    waiting = {dict(ls).get("endpoint"): v for (n, ls), v in snap.items() if n == "tokenonce_engine_requests_waiting"}
    return {"decisions": counts, "engine_waiting": waiting}


def prefill_requests():
    """The prefill vLLM's finished requests (any reason)."""
    text = httpx.get(f"http://{HOST}:{PREFILL_PORT}/metrics", timeout=10).raise_for_status().text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def decode_blocks():
    """The blocks tokenonce's index of the decode's events holds (every conversation's)."""
    return metric(scrape(), "tokenonce_kv_blocks", pool="decode-kv")


def wait_decode_holds(blocks, deadline_s=20.0):
    """Waits (bounded) until tokenonce's index of the decode's events holds `blocks` blocks."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if decode_blocks() >= blocks:
            return True
        time.sleep(0.2)
    return False


def answer(r):
    m = r["choices"][0]["message"]
    return m.get("content"), m.get("reasoning"), r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]


def test_a_turn_the_decode_holds_goes_to_it_alone_and_answers_as_pd():
    rng = random.Random(time.time_ns())  # a conversation of its own: no run finds another's blocks
    system = {"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(120))}
    user = {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(300))}
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0}

    # Both turns' shapes trusted first (their first request goes as text, its echo checked).
    short = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    post({**body, "messages": short}, "skip")
    post({**body, "messages": short + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}]},
         "skip")
    for shape in ("chat_system", "chat_multi_turn"):
        assert wait_trusted("prefill-local", shape), f"{shape} not trusted after a match"
    # the index holds the blocks of every earlier test's requests to this decode: wait for this
    # turn's on top of them, or the second turn could be sent before they arrive
    held_before = decode_blocks()
    first = post({**body, "messages": [system, user]}, "skip")
    prompt_1 = first["usage"]["prompt_tokens"]
    assert prompt_1 >= 512, prompt_1
    assert wait_decode_holds(held_before + prompt_1 // 128), "the decode's events never showed the first turn's blocks"
    over = decisions("prefill", "over_threshold")
    assert over >= 1, "the first turn, held nowhere, went P/D"

    reply = {"role": "assistant", "content": first["choices"][0]["message"].get("content") or ""}
    turn_2 = [system, user, reply, {"role": "user", "content": "And then what happened next?"}]
    alone, prefills = decisions("decode_alone", "under_threshold"), prefill_requests()
    before = decision_counts()
    with DecodePull() as pull:
        second = post({**body, "messages": turn_2}, "skip")
    assert decisions("decode_alone", "under_threshold") == alone + 1, \
        f"the second turn went P/D: before {before}, after {decision_counts()}"
    d = pull.settled(lambda d: d[LOCAL] > 0)
    assert d[EXTERNAL] == 0 and d[TRANSFERS] == 0, f"the decode alone pulled over NIXL: {d}"
    assert 0 < d[LOCAL] < second["usage"]["prompt_tokens"], f"the decode computed the whole prompt: {d}"
    time.sleep(0.5)  # the prefill counts a step after answering
    assert prefill_requests() == prefills, "a prefill ran for the decode-alone turn"

    pd = post({**body, "messages": turn_2}, "local")
    direct = httpx.post(f"http://{HOST}:{DECODE_PORT}/v1/chat/completions", json={**body, "messages": turn_2},
                        timeout=TIMEOUT_S).json()
    assert answer(second) == answer(pd) == answer(direct), (second, pd, direct)
