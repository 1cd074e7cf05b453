#!/usr/bin/env python3
"""PyTorch peer of `dz bench mla`: sparse MLA decode (absorbed) on the same shapes.

    python3 tools/bench/mla_peer.py --dz-json bench_mla.json --out mla_peer.json

For every batch of dayzero's results: bf16 latents [batch, context, 576] (c_kv 512 | k_rope 64),
absorbed queries [batch, heads, 576], top-k random positions a sequence; gather the selected
latents, scores = q . latent * scale, softmax in fp32, output = p . c_kv: what a PyTorch
implementation of DSA's sparse attention does around FlashMLA's kernel (transformers'
deepseek_v32 masks a dense score matrix instead, slower still). Timing: CUDA events, L2 flushed
(256 MiB) before each call, median.
"""
import argparse

import torch

from cuda_timing import peer_setup, peer_write, timed


def sparse_mla(q, lat, sel, scale):
    # q [B, H, 576], lat [B, N, 576], sel [B, K] -> [B, H, 512]
    kv = torch.gather(lat, 1, sel[:, :, None].expand(-1, -1, lat.shape[-1]))
    s = torch.einsum("bhd,bkd->bhk", q, kv).float() * scale
    p = s.softmax(-1).to(q.dtype)
    return torch.einsum("bhk,bkd->bhd", p, kv[..., :512])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dz-json", required=True, help="dz bench mla --out FILE")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dz, dev, flush, g = peer_setup(args.dz_json)
    H, K, N = dz["heads"], dz["topk"], dz["context"]
    res = []
    for row in dz["results"]:
        B = row["batch"]
        lat = torch.randn(B, N, 576, device=dev, generator=g, dtype=torch.bfloat16)
        q = torch.randn(B, H, 576, device=dev, generator=g, dtype=torch.bfloat16) * 0.5
        sel = torch.randint(0, N, (B, K), device=dev, generator=g)
        ms = timed(lambda: sparse_mla(q, lat, sel, 192 ** -0.5), args.reps, flush)
        r = {"batch": B, "torch_us": ms * 1e3, "dz_us": row["us"], "speedup": ms * 1e3 / row["us"]}
        res.append(r)
        print(f"mla sparse decode B={B:3d}: torch {ms * 1e3:8.1f} us, dayzero {row['us']:8.1f} us "
              f"({r['speedup']:.1f}x)", flush=True)
        del lat, q, sel
        torch.cuda.empty_cache()
    peer_write(args.out, "mla_peer", res)


if __name__ == "__main__":
    main()
