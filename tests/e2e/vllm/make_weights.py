"""Seeded weights for the tier's tiny Qwen3 whose answers depend on the prompt.

vLLM's `--load-format dummy` draws weights uniform in +-1e-3: every prompt then gives the same
answer, and "output equals the direct call" proves nothing about the ids or the KV a decode used.
This writes `model.safetensors` (bf16, ~20 MB) into the model folder: every matrix and the
embedding normal with std 0.02 from a fixed seed, every RMSNorm gain 1 except the attention's
q/k norms at 2 (sharper attention, so the answer follows the context). Same seed, same file,
byte for byte. Usage: python make_weights.py MODEL_DIR  (reads MODEL_DIR/config.json).
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

SEED = 20261202
STD = 0.02
QK_NORM_GAIN = 2.0


def tensors(cfg):
    g = torch.Generator().manual_seed(SEED)
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_dim = cfg["num_attention_heads"] * head_dim
    kv_dim = cfg["num_key_value_heads"] * head_dim

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * STD).to(torch.bfloat16)

    def gain(n, value=1.0):
        return torch.full((n,), value, dtype=torch.bfloat16)

    out = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden), "model.norm.weight": gain(hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": gain(hidden),
            p + "post_attention_layernorm.weight": gain(hidden),
            p + "self_attn.q_proj.weight": normal(q_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_dim),
            p + "self_attn.q_norm.weight": gain(head_dim, QK_NORM_GAIN),
            p + "self_attn.k_norm.weight": gain(head_dim, QK_NORM_GAIN),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        })
    return out


def main(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg.get("tie_word_embeddings"), "the tier's model ties its embeddings (no lm_head)"
    path = os.path.join(model_dir, "model.safetensors")
    save_file(tensors(cfg), path + ".tmp", metadata={"format": "pt", "seed": str(SEED)})
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main(sys.argv[1])
