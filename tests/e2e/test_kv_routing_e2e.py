"""Cache-aware choice on real engines (issue 32 point 5): route `kv` of tokenonce-e2e.toml, whose
prefill pool `prefill-kv` is both prefill servers (:18100 and :18300) chosen by the KV events
they publish (stack.sh starts them with PYTHONHASHSEED=0, sha256_cbor, block size 128, prompt
tokens details on).

Every conversation opens with one shared system prompt (a few 128-token blocks, the same in all
of them; each user turn starts with a word of its own), and both engines are first sent that
prompt straight (no tokenonce), so each holds those blocks and a new conversation ties: new
conversations alternate between the two.
Then, one request at a time:

- every follow-up turn lands on the prefill that served the conversation's first turn (which
  prefill served a request: the one whose own `vllm:prompt_tokens_total` moved);
- the `usage.prompt_tokens_details.cached_tokens` of each answer equals what tokenonce predicted
  for the prefill it chose (`tokenonce_cache_aware_predicted_tokens_total{source="events"}`,
  moved by that request) and the prefill's own `vllm:prefix_cache_hits_total` move, and for a
  follow-up it is every full block of the turn before (the engine holds the whole history);
- every block the engines reported stored was hashed again by tokenonce to the same hash
  (`tokenonce_kv_hash_checks_total{result="mismatch"}` stays 0, `match` counts them);
- the second prefill restarted (its cache empty, its publisher a new one): once tokenonce's
  subscriber is connected again, the conversations it held go to the first prefill, which
  holds their shared system block (an index still believing the old cache would send them
  back), and stay there.

Run: bash tests/e2e/run.sh (it starts the stack; this file runs before test_kv_paths_e2e.py,
which leaves no prefill); by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_kv_routing_e2e.py
"""

import os
import random
import subprocess
import time

import httpx

from engine_metrics import scrape as engine_scrape
from test_e2e import HOST, MODEL, TIMEOUT_S, TOKENONCE_PORT, metric, scrape

HERE = os.path.dirname(os.path.abspath(__file__))
POOL = "prefill-kv"
PREFILLS = (18100, 18300)  # its endpoints, in its order; 18300 is restarted below
RESTARTED = 18300
BLOCK = 128  # the engines' block size (the CPU backend's default)
CONVERSATIONS = 4
TURNS = 3  # before the restart
WAIT_S = 20.0  # bound of every wait for a counter to move
RESTART_S = 400  # bound of stack.sh start-prefill2 (vLLM start-up, loaded machine)

WORDS = ("amber basalt cedar delta ember fjord garnet harbor indigo juniper kelp lantern meadow "
         "nickel orchard pewter quartz river saffron timber umber velvet willow xenon yarrow zephyr").split()
SYSTEM = {"role": "system", "content": "You keep a ledger of facts. " + " ".join(
    f"Rule {i}: write each {WORDS[i % len(WORDS)]} entry in order." for i in range(40))}


def words(seed, n):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def user_turn(conversation, turn):
    """About 130 tokens of user text, distinct per conversation and turn from its first word
    (so conversations share nothing past the system prompt)."""
    text = f"{WORDS[conversation]} {words(f'{conversation}/{turn}', 120)} (conversation {conversation}, turn {turn})"
    return {"role": "user", "content": text}


def settle(read, want, what):
    """Polls `read()` until `want(value)` holds (bounded by WAIT_S); returns the last value."""
    deadline = time.monotonic() + WAIT_S
    while True:
        value = read()
        if want(value):
            return value
        assert time.monotonic() < deadline, f"{what}: still {value} after {WAIT_S} s"
        time.sleep(0.2)


def engines():
    """Per prefill port: (prompt tokens, prefix-cache hits) from its own /metrics."""
    out = {}
    for port in PREFILLS:
        snap = engine_scrape(port)
        out[port] = (snap.get(("vllm:prompt_tokens_total", None), 0.0), snap.get(("vllm:prefix_cache_hits_total", None), 0.0))
    return out


def tokenonce_counts():
    snap = scrape()
    return {
        "predicted": metric(snap, "tokenonce_cache_aware_predicted_tokens_total", pool=POOL, source="events"),
        "events_choices": metric(snap, "tokenonce_cache_aware_choices_total", pool=POOL, source="events"),
        "match": metric(snap, "tokenonce_kv_hash_checks_total", pool=POOL, result="match"),
        "mismatch": metric(snap, "tokenonce_kv_hash_checks_total", pool=POOL, result="mismatch"),
        "disabled": metric(snap, "tokenonce_kv_cache_aware_disabled", pool=POOL),
        "reconnects": metric(snap, "tokenonce_kv_events_reconnects_total", pool=POOL),
    }


def chat(messages, port=None):
    """One chat request, through route `kv` (or straight to the prefill on `port`); its JSON."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    if port is None:
        url, headers = f"http://{HOST}:{TOKENONCE_PORT}/v1/chat/completions", {"x-e2e-route": "kv"}
    else:
        url, headers = f"http://{HOST}:{port}/v1/chat/completions", {}
    r = httpx.post(url, json=body, headers=headers, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()


class Turn:
    """One request through route `kv`: which prefill served it, what it found cached (as the
    answer, the engine's counters and tokenonce's prediction say) and its prompt length."""

    def __init__(self, messages):
        before_engines, before = engines(), tokenonce_counts()
        answer = chat(messages)
        usage = answer["usage"]
        self.prompt_tokens = usage["prompt_tokens"]
        self.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        # vLLM counts a request a step or so after answering: wait for one prefill to move.
        moved = settle(lambda: {p: (e[0] - before_engines[p][0], e[1] - before_engines[p][1]) for p, e in engines().items()},
                       lambda d: sum(1 for v in d.values() if v[0] > 0) == 1, "one prefill's prompt tokens")
        self.port = next(p for p, (tokens, _) in moved.items() if tokens > 0)
        assert moved[self.port][0] == self.prompt_tokens, f"the serving prefill counted {moved[self.port][0]} prompt tokens"
        self.engine_hits = moved[self.port][1]
        after = tokenonce_counts()
        self.predicted = after["predicted"] - before["predicted"]
        self.by_events = after["events_choices"] - before["events_choices"]
        # Every full block it computed is reported stored and checked before the next turn.
        computed = self.prompt_tokens // BLOCK - (self.cached or 0) // BLOCK
        settle(lambda: tokenonce_counts()["match"] - before["match"], lambda m: m >= computed,
               f"hash checks of the {computed} blocks the prefill computed")

    def __repr__(self):
        return (f"Turn(prefill {self.port}, prompt {self.prompt_tokens}, cached {self.cached}, "
                f"engine hits {self.engine_hits}, predicted {self.predicted})")


def assert_predicted(turn, held_tokens):
    """vLLM found cached exactly what tokenonce predicted for the prefill it chose: `held_tokens`."""
    assert turn.by_events == 1, f"chosen by the KV events: {turn}"
    assert turn.cached == turn.engine_hits == turn.predicted == held_tokens, f"cached == hits == predicted == {held_tokens}: {turn}"


def stack(command):
    subprocess.run(["bash", os.path.join(HERE, "stack.sh"), command], check=True, timeout=RESTART_S)


def test_conversations_follow_the_prefill_that_holds_them_and_leave_a_restarted_one():
    start = tokenonce_counts()
    assert start["disabled"] == 0, "cache-aware choice is on"
    # Both engines hold the shared system block; the shapes earn local-ids trust (one match
    # each), so each later pick knows the prompt's blocks before the prefill.
    for port in PREFILLS:
        chat([SYSTEM, {"role": "user", "content": "Ready?"}], port=port)
    warm = [[SYSTEM, user_turn(-1, 1)],
            [SYSTEM, user_turn(-1, 1), {"role": "assistant", "content": "Noted."}, user_turn(-1, 2)]]
    for messages in warm:
        chat(messages)
    for shape in ("chat_system", "chat_multi_turn"):
        settle(lambda: metric(scrape(), "tokenonce_local_ids_trusted", pool=POOL, shape=shape), lambda v: v == 1,
               f"local ids trusted for {shape}")

    history = {c: [SYSTEM] for c in range(CONVERSATIONS)}
    home, last, shared = {}, {}, set()
    for turn_no in range(1, TURNS + 1):
        for c in range(CONVERSATIONS):
            history[c].append(user_turn(c, turn_no))
            turn = Turn(history[c])
            history[c].append({"role": "assistant", "content": f"Noted, fact {c}.{turn_no}."})
            if turn_no == 1:
                # Held everywhere: the shared system prompt's full blocks; ties rotate.
                assert_predicted(turn, turn.predicted)
                shared.add(turn.predicted)
                home[c] = turn.port
            else:
                assert turn.port == home[c], f"conversation {c} turn {turn_no} left its prefill {home[c]}: {turn}"
                assert_predicted(turn, last[c].prompt_tokens // BLOCK * BLOCK)
            last[c] = turn
    assert set(home.values()) == set(PREFILLS), f"new conversations go to both prefills: {home}"
    assert len(shared) == 1 and min(shared) >= BLOCK, f"the system prompt's blocks, held by both: {shared}"

    # The second prefill restarted: its cache is empty, its publisher a new one.
    moved = [c for c in home if home[c] == RESTARTED]
    reconnects = tokenonce_counts()["reconnects"]
    stack("kill-prefill2")
    stack("start-prefill2")
    settle(lambda: tokenonce_counts()["reconnects"], lambda r: r > reconnects, "the subscriber connected to the new publisher")
    settle(lambda: metric(scrape(), "tokenonce_upstream_healthy", pool=POOL, endpoint=f"127.0.0.1:{RESTARTED}"),
           lambda v: v == 1, "the restarted prefill healthy")
    other = next(p for p in PREFILLS if p != RESTARTED)
    for turn_no in (TURNS + 1, TURNS + 2):
        for c in moved:
            history[c].append(user_turn(c, turn_no))
            turn = Turn(history[c])
            history[c].append({"role": "assistant", "content": f"Noted, fact {c}.{turn_no}."})
            assert turn.port == other, f"conversation {c} went back to the restarted prefill: {turn}"
            # First there: only the shared system prompt's blocks; then the whole turn before.
            assert_predicted(turn, min(shared) if turn_no == TURNS + 1 else last[c].prompt_tokens // BLOCK * BLOCK)
            last[c] = turn

    end = tokenonce_counts()
    assert end["mismatch"] == start["mismatch"] == 0, f"every hash check matched: {end}"
    assert end["match"] > start["match"], end
    assert end["disabled"] == 0, end
