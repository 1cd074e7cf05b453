#!/usr/bin/env python3
"""Tiny random gpt-oss checkpoints in the published layout, plus transformers' reference outputs.

Run on a machine with PyTorch and transformers (the GPU machine; the reference runs on its CPU in
float32):

    python3 tools/reference/gpt_oss_fixtures.py --out OUTDIR

It writes OUTDIR/gpt_oss_tiny/:
  config.json                      gpt_oss config with quantization_config mxfp4
  model-0000k-of-0000n.safetensors the published layout: experts as *_blocks/*_scales MXFP4 (U8,
                                   interleaved nibbles), everything else BF16; sharded
  model.safetensors.index.json
  reference.safetensors            per prompt i: prompt.i I64 [T], logits.i F32 [T, vocab],
                                   greedy.i I64 [12], margin.i F32 [12] (top1 - top2 logit gap)
  reference.json                   provenance: versions, seed, how the checkpoint round-trips
Copy the folder to tests/data/. The reference model holds exactly the checkpoint's values (BF16
weights, dequantised MXFP4 experts) in float32; the checkpoint is also loaded back through
transformers' own MXFP4 path (Mxfp4Config(dequantize=True)) and its logits compared.
"""
import argparse
import json
import os
import sys

import torch

from mxfp4 import dequant_mxfp4, quantize_mxfp4  # this folder (scripts run from it)



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--hf-src", action="store_true", help="also save transformers' gpt_oss sources for reading")
    args = ap.parse_args()
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)
    H, I, E, V = 64, 96, 8, 512
    cfg = AutoConfig.for_model(
        "gpt_oss", vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=E,
        num_experts_per_tok=4, experts_per_token=4, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    print("config:", cfg.to_json_string(), flush=True)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", torch_dtype=torch.float32).eval()

    # Non-trivial random values everywhere, scaled so activations stay O(1) and logits spread.
    blocks = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
            elif p.dim() >= 2:
                fan_in = p.shape[-1] if not name.endswith(("gate_up_proj", "down_proj")) else None
                p.copy_(torch.randn_like(p) / (fan_in ** 0.5 if fan_in else 1.0))
            else:
                p.copy_(torch.randn_like(p))
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                kind = "gate_up_proj" if name.endswith("gate_up_proj") else "down_proj"
                out_dim = 2 * I if kind == "gate_up_proj" else H
                in_dim = H if kind == "gate_up_proj" else I
                if tuple(p.shape[1:]) == (in_dim, out_dim):
                    transposed = True
                    w = p.transpose(1, 2)
                elif tuple(p.shape[1:]) == (out_dim, in_dim):
                    transposed = False
                    w = p
                else:
                    sys.exit(f"unexpected expert shape {name} {tuple(p.shape)}")
                w = torch.randn(w.shape) / in_dim ** 0.5
                b, s = quantize_mxfp4(w)
                deq = dequant_mxfp4(b, s)
                p.copy_(deq.transpose(1, 2) if transposed else deq)
                blocks[name] = (b, s, transposed)
            else:
                p.copy_(p.to(torch.bfloat16).float())  # the checkpoint stores BF16 exactly
    print("expert layout in transformers:", {k: ("[E,in,out]" if v[2] else "[E,out,in]") for k, v in blocks.items()})

    # The published layout.
    tensors = {}
    for name, p in model.state_dict().items():
        if name in blocks:
            b, s, _ = blocks[name]
            tensors[name + "_blocks"] = b
            tensors[name + "_scales"] = s
        else:
            tensors[name] = p.to(torch.bfloat16).contiguous()
    odir = os.path.join(args.out, "gpt_oss_tiny")
    os.makedirs(odir, exist_ok=True)
    from safetensors.torch import save_file
    names = sorted(tensors)
    n_shards = 3
    weight_map = {}
    for si in range(n_shards):
        fname = f"model-{si + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[si::n_shards]}
        save_file(part, os.path.join(odir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(odir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cdict = json.loads(cfg.to_json_string())
    cdict.pop("_attn_implementation", None)
    cdict["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    cdict["torch_dtype"] = "bfloat16"
    with open(os.path.join(odir, "config.json"), "w") as f:
        json.dump(cdict, f, indent=2)

    # Reference outputs: full recomputation (no KV cache) at every step.
    gen = torch.Generator().manual_seed(args.seed + 1)
    lengths = [7, 33, 80]
    ref = {}
    with torch.no_grad():
        for i, T in enumerate(lengths):
            ids = torch.randint(3, V, (T,), generator=gen)
            logits = model(ids[None]).logits[0].float()
            ref[f"prompt.{i}"] = ids.to(torch.int64)
            ref[f"logits.{i}"] = logits.contiguous()
            seq = ids.clone()
            greedy, margins = [], []
            for _ in range(12):
                last = model(seq[None]).logits[0, -1].float()
                top = torch.topk(last, 2)
                greedy.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                seq = torch.cat([seq, top.indices[:1]])
            ref[f"greedy.{i}"] = torch.tensor(greedy, dtype=torch.int64)
            ref[f"margin.{i}"] = torch.tensor(margins, dtype=torch.float32)
            print(f"prompt {i}: T={T} greedy={greedy} min margin={min(margins):.4f}", flush=True)
    save_file(ref, os.path.join(odir, "reference.safetensors"))

    # Cross-check: transformers' own MXFP4 loader on the published files.
    roundtrip = "not attempted"
    try:
        from transformers import Mxfp4Config
        m2 = AutoModelForCausalLM.from_pretrained(odir, quantization_config=Mxfp4Config(dequantize=True),
                                                  torch_dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            diffs = [float((m2(ref[f"prompt.{i}"][None]).logits[0].float() - ref[f"logits.{i}"]).abs().max())
                     for i in range(len(lengths))]
        roundtrip = f"transformers Mxfp4Config(dequantize=True) reload: max |logit diff| per prompt {diffs}"
    except Exception as e:  # noqa: BLE001 - record why, the direct reference stands
        roundtrip = f"transformers MXFP4 reload failed: {type(e).__name__}: {e}"[:800]
    print(roundtrip, flush=True)
    with open(os.path.join(odir, "reference.json"), "w") as f:
        json.dump({"generator": "tools/reference/gpt_oss_fixtures.py", "seed": args.seed,
                   "transformers": transformers.__version__, "torch": torch.__version__,
                   "prompt_lengths": lengths, "greedy_tokens": 12, "dtype": "float32, CPU, eager attention",
                   "mxfp4_roundtrip": roundtrip}, f, indent=2)

    if args.hf_src:
        import inspect
        import tarfile
        import io
        mods = ["transformers.models.gpt_oss.modeling_gpt_oss", "transformers.models.gpt_oss.configuration_gpt_oss",
                "transformers.modeling_rope_utils", "transformers.integrations.mxfp4",
                "transformers.masking_utils"]
        with tarfile.open(os.path.join(args.out, "hf_src.tar"), "w") as tf:
            for m in mods:
                try:
                    mod = __import__(m, fromlist=["x"])
                    data = inspect.getsource(mod).encode()
                    ti = tarfile.TarInfo(m.split(".")[-1] + ".py")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
                except Exception as e:  # noqa: BLE001
                    print("could not read", m, e)


if __name__ == "__main__":
    main()
