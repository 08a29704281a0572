#!/usr/bin/env python3
"""vLLM 0.32's own CPU per request for rendering and tokenizing the requests the local_ids
bench measures tokenonce on (issue 31 point 4): per family, vLLM's GPU-less render server
(started as record.py starts it) gets the same two chat requests, a ~32k-token first request
and its follow-up turn, on `/v1/chat/completions/render`, the code path `vllm serve`'s chat
endpoint runs before the engine (request parsing and validation, message preprocessing, the
chat template or Harmony/Mistral, tokenizing) plus writing the ids back as JSON (measured
apart too, REPLY_COST: `vllm serve` hands them to its engine instead).

CPU is the server's, read from /proc: every thread of the server process and of any process
under it, on-CPU nanoseconds per request (`/proc/PID/task/TID/schedstat`) for min/median/p90,
and `utime + stime` ticks (`/proc/PID/stat`) summed over the timed requests for the mean.
Warm-up requests are excluded; each request's window closes SETTLE_S after its answer (work
after the reply counts too). vLLM's ids are checked against tokenonce's (in the requests
file) outside the measurement.

    cargo bench --bench local_ids -- --families-only     # writes target/bench-families/*.json
    python3 tests/e2e/families/render_cost.py [--rounds N] [FAMILY ...]
    python3 tests/e2e/families/render_cost.py --table-only   # after a new bench run

Reads target/bench-families/requests.json (bodies and tokenonce's ids) and, when present,
tokenonce.json beside it (the bench's times) to print both side by side; writes vllm.json
there. Ports 18800-18899 (loopback). Python 3 standard library.
"""

import argparse
import glob
import http.client
import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import record  # noqa: E402  (start(), the families' server flags)

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
REQUESTS = os.path.join(REPO, "target", "bench-families", "requests.json")
PORT = 18810  # this script's range: 18800-18899
ROUNDS = 20
WARMUP = 3
SETTLE_S = 0.05
IDLE_S = 3.0
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
# How the e2e tier serves its Qwen3 (tests/e2e/stack.sh); the other families as record.py does.
SERVER_ARGS = dict(record.SERVER_ARGS, qwen3=["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                               "--reasoning-parser", "qwen3"])
# The tiny Phi-3.5 config says 4096 positions (Phi-3.5-mini itself serves 128k): room for the
# 32k-token requests, as a real Phi-3.5 folder has.
EXTRA_ARGS = {"phi3_5": ["--max-model-len", "40960"]}
EXTRA_ENV = {"phi3_5": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}}


def tree(root):
    """`root` and every process under it."""
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def cpu(pids):
    """(on-CPU ns of every thread, utime + stime ticks) of `pids`."""
    ns = ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
            for task in glob.glob(f"/proc/{pid}/task/*/schedstat"):
                with open(task) as f:
                    ns += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return ns, ticks


def send(conn, body):
    """One render request; once again on a new connection if the server closed an idle one
    (its keep-alive is 5 s)."""
    for attempt in range(2):
        try:
            conn.request("POST", "/v1/chat/completions/render", body=body.encode(),
                         headers={"content-type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        except (ConnectionError, http.client.RemoteDisconnected):
            conn.close()
            if attempt == 1:
                raise
    raise AssertionError("unreachable")


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stats(values):
    v = sorted(values)
    return {"min_ms": v[0], "median_ms": v[len(v) // 2], "p90_ms": v[min(len(v) * 9 // 10, len(v) - 1)]}


# What the render server spends on its answer and `vllm serve` does not (it hands the ids to
# the engine instead): the ids into a pydantic model, dumped, written as JSON (starlette's
# JSONResponse), median thread CPU ms of 25 in the venv's python.
REPLY_COST = """
import json, sys, time
from pydantic import BaseModel
from starlette.responses import JSONResponse
class Reply(BaseModel):
    request_id: str
    token_ids: list[int]
ids = json.load(sys.stdin)
times = []
for _ in range(25):
    t = time.thread_time()
    JSONResponse(content=Reply(request_id="chatcmpl-0", token_ids=ids).model_dump())
    times.append(time.thread_time() - t)
print(sorted(times)[len(times) // 2] * 1e3)
"""


def reply_cost(venv, ids):
    out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", REPLY_COST], input=json.dumps(ids),
                         capture_output=True, text=True, check=True)
    return float(out.stdout)


def measure(entry, venv, port, rounds):
    family, folder = entry["family"], entry["folder"]
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tokenonce-render-cost-{family}.log")
    with open(log_path, "w") as log:
        proc = record.start(folder, family, port, venv, log, args=SERVER_ARGS.get(family, []) + EXTRA_ARGS.get(family, []),
                            extra_env=dict(EXTRA_ENV.get(family, {}), TZ="UTC"))
        try:
            conn = http.client.HTTPConnection(record.HOST, port, timeout=300)
            requests = entry["requests"]
            # exactness first, untimed: vLLM's ids are tokenonce's
            checks = {}
            for req in requests:
                status, data = send(conn, req["body"])
                if status != 200:
                    sys.exit(f"render_cost: {family} {req['name']}: vLLM answered {status}: {data}")
                ids = data["token_ids"]
                checks[req["name"]] = {"tokens": len(ids), "equal": ids == req["ids"], "ids": ids,
                                       "first_difference": None if ids == req["ids"] else first_difference(ids, req["ids"])}
            for _ in range(WARMUP - 1):
                for req in requests:
                    send(conn, req["body"])
            pids = tree(proc.pid)
            idle_before = cpu(pids)[0]
            time.sleep(IDLE_S)
            idle_ms_per_s = (cpu(pids)[0] - idle_before) / 1e6 / IDLE_S
            per = {req["name"]: {"ns": [], "ticks": 0} for req in requests}
            for _ in range(rounds):
                for req in requests:
                    ns0, t0 = cpu(pids)
                    status, _ = send(conn, req["body"])
                    time.sleep(SETTLE_S)
                    ns1, t1 = cpu(pids)
                    if status != 200:
                        sys.exit(f"render_cost: {family} {req['name']}: vLLM answered {status}")
                    per[req["name"]]["ns"].append((ns1 - ns0) / 1e6)
                    per[req["name"]]["ticks"] += t1 - t0
            processes = len(tree(proc.pid))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    for check in checks.values():
        check["reply_ms"] = reply_cost(venv, check.pop("ids"))
    return {
        "family": family, "processes": processes, "idle_ms_per_s": idle_ms_per_s, "rounds": rounds,
        "requests": {name: dict(checks[name], **stats(p["ns"]),
                                mean_ms_from_ticks=p["ticks"] * TICK_S * 1e3 / rounds)
                     for name, p in per.items()},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=record.VENV)
    ap.add_argument("--requests", default=REQUESTS)
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--table-only", action="store_true", help="print the table from the last vllm.json")
    ap.add_argument("families", nargs="*")
    args = ap.parse_args()
    if not 18800 <= args.port <= 18899:
        sys.exit("render_cost: use a port in 18800-18899")
    with open(args.requests, encoding="utf-8") as f:
        doc = json.load(f)
    entries = [e for e in doc["families"] if not args.families or e["family"] in args.families]
    ours_path = os.path.join(os.path.dirname(args.requests), "tokenonce.json")
    ours = {}
    if os.path.exists(ours_path):
        with open(ours_path, encoding="utf-8") as f:
            ours = {e["family"]: e for e in json.load(f)["families"]}
    out = os.path.join(os.path.dirname(args.requests), "vllm.json")
    if args.table_only:
        with open(out, encoding="utf-8") as f:
            table(json.load(f)["families"], ours)
        return
    results = []
    for entry in entries:
        result = measure(entry, args.venv, args.port, args.rounds)
        results.append(result)
        for name, r in result["requests"].items():
            print(f"[render_cost] {entry['family']} {name}: {r['tokens']} tokens, ids equal tokenonce's: {r['equal']}; "
                  f"vLLM CPU ms min {r['min_ms']:.1f} median {r['median_ms']:.1f} p90 {r['p90_ms']:.1f} "
                  f"(mean from ticks {r['mean_ms_from_ticks']:.1f}; of which writing the ids ~{r['reply_ms']:.1f}); idle {result['idle_ms_per_s']:.2f} ms/s, "
                  f"{result['processes']} process(es)", flush=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"load_average": os.getloadavg(), "families": results}, f, indent=1)
    print(f"\nload average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; vLLM's numbers in {out}\n")
    table(results, ours)
    if not all(r["equal"] for result in results for r in result["requests"].values()):
        sys.exit("render_cost: vLLM's ids differ from tokenonce's for some request")


def table(results, ours):
    """vLLM's numbers beside tokenonce's (the bench's tokenonce.json), markdown."""
    print("| family | request | tokens | tokenonce CPU ms (min / median / p90) | vLLM CPU ms (min / median / p90; mean) "
          "| of which the ids as JSON | vLLM / tokenonce (medians) | ids equal |")
    print("|---|---|---:|---|---|---:|---:|---|")
    for result in results:
        for name, r in result["requests"].items():
            t = ours.get(result["family"], {}).get(name)
            mine = f"{t['min_ms']:.2f} / {t['median_ms']:.2f} / {t['p90_ms']:.2f}" if t else "-"
            ratio = f"{r['median_ms'] / t['median_ms']:.1f}x" if t and t["median_ms"] > 0 else "-"
            print(f"| {result['family']} | {name.replace('_', '-')} | {r['tokens']} | {mine} | "
                  f"{r['min_ms']:.1f} / {r['median_ms']:.1f} / {r['p90_ms']:.1f}; {r['mean_ms_from_ticks']:.1f} | "
                  f"{r['reply_ms']:.1f} | {ratio} | {'yes' if r['equal'] else 'NO, from id ' + str(r['first_difference'])} |")


if __name__ == "__main__":
    main()
