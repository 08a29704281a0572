"""One trace across the client, tokenonce and both real vLLM servers (run by tests/e2e/run.sh).

stack.sh starts the OTLP receiver (tests/e2e/otlp_receiver.py, 127.0.0.1:18400; it decodes with
`opentelemetry-proto`'s ExportTraceServiceRequest) first, then both vLLM servers with
`--otlp-traces-endpoint http://127.0.0.1:18400/v1/traces` over OTLP/HTTP protobuf (service
names `vllm-prefill`, `vllm-decode`), and tokenonce with `[tracing]` to the same receiver.

A chat request with the client's own `traceparent` goes through tokenonce (default route, reuse
on), streamed and not. In the receiver, under the client's trace id:
  - tokenonce's request span, child of the client's span, with the reuse result;
  - its `prefill`, `handoff` and `decode` spans, children of the request span;
  - vLLM's `llm_request` span from the prefill server, child of tokenonce's `prefill` span, with
    max_tokens 1 (the rewritten prefill leg), and from the decode server, child of tokenonce's
    `decode` span, with the client's max_tokens and the response's prompt token count.
Every wait is bounded (vLLM batches spans every 200 ms here, tokenonce every second). Spans
that never arrive fail the test with what did arrive; there is no skip.

By hand against a running stack:  VENV/bin/python -m pytest tests/e2e/test_tracing_e2e.py
"""

import json
import os
import secrets
import time

import httpx
import pytest

from engine_metrics import DecodePull

from test_e2e import HOST, MODEL, TIMEOUT_S, TOKENONCE_PORT

OTLP_PORT = int(os.environ.get("E2E_OTLP_PORT", "18400"))
SPANS_DEADLINE_S = 30.0
MAX_TOKENS = 8


def spans_of(trace_id):
    r = httpx.get(f"http://{HOST}:{OTLP_PORT}/spans", params={"trace_id": trace_id}, timeout=5.0)
    r.raise_for_status()
    body = r.json()
    assert body["bad_requests"] == 0, "the receiver got OTLP bodies it could not decode"
    return body["spans"]


def one(spans, what, **match):
    found = [s for s in spans if all(s.get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"{what}: want exactly one span with {match}, got {len(found)} in:\n{describe(spans)}"
    return found[0]


def describe(spans):
    return "\n".join(f"  {s['service']}: {s['name']!r} span {s['span_id']} parent {s['parent_span_id'] or '-'}"
                     for s in spans) or "  (none)"


def wait_for_trace(trace_id, want):
    """The trace's spans once `want(spans)` holds, or the last look at the deadline."""
    deadline = time.monotonic() + SPANS_DEADLINE_S
    while True:
        spans = spans_of(trace_id)
        if want(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.25)


def complete(spans):
    names = {(s["service"], s["name"]) for s in spans}
    return {("vllm-prefill", "llm_request"), ("vllm-decode", "llm_request"),
            ("tokenonce", "POST /v1/chat/completions"), ("tokenonce", "decode")} <= names


def chat(traceparent, stream):
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "Trace this: name two rivers."}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(f"http://{HOST}:{TOKENONCE_PORT}/v1/chat/completions", json=body,
                   headers={"traceparent": traceparent}, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["usage"]
    events = [json.loads(line[5:]) for line in r.text.splitlines()
              if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert usage, "the stream carried no usage"
    return usage[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_vllm_spans_join_tokenonces_trace_under_the_clients_trace_id(stream):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    with DecodePull() as pull:
        usage = chat(f"00-{trace_id}-{client_span}-01", stream)
    pull.assert_pulled(usage["prompt_tokens"])

    spans = wait_for_trace(trace_id, complete)
    if not any((s["service"] or "").startswith("vllm") for s in spans):
        pytest.fail("no span of either vLLM server arrived under the client's trace id within "
                    f"{SPANS_DEADLINE_S:.0f} s: vLLM's tracing (--otlp-traces-endpoint) does not work "
                    f"on this build; see vllm-1810*.log in the run dir. Spans seen:\n{describe(spans)}")

    request = one(spans, "tokenonce's request span", service="tokenonce", name="POST /v1/chat/completions")
    assert request["parent_span_id"] == client_span, "tokenonce continues the client's traceparent"
    assert request["attributes"].get("tokenonce.reuse.result") == "applied", request["attributes"]
    assert request["attributes"].get("gen_ai.usage.input_tokens") == usage["prompt_tokens"], request["attributes"]
    legs = {}
    for name in ("prefill", "handoff", "decode"):
        legs[name] = one(spans, f"tokenonce's {name} span", service="tokenonce", name=name)
        assert legs[name]["parent_span_id"] == request["span_id"], (name, describe(spans))
    first_byte = one(spans, "tokenonce's decode first byte span", service="tokenonce", name="decode first byte")
    assert first_byte["parent_span_id"] == legs["decode"]["span_id"]

    prefill = one(spans, "vLLM prefill's llm_request", service="vllm-prefill", name="llm_request")
    decode = one(spans, "vLLM decode's llm_request", service="vllm-decode", name="llm_request")
    assert prefill["parent_span_id"] == legs["prefill"]["span_id"], "the prefill leg sends its own span"
    assert decode["parent_span_id"] == legs["decode"]["span_id"], "the decode leg sends its own span"
    assert prefill["attributes"].get("gen_ai.request.max_tokens") == 1, prefill["attributes"]
    assert decode["attributes"].get("gen_ai.request.max_tokens") == MAX_TOKENS, decode["attributes"]
    # The decode ran the relayed ids: vLLM counted the prompt the client's usage reports.
    assert decode["attributes"].get("gen_ai.usage.prompt_tokens") == usage["prompt_tokens"], decode["attributes"]
    assert prefill["attributes"].get("gen_ai.usage.prompt_tokens") == usage["prompt_tokens"], prefill["attributes"]
    # Nothing else of this request's trace was made by another process.
    assert {s["service"] for s in spans} == {"tokenonce", "vllm-prefill", "vllm-decode"}, describe(spans)
