"""The tier can fail: on real P/D with a model that looks at its context, a decode that is
given another prompt's ids, or another request's KV, answers differently from the direct call,
and the comparison the other tests make (`Result.comparable`) catches it.

The engines are driven straight (no tokenonce): each case is what a broken handoff would send
the decode. The prompts differ in their middle only (same length, same last tokens), the case
the tier's old dummy-weight model answered identically.

Run by tests/e2e/run.sh; by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_pd_e2e.py
"""

import httpx

from engine_metrics import DecodePull
from test_e2e import DECODE_PORT, HOST, MAX_TOKENS, MODEL, PREFILL_PORT, TIMEOUT_S, Result

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
ALICE = [{"role": "user", "content": "My name is Alice and I live in Paris. Where do I live? Answer briefly."}]
BOB = [{"role": "user", "content": "My name is Bob and I live in Tokyo. Where do I live? Answer briefly."}]
HTTP = httpx.Client(timeout=TIMEOUT_S)


def chat(port, messages, **fields):
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **fields}
    r = HTTP.post(f"http://{HOST}:{port}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def result(answer):
    choice = answer["choices"][0]
    return Result(content=choice["message"]["content"] or "", reasoning=choice["message"].get("reasoning") or "",
                  token_ids=choice["token_ids"], prompt_token_ids=answer["prompt_token_ids"],
                  finish_reason=choice["finish_reason"], prompt_tokens=answer["usage"]["prompt_tokens"],
                  completion_tokens=answer["usage"]["completion_tokens"])


def prefill(messages):
    answer = chat(PREFILL_PORT, messages, max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
    kv = answer["kv_transfer_params"]
    assert kv and kv["remote_block_ids"] and kv["transfer_mode"] == "pull", kv
    return answer["prompt_token_ids"], kv


def direct(messages):
    return result(chat(DECODE_PORT, messages))


def test_the_two_prompts_answer_differently():
    alice, bob = direct(ALICE), direct(BOB)
    assert alice.prompt_tokens == bob.prompt_tokens, "same length: only their contents differ"
    assert alice.prompt_token_ids[-8:] == bob.prompt_token_ids[-8:], "same last tokens"
    assert alice.token_ids != bob.token_ids, (alice.token_ids, bob.token_ids)


def test_a_decode_with_its_own_ids_and_kv_answers_as_the_direct_call():
    ids, kv = prefill(ALICE)
    with DecodePull() as pull:
        got = result(chat(DECODE_PORT, ALICE, kv_transfer_params={**kv, "prompt_token_ids": ids}))
    pull.assert_pulled(len(ids))
    assert got.comparable() == direct(ALICE).comparable()


def test_a_decode_given_another_prompts_ids_answers_differently():
    """Bob's ids (and Bob's KV, so the pull is consistent) with Alice's messages: the decode
    follows the ids, so it answers as Bob, and the comparison with Alice's direct call fails."""
    bob_ids, bob_kv = prefill(BOB)
    with DecodePull() as pull:
        got = result(chat(DECODE_PORT, ALICE, kv_transfer_params={**bob_kv, "prompt_token_ids": bob_ids}))
    pull.assert_pulled(len(bob_ids))
    alice, bob = direct(ALICE), direct(BOB)
    assert got.comparable() != alice.comparable(), "the tier must catch a decode given another prompt's ids"
    assert got.token_ids == bob.token_ids and got.prompt_token_ids == bob.prompt_token_ids


def test_a_decode_given_another_requests_kv_answers_differently():
    """Bob's messages and ids, Alice's KV: the decode pulls Alice's blocks and answers from
    them, not as Bob's direct call; the comparison catches it."""
    _, alice_kv = prefill(ALICE)
    bob_ids, bob_kv = prefill(BOB)
    with DecodePull() as pull:
        got = result(chat(DECODE_PORT, BOB, kv_transfer_params={**alice_kv, "prompt_token_ids": bob_ids}))
    pull.assert_pulled(len(bob_ids))
    chat(DECODE_PORT, BOB, max_tokens=1, kv_transfer_params={**bob_kv, "prompt_token_ids": bob_ids})  # frees Bob's blocks
    alice, bob = direct(ALICE), direct(BOB)
    assert got.comparable() != bob.comparable(), "the tier must catch a decode given another request's KV"
    assert got.token_ids == alice.token_ids, "the answer came from Alice's KV"
