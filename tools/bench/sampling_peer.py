#!/usr/bin/env python3
"""PyTorch peer of `dz bench sampling`: top-p / top-k / temperature sampling of the same shapes.

    python3 tools/bench/sampling_peer.py --dz-json bench_sampling.json --out sampling_peer.json

For every (spread, sampler, batch) row of dayzero's results: N(0, spread^2) float32 logits
[batch, vocab] on the GPU, sampled the way transformers' logits processors do it: divide by the
temperature, top_k through torch.topk, top_p by a descending sort, a cumulative softmax and a
mask, then torch.multinomial over the softmax (one token a row). Timing: CUDA events, L2 flushed
(256 MiB) before each call, median.
"""
import argparse

import torch

from cuda_timing import peer_setup, peer_write, timed


def sample(logits, temperature, top_k, top_p):
    x = logits / temperature
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1:
        s, idx = torch.sort(x, dim=-1, descending=True)
        pr = s.softmax(-1)
        drop = pr.cumsum(-1) - pr >= top_p  # keep the smallest prefix reaching top_p
        s = s.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, idx, s)
    return torch.multinomial(x.softmax(-1), 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dz-json", required=True, help="dz bench sampling --out FILE")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dz, dev, flush, g = peer_setup(args.dz_json)
    V = dz["vocab"]
    res = []
    for row in dz["results"]:
        B, T, k, p = row["batch"], row["temperature"], row["top_k"], row["top_p"]
        logits = torch.randn(B, V, device=dev, generator=g) * row["spread"]
        ms = timed(lambda: sample(logits, T, k, p), args.reps, flush)
        r = {"spread": row["spread"], "sampler": row["sampler"], "batch": B, "torch_us": ms * 1e3,
             "dz_us": row["us"], "speedup": ms * 1e3 / row["us"]}
        res.append(r)
        print(f"sampling spread {r['spread']} {r['sampler']:<11} B={B:3d}: torch {ms * 1e3:8.1f} us, "
              f"dayzero {row['us']:8.1f} us ({r['speedup']:.1f}x)", flush=True)
    peer_write(args.out, "sampling_peer", res)


if __name__ == "__main__":
    main()
