#!/usr/bin/env python3
"""Writes the seed corpora fuzz/corpus/<target>/ from the recorded real-vLLM exchanges
(tests/fixtures/vllm/*.json), the shipped configs (conf/*.toml) and a few hand-written edge
cases, in each target's input layout (see fuzz/README.md). Deterministic; rerun after
re-recording the fixtures: python3 fuzz/seeds.py"""

import hashlib
import json
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
MAX = 8192  # the -max_len fuzz/run.sh passes; larger fixtures are left out

CHAT, COMPLETIONS = 0, 1


def fixtures():
    for path in sorted((ROOT / "tests" / "fixtures" / "vllm").glob("*.json")):
        v = json.loads(path.read_text())
        api = COMPLETIONS if v["path"].startswith("/v1/completions") else CHAT
        yield path.stem, api, (v.get("request_body") or ""), v["response_body"]


def write(target, seeds):
    out = CORPUS / target
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    kept = 0
    for data in seeds:
        if isinstance(data, str):
            data = data.encode()
        if not data or len(data) > MAX:
            continue
        (out / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)
        kept += 1
    print(f"{target}: {kept} seeds")


def main():
    fx = list(fixtures())
    streams = [resp for name, _, _, resp in fx if resp.startswith("data:")]
    bodies = [(api, req, resp) for name, api, req, resp in fx if not resp.startswith("data:")]

    write(
        "sse_decoder",
        [bytes([seed]) + s.encode() for seed, s in enumerate(streams)]
        + [
            b"\x05data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":\n data: 2}\r\n\r\ndata: [DONE]\n\n",
            b"\x11data: {\"usage\":{\"prompt_tokens\":1},\ndata: \"x\":[1,\ndata: 2]}\n\n\n",
            b"\x00\n\n\r\n\r\ndata:\n\ndata\n\ndatabase: 1\n\nevent: x\r\rdata: y\r\n\r\n",
            b"\x03data:  {\"usage\":null}\n\ndata: {\"a\"",
        ],
    )

    json_seeds = []
    for _, _, req, resp in fx:
        for text, key, value in ((req, "max_tokens", "7"), (resp, "usage", '{"prompt_tokens":1}')):
            if text.startswith("{"):
                json_seeds.append(f"{text}\0{key}\0{value}")
    json_seeds += [
        '{"b": 1.0, "a":2,"nested":{"x":[1, 2.50, 1e3]},"s":"\\u00e9"}\0a\0[1,\n2]',
        '{"a":1,"b":2,"a":3}\0a\0null',
        '{"mod\\u0065l":"m"}\0model\0"x"',
        '{"k":"\\ud800"}\0\0-0',
        "[1,2]\0a\01",
    ]
    write("json_splice", json_seeds)

    ids = []
    for _, api, _, resp in fx:
        try:
            v = json.loads(resp)
        except ValueError:
            continue
        raw = v.get("prompt_token_ids") if isinstance(v, dict) else None
        if raw is None and isinstance(v, dict) and v.get("choices"):
            raw = v["choices"][0].get("prompt_token_ids")
        if raw:
            ids.append(json.dumps(raw, separators=(",", ":")))
    ids += ["[151644, 8948,198,0]", " [ 1 ] ", "[4294967295]", "[4294967296]", "[-0]", "[01]", "[1.0]",
            "[1e3]", "[]", "[1,]", '["1"]', "[[1]]", "\u00a0[1]", "[1]\u000c"]
    write("prompt_ids", ids)

    write("request_view", [bytes([api]) + req.encode() for api, req, _ in bodies if req] + [
        b"\x00" + b'{"messages":[{"role":"user","content":[{"typ\\u0065":"image_url","image_url":{"url":"x"}}]}]}',
        b"\x00" + b'{"messages":[{"content":[{"type":"text","text":"a"}]}],"n":2,"echo":true,"stream":null}',
        b"\x01" + b'{"prompt":[[1],[2]],"model":5}',
    ])

    nixl_kv = None
    for name, _, _, resp in fx:
        if name == "chat_prefill_nixl":
            nixl_kv = json.dumps(json.loads(resp)["kv_transfer_params"], separators=(",", ":"))
    rewrites = []
    for api, req, _ in bodies:
        if req.startswith("{"):
            for flags in (api, api | 2, api | 4):
                rewrites.append(bytes([flags]) + f"{req}\0{nixl_kv}\0[1,2,3]".encode())
    write("rewrites", rewrites)

    handoff = [bytes([api | (i << 1)]) + resp.encode() for i, (api, _, resp) in enumerate(bodies) if resp]
    handoff.append(b"\x00" + b'{"prompt_token_ids":[1,2],"usage":[2],"choices":[[null]]}')
    handoff.append(b"\x03" + b'{"choices":[{"prompt_token_ids":[9,8],"token_ids":[1]}],"usage":{"prompt_tokens":2,"prompt_tokens_details":null}}')
    write("handoff", handoff)

    configs = [p.read_text() for p in sorted((ROOT / "conf").glob("*.toml"))]
    configs += [
        '[server]\nlisten = "nowhere"\n\n[pools.decode]\nendpoints = ["127.0.0.1:8200", "bad host"]\n'
        'balance = "random"\n\n[[routes]]\nname = "r"\nmode = "orchestrate"\ndecode_pool = "missing"\n'
        "prefill_timeout_ms = 0\n",
        '[pools.decode]\nendpoints = ["127.0.0.1:8200"]\n[[routes]]\nname = "llmd"\nmode = "orchestrate"\n'
        'decode_pool = "decode"\nprefill = { header = "x-prefiller-host-port" }\n',
        "[server]\nlisten = \n",
    ]
    write("config", configs)

    # h1: flags (bit 0 raw, bit 1 HEAD, bit 2 raw chunked body), cut/encoding seed, data.
    uvicorn = "HTTP/1.1 200 OK\r\ndate: Wed, 02 Dec 2026 03:00:00 GMT\r\nserver: uvicorn\r\n"
    h1 = [bytes([0, i * 37 % 256]) + resp.encode() for i, (_, _, resp) in enumerate(bodies[:4]) if resp]
    h1 += [bytes([0, 0xE5]) + b"", bytes([0, 0x41]) + b"x" * 700]
    h1 += [
        bytes([1, 3]) + (uvicorn + "content-length: 11\r\ncontent-type: application/json\r\n\r\n{\"a\":true}HTTP/1.1").encode(),
        bytes([1, 9]) + (uvicorn + "transfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"
                         "1c\r\ndata: {\"choices\":[]}\n\n\r\n0\r\n\r\n").encode(),
        bytes([1, 0]) + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nContent-Length: 3\r\n\r\nabcdef",
        bytes([1, 1]) + b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        bytes([1, 2]) + b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
        bytes([1, 5]) + b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n",
        bytes([3, 5]) + b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n",
        bytes([1, 7]) + b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
        bytes([1, 8]) + b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        bytes([1, 4]) + b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\ncontent-length: +2\r\n\r\nno",
        bytes([5, 6]) + b"5;a=1\r\nhello\r\n0\r\nx-t: 1\r\nx-u: 2\r\n\r\nrest",
        bytes([5, 2]) + b"+5\r\nhello\r\n0\r\n\r\n",
        bytes([5, 3]) + b"5\r\nhelloXX0\r\n\r\n",
        bytes([5, 4]) + b"0\r\n" + b"x: 1\r\n" * 40 + b"\r\n",
    ]
    write("h1", h1)

    # engine_metrics: byte 0 = the rank (bit 7: the whole server), the page. The recorded
    # vLLM 0.32 pages are over the bound: the lines of the series read, with their comments.
    read = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info", "vllm:lora_requests_info")
    pages = []
    for path in sorted((ROOT / "tests" / "fixtures" / "vllm").glob("metrics-*.txt")):
        lines = path.read_text().splitlines(keepends=True)
        pages.append("".join(l for l in lines if any(n in l for n in read)))
    two_ranks = "".join(
        f'vllm:{name}{{engine="{e}",model_name="m"}} {v}\n'
        for e, vals in ((0, ("3.0", "8.0", "0.5")), (1, ("0.0", "1.0", "0.25")))
        for name, v in zip(("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"), vals)
    )
    metrics = [bytes([0]) + p.encode() for p in pages] + [bytes([0x80]) + p.encode() for p in pages]
    metrics += [
        bytes([1]) + two_ranks.encode(),
        bytes([0x80]) + two_ranks.encode(),
        bytes([0]) + (two_ranks + 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9\n').encode(),
        bytes([0]) + b'vllm:num_requests_waiting 1\r\nvllm:num_requests_running 2\r\nvllm:gpu_cache_usage_perc{x="\\"y\\n"} 0.75 1700000000000\r\n',
        bytes([0]) + b'vllm:num_requests_waiting{engine="0"} NaN\nvllm:num_requests_running{engine="0"} -1\n',
        bytes([0]) + b'vllm:cache_config_info{engine="0",num_gpu_blocks="4e12",block_size="None"} 1\n',
    ]
    write("engine_metrics", metrics)


if __name__ == "__main__":
    main()
