"""make_lora.py: a tiny PEFT LoRA adapter for the tier's tiny Qwen3 (rank 4 on q_proj and
v_proj of both layers, seeded weights), written as vLLM loads one: a folder holding
adapter_config.json and adapter_model.safetensors.

Usage: python make_lora.py MODEL_DIR OUT_DIR [--seed N]
Idempotent: an existing OUT_DIR with both files is left as it is.
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file

RANK = 4
TARGETS = ("q_proj", "v_proj")


def make(model_dir, out_dir, seed=0):
    config_path = os.path.join(out_dir, "adapter_config.json")
    weights_path = os.path.join(out_dir, "adapter_model.safetensors")
    if os.path.exists(config_path) and os.path.exists(weights_path):
        return out_dir
    with open(os.path.join(model_dir, "config.json")) as f:
        model = json.load(f)
    hidden = model["hidden_size"]
    head_dim = model.get("head_dim") or hidden // model["num_attention_heads"]
    out = {"q_proj": model["num_attention_heads"] * head_dim, "v_proj": model["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(RANK, hidden, generator=gen) * 0.1).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out[target], RANK, generator=gen) * 0.1).to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, weights_path + ".tmp", metadata={"format": "pt"})
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_dir,
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    with open(config_path + ".tmp", "w") as f:
        json.dump(adapter, f, indent=1)
    os.replace(weights_path + ".tmp", weights_path)
    os.replace(config_path + ".tmp", config_path)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make(args.model_dir, args.out_dir, args.seed))
