"""End-to-end relay mode: an orchestrator that behaves like vLLM's toy_proxy_server.py sends
both legs through tokenonce, which fronts the real prefill (:18100) and decode (:18200) vLLM.

The orchestrator (`toy_orchestrate`, written here after the toy proxy's behaviour) sends the
prefill leg (kv_transfer_params do_remote_decode, stream false, max_tokens 1, min_* removed)
with a fresh uuid X-Request-Id, copies a non-empty kv_transfer_params from the answer into the
original request, and sends that to the decode with the same X-Request-Id. Routes (header
`x-e2e-route`, sent on both legs): `relay` (cache handoff), `relay-stateless` (ids ride in
kv_transfer_params), `relay-off` (token_reuse = false). Pointed straight at the engines the
same orchestrator gives the reference answer; all three must equal it, the metrics must
show the decode really took the prefill's ids, and the decode's own metrics that it pulled the
prompt's KV over NIXL (every route: the orchestrator always hands the KV over).

Run by tests/e2e/run.sh, or by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_relay_e2e.py
"""

import json
import os
import re
import uuid

import httpx
import pytest

from engine_metrics import DecodePull

HOST = "127.0.0.1"
TOKENONCE = f"http://{HOST}:{int(os.environ.get('E2E_TOKENONCE_PORT', '18000'))}"
ADMIN = f"http://{HOST}:{int(os.environ.get('E2E_ADMIN_PORT', '18900'))}"
PREFILL = f"http://{HOST}:{int(os.environ.get('E2E_PREFILL_PORT', '18100'))}"
DECODE = f"http://{HOST}:{int(os.environ.get('E2E_DECODE_PORT', '18200'))}"
MODEL = os.environ.get("E2E_MODEL", "tiny-qwen3")
ROUTE_NAMES = {"relay": "e2e-relay", "relay-stateless": "e2e-relay-stateless", "relay-off": "e2e-relay-off"}

CLIENT = httpx.Client(timeout=120.0)


def toy_orchestrate(prefill_base, decode_base, path, req_data, route=None):
    """One request the way toy_proxy_server.py runs it; returns (status, body text)."""
    request_id = str(uuid.uuid4())
    headers = {"Authorization": "Bearer None", "X-Request-Id": request_id}
    if route:
        headers["x-e2e-route"] = route
    p = dict(req_data)
    p["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    p["stream"] = False
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p.pop("stream_options", None)
    p.pop("min_tokens", None)
    p.pop("min_completion_tokens", None)
    r = CLIENT.post(prefill_base + path, json=p, headers=headers)
    r.raise_for_status()
    prefill_answer = r.json()
    decode_req = dict(req_data)
    kv = prefill_answer.get("kv_transfer_params", {})
    if kv:
        decode_req["kv_transfer_params"] = kv
    r = CLIENT.post(decode_base + path, json=decode_req, headers=headers)
    return r.status_code, r.text, prefill_answer


def scrape():
    text = CLIENT.get(ADMIN + "/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenonce_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(snapshot, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return snapshot.get(f"{name}{{{want}}}", 0.0)


def answer(path, text, stream):
    """What must be identical: output text, output ids, finish reason, usage."""
    if not stream:
        body = json.loads(text)
        choice = body["choices"][0]
        content = choice.get("text") if "text" in choice else choice["message"]["content"]
        return {"text": content, "ids": choice.get("token_ids"), "finish": choice["finish_reason"], "usage": body["usage"]}
    text_parts, ids, finish, usage = [], [], None, None
    for event in text.split("\n\n"):
        data = event.removeprefix("data: ").strip()
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            text_parts.append(piece or "")
            ids.extend(choice.get("token_ids") or [])
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(text_parts), "ids": ids, "finish": finish, "usage": usage}


CASES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Relay this, please."}]}),
    "completions": ("/v1/completions", {"prompt": "The relay carries the prompt ids"}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_relay_outputs_match_and_reuse_is_real(case, stream):
    path, extra = CASES[case]
    req = {"model": MODEL, "max_tokens": 8, "temperature": 0, "return_token_ids": True, **extra}
    if stream:
        req["stream"] = True
        req["stream_options"] = {"include_usage": True}
    status, text, _ = toy_orchestrate(PREFILL, DECODE, path, req)
    assert status == 200, text
    reference = answer(path, text, stream)
    assert reference["ids"], "return_token_ids gives output ids to compare"

    for route in ("relay", "relay-stateless", "relay-off"):
        before = scrape()
        with DecodePull() as pull:
            status, text, prefill_answer = toy_orchestrate(TOKENONCE, TOKENONCE, path, req, route)
        after = scrape()
        assert status == 200, f"{route}: {text}"
        got = answer(path, text, stream)
        assert got == reference, f"{route}: {got} != {reference}"
        pull.assert_pulled(got["usage"]["prompt_tokens"])
        name = ROUTE_NAMES[route]
        applied = metric(after, "tokenonce_token_reuse_total", reason="none", result="applied", route=name) - metric(
            before, "tokenonce_token_reuse_total", reason="none", result="applied", route=name
        )
        reused = metric(after, "tokenonce_reused_prompt_tokens_total", route=name) - metric(
            before, "tokenonce_reused_prompt_tokens_total", route=name
        )
        if route == "relay-off":
            # Reuse off: the decode leg goes through with the orchestrator's KV handoff as it
            # came (pulled above), no ids added, nothing reused.
            assert applied == 0 and reused == 0
        else:
            assert applied == 1, f"{route}: reuse not applied"
            assert reused == got["usage"]["prompt_tokens"], f"{route}: decode counted {got['usage']['prompt_tokens']}, prefill gave {reused}"
        if route == "relay-stateless":
            # The ids rode back inside kv_transfer_params: that is the stateless handoff.
            assert isinstance(prefill_answer["kv_transfer_params"]["prompt_token_ids"], list)


def test_relay_prefill_answer_hides_ids_the_orchestrator_did_not_ask_for():
    req = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hide the ids"}]}
    _, _, direct = toy_orchestrate(PREFILL, DECODE, "/v1/chat/completions", req)
    _, _, via = toy_orchestrate(TOKENONCE, TOKENONCE, "/v1/chat/completions", req, "relay")
    assert direct["prompt_token_ids"] is None
    assert via["prompt_token_ids"] is None, "ids asked by tokenonce are not shown to the orchestrator"
    assert via["choices"][0]["token_ids"] is None
    # the handoff names this request's own blocks and ids; its shape and the rest are the same
    per_request = ("remote_request_id", "remote_block_ids")
    kv = lambda d: {k: v for k, v in d["kv_transfer_params"].items() if k not in per_request}  # noqa: E731
    assert kv(via) == kv(direct) and via["kv_transfer_params"].keys() == direct["kv_transfer_params"].keys()
    strip = lambda d: {k: v for k, v in d.items() if k not in ("id", "created", "system_fingerprint", "kv_transfer_params")}  # noqa: E731
    assert strip(via) == strip(direct)
