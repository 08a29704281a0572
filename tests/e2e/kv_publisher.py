#!/usr/bin/env python3
"""vLLM's own KV event publisher (vllm.distributed.kv_events.ZmqEventPublisher), driven line by
line from stdin, for tests/kv_events.rs: the messages, sequence numbers and replay answers
tokenonce's subscriber reads are the ones vLLM 0.32 makes.

One JSON command per line on stdin, one JSON answer per line on stdout:
  {"op": "start", "rank": R}    start the publisher (PUB + replay ROUTER on 127.0.0.1; the
                                 first start binds ports the OS picks, later ones the same)
                                 -> {"port": P, "replay_port": Q}  (rank R's: P and Q are the
                                 rank-0 ports, the sockets bind P + R and Q + R as vLLM does)
  {"op": "publish", "events": [...], "drop": false}
                                 publish one KVEventBatch; events are the fixture's shape
                                 ({"type": "BlockStored", "block_hashes": ..., ...},
                                 {"type": "BlockRemoved", ...}, {"type": "AllBlocksCleared"});
                                 drop: numbered and kept for replay but not sent on PUB
                                 -> {"seq": N}
  {"op": "stop"}                 shut the publisher down (its sockets close) -> {}
  {"op": "quit"}                 -> exits

vLLM binds its PUB socket only for wildcard endpoints (tcp://*:PORT); tests are loopback only,
so this script makes it bind 127.0.0.1 (`_is_bind_endpoint`); the rest is vLLM's code.
Run with the e2e tier's venv: ~/.cache/tokenonce-vllm-venv/bin/python (tests/e2e/vllm/setup.sh).
"""

import json
import socket
import sys
import time

import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

HOST = "127.0.0.1"  # loopback only
PUBLISH_WAIT_S = 10
BIND_ATTEMPTS = 100


def free_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def bindable(port):
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def free_ports(rank):
    """Two base ports P, Q with P..P+rank and Q..Q+rank all free and apart: rank R binds P + R
    and Q + R, and the OS's P + 1 may be taken (by Q, or by another process)."""
    for _ in range(BIND_ATTEMPTS):
        bases = (free_port(), free_port())
        spans = [range(b, b + rank + 1) for b in bases]
        if set(spans[0]) & set(spans[1]) or max(bases) + rank > 65535:
            continue
        if all(bindable(p) for span in spans for p in span):
            return bases
    raise RuntimeError(f"no two free port spans of {rank + 1} on {HOST}")


def event(e):
    kind = e["type"]
    if kind == "BlockStored":
        extra = e.get("extra_keys")
        return BlockStored(
            block_hashes=e["block_hashes"],
            parent_block_hash=e.get("parent_block_hash"),
            token_ids=e["token_ids"],
            block_size=e["block_size"],
            lora_id=None,
            medium=e.get("medium", "GPU"),
            lora_name=e.get("lora_name"),
            extra_keys=None if extra is None else [None if k is None else tuple(k) for k in extra],
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=e["block_hashes"], medium=e.get("medium", "GPU"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown event type {kind!r}")


class Dropping:
    """The PUB socket, but the next send is skipped (the batch still enters the replay buffer)."""

    def __init__(self, sock):
        self.sock = sock

    def send_multipart(self, frames, *args, **kwargs):
        return None

    def __getattr__(self, name):
        return getattr(self.sock, name)


def main():
    ZmqEventPublisher._is_bind_endpoint = staticmethod(lambda endpoint: True)
    publisher, ports, seq = None, None, 0
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "start":
            if ports is None:
                ports = free_ports(cmd.get("rank", 0))
            # A restart binds the ports the stopped publisher's sockets held: libzmq closes
            # them in its own thread, so a bind right after may find them still in use.
            for attempt in range(BIND_ATTEMPTS):
                try:
                    publisher = ZmqEventPublisher(
                        data_parallel_rank=cmd.get("rank", 0),
                        endpoint=f"tcp://{HOST}:{ports[0]}",
                        replay_endpoint=f"tcp://{HOST}:{ports[1]}",
                        topic="kv",
                    )
                    break
                except zmq.ZMQError:
                    if attempt == BIND_ATTEMPTS - 1:
                        raise
                    time.sleep(0.1)
            seq = 0
            answer = {"port": ports[0], "replay_port": ports[1]}
        elif op == "publish":
            real = publisher._pub
            if cmd.get("drop"):
                publisher._pub = Dropping(real)
            publisher.publish(KVEventBatch(ts=time.time(), events=[event(e) for e in cmd["events"]]))
            deadline = time.time() + PUBLISH_WAIT_S  # sent (or dropped) and in the replay buffer
            while publisher._event_queue.unfinished_tasks and time.time() < deadline:
                time.sleep(0.01)
            publisher._pub = real
            answer = {"seq": seq}
            seq += 1
        elif op == "stop":
            publisher.shutdown()
            publisher = None
            answer = {}
        elif op == "quit":
            break
        else:
            raise ValueError(f"unknown op {op!r}")
        print(json.dumps(answer), flush=True)
    if publisher is not None:
        publisher.shutdown()
    zmq.Context.instance().term()


if __name__ == "__main__":
    main()
