#!/usr/bin/env python3
"""Drift of another vLLM's rendering from the one tokenonce's local ids are proven against:
records every family's corpus (record.py's, chat and completions) from the render server of
the vLLM in `--venv` into a scratch folder, then compares it case by case with the committed
fixtures (tests/fixtures/families/<family>.json, vLLM 0.32) and prints, per family and request
shape (tokenonce's shape labels: completions, chat, chat_system, chat_multi_turn, chat_tools,
chat_continue):

    same       both answered with the same prompt ids, or both refused
    ids        both answered, different ids: local ids would be wrong on that vLLM
    status     one answered, the other refused (a refusal tokenonce mirrors, or no longer)

and the cases that differ, with where their ids first part. gpt-oss's system message carries
a date: the recording pins the committed fixture's (`VLLM_SYSTEM_START_DATE`). Exit status 1
when anything drifted, 0 when the other vLLM renders every case as 0.32 does. Not in CI: it
needs a second vLLM (tens of GB); docs/parity.md says how to get one and gives the last
result.

Usage: python3 tests/e2e/families/drift.py --venv OTHER_VENV [--models DIR] [--keep DIR]
                                           [FAMILY ...]
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import record  # noqa: E402  (the corpus, the render server, the fixture format)

SHAPES = ["completions", "chat", "chat_system", "chat_multi_turn", "chat_tools", "chat_continue"]


def shape(case):
    """tokenonce's shape label of a recorded request (src/local/mod.rs `shape_label`)."""
    if case.get("api") == "completions":
        return "completions"
    body = json.loads(case["body"])
    messages = body.get("messages") or []
    roles = [m.get("role") for m in messages if isinstance(m, dict)]
    if body.get("tools") or "tool" in roles or any(isinstance(m, dict) and m.get("tool_calls") for m in messages):
        return "chat_tools"
    if body.get("continue_final_message"):
        return "chat_continue"
    if roles.count("user") > 1:
        return "chat_multi_turn"
    if "system" in roles or "developer" in roles:
        return "chat_system"
    return "chat"


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(base, other):
    """{shape: {"same", "ids", "status"}: count} and the differing cases' lines."""
    table = {s: {"same": 0, "ids": 0, "status": 0} for s in SHAPES}
    lines = []
    theirs = {c["name"]: c for c in other["cases"]}
    for case in base["cases"]:
        name = case["name"]
        o = theirs.pop(name, None)
        if o is None or o["body"] != case["body"]:
            lines.append(f"  {name}: not recorded alike by the other vLLM's corpus (record.py changed?)")
            continue
        row = table[shape(case)]
        if case["status"] == 200 and o["status"] == 200:
            if case["prompt_token_ids"] == o["prompt_token_ids"]:
                row["same"] += 1
            else:
                row["ids"] += 1
                a, b = case["prompt_token_ids"], o["prompt_token_ids"]
                at = first_difference(a, b)
                lines.append(f"  {name} ({shape(case)}): ids differ at {at} of {len(a)}/{len(b)}: "
                             f"0.32 {a[at:at + 6]} / other {b[at:at + 6]}")
        elif (case["status"] == 200) == (o["status"] == 200):
            row["same"] += 1
        else:
            row["status"] += 1
            lines.append(f"  {name} ({shape(case)}): 0.32 {case['status']}, other {o['status']}: "
                         f"{(case.get('error') or o.get('error') or '')[:160]}")
    lines += [f"  {name}: only in the other vLLM's recording" for name in theirs]
    return table, lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", required=True, help="the other vLLM's venv (its python runs the render server)")
    ap.add_argument("--models", default=None, help="the family folders (default: the e2e venv's)")
    ap.add_argument("--port", type=int, default=record.PORT)
    ap.add_argument("--keep", default=None, help="write the other vLLM's fixtures here (default: a temp dir)")
    ap.add_argument("families", nargs="*", default=list(record.SERVER_ARGS))
    args = ap.parse_args()
    models = args.models or os.environ.get("TOKENONCE_FAMILIES_DIR") or os.path.join(record.VENV, "models", "families")
    out_dir = args.keep or tempfile.mkdtemp(prefix="tokenonce-drift-")
    version = record.vllm_version(args.venv)
    # PyPI's vllm wheel is a CUDA build: its GPU-less render server runs with the CPU platform
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    drifted = 0
    report = []
    for family in args.families:
        with open(os.path.join(record.FIXTURES, f"{family}.json"), encoding="utf-8") as f:
            base = json.load(f)
        path = record.record(family, os.path.join(models, family), args.port, args.venv, out_dir,
                             base.get("recorded_on"))
        with open(path, encoding="utf-8") as f:
            other = json.load(f)
        table, lines = compare(base, other)
        report.append((family, table, lines))
        drifted += len(lines)
    print(f"\ndrift of vLLM {version} from the fixtures' {base['vllm_version']} (its recordings in {out_dir})")
    print(f"{'family':<12} {'shape':<16} {'same':>5} {'ids':>5} {'status':>7}")
    for family, table, lines in report:
        for s in SHAPES:
            row = table[s]
            if sum(row.values()):
                print(f"{family:<12} {s:<16} {row['same']:>5} {row['ids']:>5} {row['status']:>7}")
        if lines:
            print("\n".join(lines))
    total = sum(sum(r.values()) for _, t, _ in report for r in t.values())
    print(f"{total} cases, {drifted} drifted")
    sys.exit(1 if drifted else 0)


if __name__ == "__main__":
    main()
