#!/usr/bin/env python3
"""PyTorch peer of `dz bench attention`: decode attention at the same shapes.

    python3 tools/bench/attention_peer.py --dz-json bench_attention.json --out attention_peer.json

For every (batch, ctx) row of dayzero's results: one query token per session against a
contiguous bf16 K/V cache [batch, kv_heads, ctx, head_dim] through
torch.nn.functional.scaled_dot_product_attention (enable_gqa; PyTorch picks its kernel), and
the same through a paged cache gathered by page table first (what a paged engine without a
paged kernel does; the gather is timed). Neither has gpt-oss's sink column, which costs
dayzero nothing measurable. Timing: CUDA events, L2 flushed (256 MiB) before each call,
median. The peer's output is checked against a float32 reference on the first rows.

For every prompt of dayzero's "prefill" results (causal, no window): the same function with
is_causal over contiguous q [1, heads, n, D] and K/V [1, kv_heads, n, D] in bf16, restricted to
PyTorch's fused kernels (FlashAttention, cuDNN, memory-efficient; the math fallback would
materialize n x n scores), checked on its last rows against float32.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cuda_timing import peer_setup, timed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dz-json", required=True, help="dz bench attention --out FILE")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-kv-gib", type=float, default=16.0)
    args = ap.parse_args()
    dz, dev, flush, g = peer_setup(args.dz_json)
    sh = dz["shape"]
    nh, nkv, D = sh["heads"], sh["kv_heads"], sh["head_dim"]
    pt = dz["kv"]["page_tokens"]
    bw = dz["ceilings"]["hbm_bytes_per_s"]
    res = []
    for row in dz["results"]:
        B, C, L = row["batch"], row["ctx"], row["keys_per_row"]
        kv_bytes = 2 * B * L * nkv * D * 2
        if 2 * kv_bytes > args.max_kv_gib * (1 << 30):  # the contiguous, then the paged and its gathered copy
            continue
        q = torch.randn(B, nh, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(B, nkv, L, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, nkv, L, D, device=dev, dtype=torch.bfloat16, generator=g)
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        o = sdpa()
        r = min(B, 2)
        ref = torch.softmax((q[:r].float().reshape(r, nkv, nh // nkv, D) @ k[:r].float().transpose(-1, -2)) / D**0.5,
                            -1) @ v[:r].float()
        err = (o[:r].float().reshape(r, nkv, nh // nkv, D) - ref).abs().max().item()
        ms = timed(sdpa, args.reps, flush)
        del k, v
        # Paged: pages [n_pages, page_tokens, kv_heads, D] for K and V, gathered by a scattered table.
        npg = (L + pt - 1) // pt
        kp = torch.randn(B * npg, pt, nkv, D, device=dev, dtype=torch.bfloat16, generator=g)
        vp = torch.randn(B * npg, pt, nkv, D, device=dev, dtype=torch.bfloat16, generator=g)
        table = torch.randperm(B * npg, device=dev, generator=g).reshape(B, npg)

        def paged():
            kk = kp[table].reshape(B, npg * pt, nkv, D)[:, :L].transpose(1, 2)
            vv = vp[table].reshape(B, npg * pt, nkv, D)[:, :L].transpose(1, 2)
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

        ms_paged = timed(paged, max(3, args.reps // 4), flush)
        del kp, vp
        torch.cuda.empty_cache()
        item = {"batch": B, "ctx": C, "keys_per_row": L, "kv_bytes": kv_bytes,
                "sdpa_us": ms * 1e3, "sdpa_hbm_fraction": kv_bytes / (ms * 1e-3) / bw,
                "sdpa_max_abs_err_vs_fp32": err,
                "paged_gather_sdpa_us": ms_paged * 1e3,
                "dayzero_us": row["us"], "dayzero_vs_sdpa": ms * 1e3 / row["us"]}
        res.append(item)
        print(f"peer B={B:3d} ctx={C:6d}: sdpa {ms * 1e3:9.1f} us ({100 * kv_bytes / (ms * 1e-3) / bw:.0f}% of HBM), "
              f"gather+sdpa {ms_paged * 1e3:9.1f} us; dayzero {row['us']:8.1f} us ({ms * 1e3 / row['us']:.2f}x)",
              flush=True)
    pre = []
    bf16_peak = dz["ceilings"].get("bf16_flops_per_s", 810e12)
    for row in dz.get("prefill", []):
        n = row["tokens"]
        if row["window"] > 0:
            continue
        q = torch.randn(1, nh, n, D, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, nkv, n, D, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn(1, nkv, n, D, device=dev, dtype=torch.bfloat16, generator=g)
        fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

        def causal():
            with sdpa_kernel(fused):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        item = {"tokens": n, "flops": row["flops"], "dayzero_us": row["us"], "dayzero_tflops": row["tflops"]}
        try:
            o = causal()
            r = 4  # the last rows against float32 (all their keys)
            qq = q[0, :, n - r:].float().reshape(nkv, nh // nkv, r, D)
            s = (qq @ k[0].float().transpose(-1, -2).unsqueeze(1)) / D**0.5
            s = s + torch.triu(torch.full((r, n), float("-inf"), device=dev), diagonal=n - r + 1)
            ref = torch.softmax(s, -1) @ v[0].float().unsqueeze(1)
            err = (o[0, :, n - r:].float().reshape(nkv, nh // nkv, r, D) - ref).abs().max().item()
            ms = timed(causal, max(3, min(args.reps, 5 if n >= 32768 else args.reps)), flush)
            item.update({"sdpa_us": ms * 1e3, "sdpa_tflops": row["flops"] / (ms * 1e-3) / 1e12,
                         "sdpa_bf16_peak_fraction": row["flops"] / (ms * 1e-3) / bf16_peak,
                         "sdpa_max_abs_err_vs_fp32": err, "dayzero_vs_sdpa": ms * 1e3 / row["us"]})
            print(f"peer prefill {n:6d}: sdpa {ms * 1e3:10.1f} us ({row['flops'] / (ms * 1e-3) / 1e12:.0f} TFLOP/s); "
                  f"dayzero {row['us']:10.1f} us ({row['tflops']:.0f} TFLOP/s, {ms * 1e3 / row['us']:.2f}x)", flush=True)
            one = [v for v in row.get("variants", []) if v["terms"] == 1]
            if one:  # dayzero's one-term (bf16, FlashAttention's precision) prefill: the like-for-like comparison
                best = min(one, key=lambda v: v["us"])
                item["dayzero_bf16_us"] = best["us"]
                item["dayzero_bf16_vs_sdpa"] = ms * 1e3 / best["us"]
                print(f"peer prefill {n:6d}: dayzero one term {best['us']:10.1f} us ({best['tflops']:.0f} TFLOP/s, "
                      f"{ms * 1e3 / best['us']:.2f}x of sdpa's speed)", flush=True)
        except RuntimeError as e:  # no fused kernel for this shape
            item["sdpa_error"] = str(e).splitlines()[0]
            print(f"peer prefill {n:6d}: no fused SDPA kernel ({item['sdpa_error']})", flush=True)
        pre.append(item)
        del q, k, v
        torch.cuda.empty_cache()
    out = {"peer": "torch.nn.functional.scaled_dot_product_attention (enable_gqa), contiguous and page-gathered bf16 KV",
           "torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": res, "prefill": pre}
    json.dump(out, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
