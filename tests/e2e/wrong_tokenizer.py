"""Writes a deliberately wrong tokenizer for the e2e tier's `wrongtok` route: the real Qwen3
tokenizer.json with its base vocabulary's ids rotated (same tokens, same merges, every id
meaning another token), so ids the real prefill echoes decode to other text.

Usage: python wrong_tokenizer.py MODEL_DIR/tokenizer.json OUT.json
"""

import json
import sys

src, out = sys.argv[1], sys.argv[2]
with open(src, encoding="utf-8") as f:
    tok = json.load(f)
vocab = tok["model"]["vocab"]
n = len(vocab)
assert sorted(vocab.values()) == list(range(n)), "expected a dense base vocabulary"
tok["model"]["vocab"] = {t: (i + 7919) % n for t, i in vocab.items()}
with open(out, "w", encoding="utf-8") as f:
    json.dump(tok, f, ensure_ascii=False)
