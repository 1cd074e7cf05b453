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
"""
import argparse
import json

import torch
import torch.nn.functional as F

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
    out = {"peer": "torch.nn.functional.scaled_dot_product_attention (enable_gqa), contiguous and page-gathered bf16 KV",
           "torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": res}
    json.dump(out, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
