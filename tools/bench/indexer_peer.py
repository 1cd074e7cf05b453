#!/usr/bin/env python3
"""PyTorch peer of `dz bench indexer`: the DSA lightning indexer on the same shapes.

    python3 tools/bench/indexer_peer.py --dz-json bench_indexer.json --out indexer_peer.json

For every row of dayzero's results: keys [batch, context, head_dim] and queries [queries, heads,
head_dim] in bf16 (PyTorch has no E4M3 batched product with per-row scales short of _scaled_mm,
which takes no head-weighted ReLU), the scores as transformers' deepseek_v32 computes them
(relu(q k^T) weighted by the head weights, summed over heads), the causal mask in prefill, then
torch.topk (k = 2048). Prefill runs in the same query blocks as dayzero (bounded memory).
Timing: CUDA events, L2 flushed (256 MiB) before each call, median.
"""
import argparse

import torch

from cuda_timing import peer_setup, peer_write, timed


def indexer(q, w, k, topk, q_pos=None):
    # q [B, Q, H, D], w [B, Q, H], k [B, N, D] -> top-k positions [B, Q, topk]
    s = torch.einsum("bqhd,bnd->bqhn", q, k).relu_()
    s = torch.einsum("bqhn,bqh->bqn", s, w)
    if q_pos is not None:
        n = torch.arange(k.shape[1], device=k.device)
        s.masked_fill_(n[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.topk(s, min(topk, k.shape[1]), dim=-1).indices


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dz-json", required=True, help="dz bench indexer --out FILE")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dz, dev, flush, g = peer_setup(args.dz_json)
    H, D, K, QB = dz["heads"], dz["head_dim"], dz["topk"], dz["query_block"]
    res = []
    for row in dz["results"]:
        B, N, nq, prefill = row["batch"], row["context"], row["queries"], row["mode"] == "prefill"
        k = torch.randn(B, N, D, device=dev, generator=g, dtype=torch.bfloat16)
        if prefill:
            q = torch.randn(1, nq, H, D, device=dev, generator=g, dtype=torch.bfloat16)
            w = torch.randn(1, nq, H, device=dev, generator=g, dtype=torch.bfloat16)
            pos = torch.arange(nq, device=dev)

            def run():
                for q0 in range(0, nq, QB):
                    indexer(q[:, q0:q0 + QB], w[:, q0:q0 + QB], k, K, pos[q0:q0 + QB])
        else:
            q = torch.randn(B, 1, H, D, device=dev, generator=g, dtype=torch.bfloat16)
            w = torch.randn(B, 1, H, device=dev, generator=g, dtype=torch.bfloat16)

            def run():
                indexer(q, w, k, K)
        try:
            ms = timed(run, args.reps, flush)
        except torch.OutOfMemoryError:
            ms = float("nan")
        r = {"mode": row["mode"], "batch": B, "context": N, "torch_us": ms * 1e3, "dz_us": row["us"],
             "speedup": ms * 1e3 / row["us"]}
        res.append(r)
        print(f"indexer {r['mode']:<7} B={B:3d} ctx {N:6d}: torch {ms * 1e3:10.1f} us, dayzero {row['us']:9.1f} us "
              f"({r['speedup']:.1f}x)", flush=True)
        del k, q, w
        torch.cuda.empty_cache()
    peer_write(args.out, "indexer_peer", res)


if __name__ == "__main__":
    main()
