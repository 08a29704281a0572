#!/usr/bin/env python3
"""Writes the seed corpora fuzz/corpus/<target>/ from the recorded real-vLLM exchanges
(tests/fixtures/vllm/*.json), the KV events a real vLLM published
(tests/fixtures/kv_hashes/), the shipped configs (conf/*.toml) and a few hand-written edge
cases, in each target's input layout (see fuzz/README.md). Deterministic; rerun after
re-recording the fixtures: python3 fuzz/seeds.py"""

import hashlib
import json
import pathlib
import shutil
import struct

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


def msgpack(v):
    """v as msgspec's msgpack encoder writes it: the smallest form of each integer, length and
    string, floats as float64, dicts in their order (checked against vLLM's own encoder: see
    kv_batch)."""
    def head(n, fix, fix_max, wide):
        if n < fix_max:
            return bytes([fix | n])
        for marker, fmt, top in wide:
            if marker is not None and n <= top:
                return bytes([marker]) + struct.pack(fmt, n)
        raise ValueError(n)

    if v is None:
        return b"\xc0"
    if isinstance(v, bool):
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        if -32 <= v < 128:
            return struct.pack(">b", v) if v < 0 else bytes([v])
        forms = ([(0xcc, ">B", 0xFF), (0xcd, ">H", 0xFFFF), (0xce, ">I", 2**32 - 1), (0xcf, ">Q", 2**64 - 1)]
                 if v >= 0 else [(0xd0, ">b", -2**7), (0xd1, ">h", -2**15), (0xd2, ">i", -2**31), (0xd3, ">q", -2**63)])
        for marker, fmt, bound in forms:
            if (v <= bound) if v >= 0 else (v >= bound):
                return bytes([marker]) + struct.pack(fmt, v)
        raise ValueError(v)
    if isinstance(v, float):
        return b"\xcb" + struct.pack(">d", v)
    if isinstance(v, str):
        b = v.encode()
        return head(len(b), 0xa0, 32, [(0xd9, ">B", 0xFF), (0xda, ">H", 0xFFFF), (0xdb, ">I", 2**32 - 1)]) + b
    if isinstance(v, bytes):
        return head(len(v), 0xc4, 0, [(0xc4, ">B", 0xFF), (0xc5, ">H", 0xFFFF), (0xc6, ">I", 2**32 - 1)]) + v
    if isinstance(v, (list, tuple)):
        return head(len(v), 0x90, 16, [(None, "", 0), (0xdc, ">H", 0xFFFF), (0xdd, ">I", 2**32 - 1)]) + b"".join(map(msgpack, v))
    if isinstance(v, dict):
        return head(len(v), 0x80, 16, [(None, "", 0), (0xde, ">H", 0xFFFF), (0xdf, ">I", 2**32 - 1)]) + b"".join(
            msgpack(k) + msgpack(x) for k, x in v.items())
    raise TypeError(type(v))


KV_TS = 1764900000.25  # a fixed publish time: the seeds stay deterministic


def kv_event(e):
    """One event of the fixture as vLLM 0.32's msgspec writes it: `type` first, then its fields in
    vLLM's order (`lora_id` always nil; `medium` "GPU", as the engine's own cache reports), the
    fields left at their default (`extra_keys`, `group_idx` when None) omitted."""
    if e["type"] == "AllBlocksCleared":
        return {"type": "AllBlocksCleared"}
    if e["type"] == "BlockRemoved":
        out = {"type": "BlockRemoved", "block_hashes": e["block_hashes"], "medium": e.get("medium", "GPU")}
        if e.get("group_idx") is not None:
            out["group_idx"] = e["group_idx"]
        return out
    out = {"type": "BlockStored", "block_hashes": e["block_hashes"], "parent_block_hash": e.get("parent_block_hash"),
           "token_ids": e["token_ids"], "block_size": e["block_size"], "lora_id": None, "medium": "GPU",
           "lora_name": e.get("lora_name")}
    if e.get("extra_keys") is not None:
        out["extra_keys"] = e["extra_keys"]
    if e.get("group_idx") is not None:
        out["group_idx"] = e["group_idx"]
    return out


def kv_batch(events, rank=0):
    """A `KVEventBatch` payload: `[ts, events, data_parallel_rank]` (a None rank is written as
    nil: msgspec omits no array_like field), or `[ts, events]` with `rank="omitted"`.
    Byte for byte what vLLM's encoder gives for the same events: run this script with the vLLM
    venv's python (~/.cache/tokenonce-vllm-venv/bin/python) and it checks each batch so."""
    payload = msgpack([KV_TS, [kv_event(e) for e in events]] + ([] if rank == "omitted" else [rank]))
    if VLLM_KV is not None and rank != "omitted":
        kinds, batch_class = VLLM_KV
        def real(e):
            fields = {k: v for k, v in kv_event(e).items() if k != "type"}
            if "extra_keys" in fields:
                fields["extra_keys"] = [None if k is None else tuple(k) for k in fields["extra_keys"]]
            return kinds[e["type"]](**fields)
        theirs = VLLM_KV_ENCODE(batch_class(ts=KV_TS, events=[real(e) for e in events], data_parallel_rank=rank))
        assert theirs == payload, f"msgspec writes {theirs!r}, this script {payload!r}"
    return payload


try:  # only in the vLLM venv
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    VLLM_KV = ({"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared},
               KVEventBatch)
    VLLM_KV_ENCODE = msgspec.msgpack.Encoder().encode
except ImportError:
    VLLM_KV = None


def kv_seed(flags, payload, seq, topic=b"kv"):
    """kv_wire's layout: flags, the topic's length, the topic, the 8-byte sequence, the payload."""
    return bytes([flags, len(topic)]) + topic + seq.to_bytes(8, "big") + payload


def kv_seeds():
    fx = json.loads((ROOT / "tests" / "fixtures" / "kv_hashes" / "vllm_sha256_cbor.json").read_text())
    seeds, batches = [], []
    for r in fx["requests"]:
        # One message per sequence number when each carried one event, else the whole request's.
        if len(r["event_seqs"]) == len(r["events"]):
            batches += [(seq, [e]) for seq, e in zip(r["event_seqs"], r["events"])]
        else:
            batches.append((r["event_seqs"][0], r["events"]))
    # flags: bits 4-7 the index bound (minus 1) and the first slot, bit 3 hashes re-written as
    # digests; bits 0-2 clear (three frames, an 8-byte sequence).
    for i, (seq, events) in enumerate(batches):
        seeds.append(kv_seed((i % 16) << 4 | (i & 1) << 3, kv_batch(events), seq))
    stored = fx["requests"][0]["events"][0]
    removed = {"type": "BlockRemoved", "block_hashes": stored["block_hashes"][1:], "medium": "GPU"}
    cleared = {"type": "AllBlocksCleared"}
    seeds += [
        kv_seed(0x20, kv_batch([stored, removed, cleared, stored]), 41),
        kv_seed(0x10, kv_batch([removed], rank=None), 2**63),
        kv_seed(0x18, kv_batch([stored], rank="omitted"), 7),
        # A newer vLLM's event type, an offloaded block, another KV cache group, the digest form.
        kv_seed(0x70, msgpack([KV_TS, [{"type": "BlockPinned", "block_hashes": [1]},
                                       {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"},
                                       {"type": "BlockRemoved", "block_hashes": [b"\x07" * 32], "medium": None,
                                        "group_idx": 1}], 3]), 5),
        # vLLM's replay end marker: the sequence -1 and an empty payload.
        kv_seed(0x00, b"", 2**64 - 1, topic=b""),
        # Malformed: bytes after the batch, cut short, four frames, a 4-byte sequence.
        kv_seed(0x00, kv_batch([removed]) + b"\x90", 1),
        kv_seed(0x00, kv_batch([removed])[:-3], 1),
        kv_seed(0x03, kv_batch([removed]), 1),
        bytes([0x44, 2]) + b"kv" + b"\x00\x00\x00\x01" + kv_batch([cleared]),
    ]
    return seeds


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
    for path in sorted((ROOT / "tests" / "fixtures" / "engine_metrics").glob("vllm-*.txt")):
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
    write("kv_wire", kv_seeds())


if __name__ == "__main__":
    main()
