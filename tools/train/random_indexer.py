#!/usr/bin/env python3
"""Copy a DeepSeek-V3.2 model folder with its lightning indexers replaced by random ones of another size.

    python3 tools/train/random_indexer.py --src models/dayzero-tiny --out OUTDIR --heads 64 --dim 128

Every layer's indexer gets index_n_heads x index_head_dim (config.json updated) and Gaussian BF16 weights
(wq_b std q_lora_rank^-0.5, wk and weights_proj std hidden_size^-0.5; k_norm weight 1, bias 0); every
other tensor and the tokenizer are copied unchanged. What for: measuring how the FP8 indexer mode's
number format behaves at another indexer size on the model's real hidden states
(dz indexer-fp8 --model OUTDIR; its same-input recall depends only on the indexer's inputs and weights).
A random indexer selects poorly, so the end-to-end numbers of such a model say nothing about a trained one.
Standard library only.
"""
import argparse
import array
import json
import os
import random
import shutil
import struct
import sys


def bf16_bytes(values):
    """float32 -> BF16 by truncation (random values: rounding does not matter), little-endian."""
    raw = array.array("f", values).tobytes()
    return b"".join(raw[i + 2: i + 4] for i in range(0, len(raw), 4))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", required=True, help="model folder (config.json, model.safetensors, tokenizer)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(a.src, "config.json")))
    if a.heads < 1 or a.dim < cfg["qk_rope_head_dim"]:
        sys.exit(f"error: --heads must be >= 1 and --dim >= qk_rope_head_dim ({cfg['qk_rope_head_dim']})")
    names = os.listdir(a.src)
    if [n for n in names if n.endswith(".safetensors")] != ["model.safetensors"]:
        sys.exit(f"error: {a.src}: expected one model.safetensors")
    os.makedirs(a.out, exist_ok=True)
    for n in names:
        if n.startswith("tokenizer"):
            shutil.copy(os.path.join(a.src, n), a.out)
    cfg.update(index_n_heads=a.heads, index_head_dim=a.dim)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    blob = open(os.path.join(a.src, "model.safetensors"), "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8: 8 + n])
    data = blob[8 + n:]
    tensors = {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]: v["data_offsets"][1]])
               for k, v in header.items() if k != "__metadata__"}
    rng = random.Random(a.seed)

    def gauss(shape, std):
        return "BF16", shape, bf16_bytes(rng.gauss(0.0, std) for _ in range(shape[0] * shape[1]))

    H, D, R, hid = a.heads, a.dim, cfg["q_lora_rank"], cfg["hidden_size"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn.indexer."
        if p + "wq_b.weight" not in tensors:
            sys.exit(f"error: {p}wq_b.weight missing")
        tensors[p + "wq_b.weight"] = gauss([H * D, R], R ** -0.5)
        tensors[p + "wk.weight"] = gauss([D, hid], hid ** -0.5)
        tensors[p + "weights_proj.weight"] = gauss([H, hid], hid ** -0.5)
        tensors[p + "k_norm.weight"] = ("BF16", [D], bf16_bytes([1.0] * D))
        tensors[p + "k_norm.bias"] = ("BF16", [D], bf16_bytes([0.0] * D))
    out = {"__metadata__": header.get("__metadata__", {"format": "pt"})}
    off, parts = 0, []
    for k in sorted(tensors):
        dt, shape, raw = tensors[k]
        out[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        parts.append(raw)
    hj = json.dumps(out).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(os.path.join(a.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for raw in parts:
            f.write(raw)
    print(f"{a.out}: indexer {H} x {D} (random, seed {a.seed}), {os.path.getsize(os.path.join(a.out, 'model.safetensors')) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
