"""otlp_receiver.py: the e2e tier's trace collector on 127.0.0.1 (stack.sh starts it first).

OTLP/HTTP protobuf: `POST /v1/traces` bodies are decoded with the published
`opentelemetry-proto` package's `ExportTraceServiceRequest` (not a hand-written parser) and
kept in memory; both vLLM servers (`--otlp-traces-endpoint`) and tokenonce (`[tracing]`)
export here. `GET /spans?trace_id=HEX` answers the spans of one trace as JSON (every span
when no trace id is given), `GET /health` answers 200. Bodies that do not decode are counted
(`GET /spans` reports them in `bad_requests`) and answered 400.

Usage: otlp_receiver.py PORT
"""

import gzip
import json
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_BODY = 16 * 1024 * 1024
MAX_SPANS = 100_000  # a bound on memory: older spans are dropped beyond it

LOCK = threading.Lock()
SPANS = []
BAD = [0]


def any_value(v):
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind)


def attrs(kvs):
    return {kv.key: any_value(kv.value) for kv in kvs}


def flatten(req):
    out = []
    for rs in req.resource_spans:
        resource = attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({
                    "service": resource.get("service.name"),
                    "resource": resource,
                    "scope": ss.scope.name,
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex(),
                    "name": s.name,
                    "kind": s.kind,
                    "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "attributes": attrs(s.attributes),
                    "status_code": s.status.code,
                })
    return out


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_):
        pass

    def answer(self, status, body, content_type):
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        if self.path.split("?")[0] != "/v1/traces" or not 0 < length <= MAX_BODY:
            self.rfile.read(min(length, MAX_BODY))
            return self.answer(404 if length else 400, b"", "text/plain")
        body = self.rfile.read(length)
        try:
            if self.headers.get("content-encoding", "").lower() == "gzip":
                body = gzip.decompress(body)
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            spans = flatten(req)
        except Exception:  # noqa: BLE001 - any undecodable body is a bad request
            with LOCK:
                BAD[0] += 1
            return self.answer(400, b"", "text/plain")
        with LOCK:
            SPANS.extend(spans)
            del SPANS[:-MAX_SPANS]
        self.answer(200, ExportTraceServiceResponse().SerializeToString(), "application/x-protobuf")

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/health":
            return self.answer(200, b"ok", "text/plain")
        if url.path != "/spans":
            return self.answer(404, b"", "text/plain")
        trace_id = urllib.parse.parse_qs(url.query).get("trace_id", [None])[0]
        with LOCK:
            spans = [s for s in SPANS if trace_id is None or s["trace_id"] == trace_id]
            bad = BAD[0]
        self.answer(200, json.dumps({"spans": spans, "bad_requests": bad}).encode(), "application/json")


def main():
    port = int(sys.argv[1])
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"otlp receiver on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
