"""The KV paths tokenonce owns, on the real NIXL pair: what the client sees, what the prefill
logs and holds, what the decode pulls, what tokenonce counts. Runs last in the tier: its last
two tests crash a server (each is started again).

- A client gone after the prefill, before the decode leg reached the engine (the decode sits
  behind door.py, a TCP pipe whose accept queue the test holds full, so tokenonce's connect
  hangs): with `release` the decode is sent for one token, pulls the blocks, and the prefill
  holds nothing a moment later; with `abandon` nothing is sent and the prefill holds the blocks
  until its lease (30 s) ends with "Releasing expired KV blocks for request ...".
- A client gone while a non-streamed decode that already pulled is generating: nothing more
  is sent (`left_to_decode`): one pull. A second decode with the same handoff (what tokenonce
  sent before) pulled the freed blocks again: two transfers, and a second "Potentially invalid
  KV blocks for unrecognized request ... retrieved" line on the prefill.
- The decode killed mid-stream: the client's stream ends with an error event and [DONE].
- The prefill gone, then restarted, between the two legs of relayed requests: the decode's
  pull fails and vLLM fails the request (its default kv_load_failure_policy, fail).

The prefill's `vllm:kv_cache_usage_perc` is the measure of held blocks: one 128-token block of
its 1 GiB cache (16,384 blocks) reads 6.1e-05, none 0.

Run by tests/e2e/run.sh; by hand against a running stack:
    VENV/bin/python -m pytest tests/e2e/test_kv_paths_e2e.py
"""

import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid

import httpx

from engine_metrics import DecodePull, EXTERNAL, FAILED, LOCAL, TRANSFERS
from test_e2e import DECODE_PORT, HOST, MODEL, PREFILL_PORT, TIMEOUT_S, TOKENONCE_PORT, metric, scrape
from test_pd_e2e import REMOTE_DECODE
from test_relay_e2e import TOKENONCE

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_DIR = os.environ.get("E2E_RUN_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "tokenonce-e2e"))
PREFILL_LOG = os.path.join(RUN_DIR, f"vllm-{PREFILL_PORT}.log")
LEASE_S = 30
HTTP = httpx.Client(timeout=TIMEOUT_S)


class Door:
    """door.py, the decode pool `decode-door`'s endpoint (stack.sh starts it): closed, a
    connect to it hangs; open, it pipes to the decode."""

    def __init__(self):
        with open(os.path.join(RUN_DIR, "door.pid")) as f:
            self.pid = int(f.read())

    def close(self):
        os.kill(self.pid, signal.SIGUSR1)
        time.sleep(0.3)

    def open(self):
        os.kill(self.pid, signal.SIGUSR2)


def send_and_leave(body, after_s, route=None):
    """POSTs a chat through tokenonce and closes the connection after `after_s`, unanswered
    (a client that gives up). Returns the request id."""
    rid = "kvp-" + uuid.uuid4().hex[:12]
    raw = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {rid}\r\nContent-Length: {len(raw)}\r\n")
    if route:
        head += f"x-e2e-route: {route}\r\n"
    with socket.create_connection((HOST, TOKENONCE_PORT)) as s:
        s.sendall(head.encode() + b"\r\n" + raw)
        s.settimeout(after_s)
        try:
            got = s.recv(1)
        except socket.timeout:
            got = b""
        assert got == b"", f"tokenonce answered before the client left: {got!r}"
    return rid


def prefill_held():
    """The prefill's share of KV blocks in use (0 when it holds none)."""
    text = HTTP.get(f"http://{HOST}:{PREFILL_PORT}/metrics").text
    return float(re.search(r'^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$', text, re.M).group(1))


def until(what, deadline_s, step_s=0.2):
    """Polls `what()` until truthy (bounded); returns its last value."""
    end = time.monotonic() + deadline_s
    while True:
        value = what()
        if value or time.monotonic() > end:
            return value
        time.sleep(step_s)


def prefill_log(rid):
    """Lines of the prefill's log that name the request (vLLM names it chatcmpl-<rid>-<hex>)."""
    with open(PREFILL_LOG, errors="replace") as f:
        return [line for line in f if f"chatcmpl-{rid}-" in line]


def releases(snapshot, route, result):
    return metric(snapshot, "tokenonce_kv_releases_total", route=route, result=result)


def chat(text, **fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
            **fields}


def test_client_gone_before_the_decode_got_its_request():
    """`release` (route e2e-door): released at once. `abandon` (e2e-door-abandon): held until
    the lease ends, then freed by the prefill with its "expired" line."""
    # Blocks an earlier test left unpulled are freed by their lease (30 s) at the latest.
    assert until(lambda: prefill_held() == 0, LEASE_S + 5), "the prefill holds blocks before the test"
    door = Door()
    try:
        seen = {}
        for route, name in (("door", "e2e-door"), ("door-abandon", "e2e-door-abandon")):
            before = scrape()
            with DecodePull() as pull:
                door.close()
                rid = send_and_leave(chat(f"Leave before the decode, {route} " + uuid.uuid4().hex), 1.0, route)
                held_at_leave = prefill_held()
                door.open()
                time.sleep(2.5)  # the release's connect is let in at its next SYN (~1 s)
            after = scrape()
            seen[route] = (rid, held_at_leave, pull.delta(), prefill_held(), before, after, name)
        rid, held, pulled, held_after, before, after, name = seen["door"]
        assert held > 0, "the prefill held the prompt's blocks when the client left"
        assert releases(after, name, "released") - releases(before, name, "released") == 1
        assert pulled[TRANSFERS] == 1 and pulled[EXTERNAL] > 0 and pulled[FAILED] == 0, pulled
        assert held_after == 0 or until(lambda: prefill_held() == 0, 3), \
            "released: the prefill holds nothing once the release pulled"
        rid_a, held_a, pulled_a, held_after_a, before_a, after_a, name_a = seen["door-abandon"]
        assert held_a > 0
        assert releases(after_a, name_a, "abandoned") - releases(before_a, name_a, "abandoned") == 1
        assert pulled_a[TRANSFERS] == 0, f"abandon: nothing reached the decode ({pulled_a})"
        assert held_after_a > 0, "abandon: the prefill still holds the blocks"
        # The lease: the prefill frees the abandoned blocks ~30 s after its answer, and says so.
        expired = until(lambda: [line for line in prefill_log(rid_a) if "Releasing expired KV blocks" in line],
                        LEASE_S + 10, step_s=1.0)
        assert expired, f"no expiry line for {rid_a} within {LEASE_S + 10} s"
        assert "retrieved by 0 remote worker(s)" in expired[0], expired[0]
        assert until(lambda: prefill_held() == 0, 5), "the lease ended: the prefill holds nothing"
        # ...and never for the released one.
        assert not [line for line in prefill_log(rid) if "expired" in line], prefill_log(rid)
    finally:
        door.open()


def test_client_gone_after_the_decode_pulled():
    """A non-streamed decode generating 4000 tokens (seconds here even on a quiet machine: 400
    once took under 1.5 s) has pulled when the client leaves after 1.5 s: tokenonce closes it
    and sends nothing more."""
    before = scrape()
    with DecodePull() as pull:
        rid = send_and_leave(chat("Tell me a long story " + uuid.uuid4().hex, max_tokens=4000, ignore_eos=True), 1.5)
        time.sleep(2.0)
    after = scrape()
    route = "e2e-reuse"
    assert releases(after, route, "left_to_decode") - releases(before, route, "left_to_decode") == 1
    for result in ("released", "failed", "timeout", "abandoned"):
        assert releases(after, route, result) == releases(before, route, result), result
    d = pull.delta()
    assert d[TRANSFERS] == 1 and d[FAILED] == 0 and d[LOCAL] == 0, f"one pull, no second decode: {d}"
    assert until(lambda: prefill_held() == 0, 5), "the pull freed the prefill's blocks"
    # The prefill processes the decode's notification on its next step: give it one.
    HTTP.post(f"http://{HOST}:{PREFILL_PORT}/v1/completions", json={"model": MODEL, "prompt": "step", "max_tokens": 1})
    time.sleep(1.0)
    # vLLM's decode, aborted after its pull, notifies the prefill once more (its abort clean-up);
    # the prefill, which freed the blocks at the first, logs that as "Potentially invalid KV
    # blocks for unrecognized request ... retrieved" without any read. A release (a second
    # decode with the same handoff) made it two lines and a second read of the freed blocks.
    invalid = [line for line in prefill_log(rid) if "Potentially invalid KV blocks" in line]
    assert len(invalid) <= 1, invalid
    # The decode dropped the request it was generating.
    running_none = re.compile(r'^vllm:num_requests_running\{[^}]*\} 0\.0$', re.M)
    assert until(lambda: running_none.search(HTTP.get(f"http://{HOST}:{DECODE_PORT}/metrics").text), 10), \
        "the decode still runs the request the client left"


def test_decode_killed_mid_stream_ends_the_stream_with_an_error_event():
    before = scrape()
    events, error = [], None
    with HTTP.stream("POST", f"http://{HOST}:{TOKENONCE_PORT}/v1/chat/completions",
                     # Long enough that the stream cannot end before the kill lands on a loaded machine.
                     json=chat("A long answer " + uuid.uuid4().hex, max_tokens=12000, ignore_eos=True, stream=True)) as r:
        assert r.status_code == 200
        killed = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 5 and not killed:
                subprocess.run(["bash", os.path.join(HERE, "stack.sh"), "kill-decode"], check=True, timeout=30)
                killed = True
            if line != "data: [DONE]" and "error" in json.loads(line[6:]):
                error = json.loads(line[6:])["error"]
    after = scrape()
    try:
        assert killed and events[-1] == "data: [DONE]", events[-3:]
        assert error and error["code"] == "decode_stream_failed", (error, events[-3:])
        assert str(DECODE_PORT) not in json.dumps(error), "no internal address reaches the client"
        errs = (metric(after, "tokenonce_upstream_errors_total", stage="decode", kind="stream_broken")
                - metric(before, "tokenonce_upstream_errors_total", stage="decode", kind="stream_broken"))
        assert errs == 1, errs
        outcome = (metric(after, "tokenonce_requests_total", route="e2e-reuse", outcome="server_error")
                   - metric(before, "tokenonce_requests_total", route="e2e-reuse", outcome="server_error"))
        assert outcome == 1, outcome
    finally:
        subprocess.run(["bash", os.path.join(HERE, "stack.sh"), "restart-decode"], check=True, timeout=400)


def relayed_prefill(req, headers):
    """The prefill leg of a relayed request (as test_relay_e2e's orchestrator sends it)."""
    leg = {**req, "stream": False, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}
    handed = HTTP.post(f"{TOKENONCE}/v1/chat/completions", json=leg, headers=headers).json()
    assert handed["kv_transfer_params"]["transfer_mode"] == "pull", handed
    return handed["kv_transfer_params"]


def relayed_decode(req, headers, kv):
    """The decode leg of a relayed request, its handoff as the prefill gave it; with what the
    decode counted (settled on a failed transfer or a pull)."""
    before = scrape()
    with DecodePull() as pull:
        r = HTTP.post(f"{TOKENONCE}/v1/chat/completions", json={**req, "kv_transfer_params": kv}, headers=headers)
    d = pull.settled(lambda d: d[FAILED] >= 1 or d[TRANSFERS] >= 1)
    return r, d, before, scrape()


def test_prefill_gone_or_restarted_between_the_legs_of_a_relayed_request():
    """Two relayed requests get their prefill legs answered (their KV on the prefill); then the
    prefill crashes. What vLLM 0.32 does with the first decode leg, the prefill still gone: the
    decode's NIXL handshake with it times out, it counts a failed transfer, computes nothing
    and answers 500 "Internal server error"; tokenonce relays that answer as is (an engine's
    own answer) and counts the request a server error, its reuse `decode_failed` (ids sent, no 2xx). The prefill is then started again (a
    new engine id, none of the old blocks) and the second decode leg arrives with its old
    handoff: the same, failed transfers (2 seen) and vLLM's 500. The decode's log says why:
    "Failing 1 request(s) due to KV load failure (failure_policy=fail, ...)", vLLM 0.32's
    default `kv_load_failure_policy`."""
    reqs, headers = [], []
    for i in range(2):
        reqs.append({"model": MODEL, "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                     "messages": [{"role": "user", "content": f"The prefill will be gone {i} " + uuid.uuid4().hex}]})
        headers.append({"X-Request-Id": str(uuid.uuid4()), "x-e2e-route": "relay"})
    kvs = [relayed_prefill(r, h) for r, h in zip(reqs, headers)]
    subprocess.run(["bash", os.path.join(HERE, "stack.sh"), "kill-prefill"], check=True, timeout=30)
    route = "e2e-relay"

    r, d, before, after = relayed_decode(reqs[0], headers[0], kvs[0])
    delta = lambda name, **labels: metric(after, name, route=route, **labels) - metric(before, name, route=route, **labels)  # noqa: E731
    assert d[FAILED] == 1 and d[EXTERNAL] == 0 and d[LOCAL] == 0, f"one failed pull, nothing computed: {d}"
    assert r.status_code == 500, (r.status_code, r.text[:300])
    assert r.json() == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                  "param": None, "code": 500}}, r.text[:300]
    # The ids were handed over and the decode answered 500: counted by that outcome.
    assert delta("tokenonce_token_reuse_total", result="decode_failed") == 1, "the ids were handed over"
    assert delta("tokenonce_token_reuse_total", result="applied") == 0
    assert delta("tokenonce_requests_total", outcome="server_error") == 1

    subprocess.run(["bash", os.path.join(HERE, "stack.sh"), "start-prefill"], check=True, timeout=400)
    r, d, before, after = relayed_decode(reqs[1], headers[1], kvs[1])
    assert d[FAILED] >= 1 and d[EXTERNAL] == 0 and d[LOCAL] == 0, f"failed pulls, nothing computed: {d}"
    assert r.status_code == 500 and r.json()["error"]["message"] == "Internal server error", r.text[:300]
    # The relay kept the ids for the cache's TTL (30 s): a restart that took longer finds
    # them gone (cache_miss, a text decode with the old handoff); either way one decision.
    handed = delta("tokenonce_token_reuse_total", result="decode_failed")
    missed = delta("tokenonce_token_reuse_total", result="fallback", reason="cache_miss")
    assert (handed, missed) in ((1, 0), (0, 1)), (handed, missed)
    assert delta("tokenonce_token_reuse_total", result="applied") == 0
    assert delta("tokenonce_requests_total", outcome="server_error") == 1
