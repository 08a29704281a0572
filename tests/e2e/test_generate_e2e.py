"""/inference/v1/generate through tokenonce on the real NIXL pair: the prefill computes the
prompt, the decode pulls its KV over NIXL (none computed), and the answer, streamed or not, is
the ids a direct call to the decode gives (the tier's servers run with --enable-scale-out).

Run by tests/e2e/run.sh; by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_generate_e2e.py
"""

import json

import httpx

from engine_metrics import DecodePull
from test_e2e import DECODE_PORT, HOST, MODEL, TIMEOUT_S, TOKENONCE_PORT, metric, scrape
from test_pd_e2e import ALICE, BOB

GENERATE = "/inference/v1/generate"
HTTP = httpx.Client(timeout=TIMEOUT_S)


def prompt_ids(messages):
    """The chat prompt's ids, as the decode tokenizes them (no KV is made)."""
    r = HTTP.post(f"http://{HOST}:{DECODE_PORT}/tokenize",
                  json={"model": MODEL, "messages": messages, "add_generation_prompt": True})
    assert r.status_code == 200, r.text[:300]
    return r.json()["tokens"]


def generate(port, ids, **fields):
    body = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 12, "temperature": 0}, **fields}
    r = HTTP.post(f"http://{HOST}:{port}{GENERATE}", json=body)
    assert r.status_code == 200, r.text[:300]
    return r


def streamed_ids(text):
    """The output ids of a generate SSE body, in order, and its usage event."""
    ids, usage = [], None
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            ids += [t for ch in event.get("choices", []) for t in ch.get("token_ids") or []]
            usage = event.get("usage") or usage
    assert text.rstrip().endswith("data: [DONE]"), text[-200:]
    return ids, usage


def test_generate_pulls_the_kv_and_answers_as_the_direct_call():
    ids = prompt_ids(ALICE)
    direct = generate(DECODE_PORT, ids).json()["choices"][0]["token_ids"]
    assert direct != generate(DECODE_PORT, prompt_ids(BOB)).json()["choices"][0]["token_ids"], \
        "the model looks at its prompt"
    before = scrape()
    with DecodePull() as pull:
        answer = generate(TOKENONCE_PORT, ids).json()
        pull.assert_pulled(len(ids))
    assert answer["choices"][0]["token_ids"] == direct
    assert answer["usage"]["prompt_tokens"] == len(ids)
    fallbacks = (metric(scrape(), "tokenonce_token_reuse_total", reason="prompt_is_tokens", result="fallback")
                 - metric(before, "tokenonce_token_reuse_total", reason="prompt_is_tokens", result="fallback"))
    assert fallbacks == 1, fallbacks


def test_a_streamed_generate_pulls_the_kv_and_streams_the_direct_ids():
    ids = prompt_ids(ALICE)
    direct = generate(DECODE_PORT, ids).json()["choices"][0]["token_ids"]
    with DecodePull() as pull:
        r = generate(TOKENONCE_PORT, ids, stream=True, stream_options={"include_usage": True})
        pull.assert_pulled(len(ids))
    assert r.headers["content-type"].startswith("text/event-stream")
    got, usage = streamed_ids(r.text)
    assert got == direct
    assert usage and usage["prompt_tokens"] == len(ids), usage
