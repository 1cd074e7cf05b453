#!/usr/bin/env python3
"""PyTorch peers of `dz bench moe` on the same data, plus the measured hardware ceilings.

    python3 tools/bench/moe_peers.py DUMP_DIR --dz-json bench_moe.json --out moe_peers.json

DUMP_DIR is what `dz bench moe --dump DUMP_DIR` wrote: the MXFP4 expert weights (checkpoint
layout), and per token count the input, routing (set 0) and dayzero's output. Peers:
  (a) grouped_bf16:  experts dequantised to BF16 once (not timed), torch._grouped_mm per call;
  (b) scaled_mm_fp8: experts as FP8 E4M3 with per-row scales (converted once, not timed),
      activations quantised per row each call, one torch._scaled_mm per routed expert (K padded
      to 128; where cuBLAS refuses row-wise scales, one scale per expert and per activation segment).
Both sort tokens by expert, apply gpt-oss SwiGLU (clamp 7, alpha 1.702, interleaved gate/up,
biases) and the weighted combine. Timing: CUDA events, L2 flushed (256 MiB) before each call,
median. Each peer's output is compared with dayzero's (diff = 1 - 2 sum(xy) / sum(x^2 + y^2)).
"""
import argparse
import json
import os

import numpy as np
import torch

from cuda_timing import timed

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def load(path, dtype, shape):
    a = np.fromfile(path, dtype=dtype)
    return torch.from_numpy(a).reshape(shape)


def dequant(blocks, scales, dev):
    """blocks U8 [E, N, K/32, 16], scales U8 [E, N, K/32] -> BF16 [E, N, K] (exact)."""
    lut = torch.tensor(E2M1, device=dev)
    out = []
    for e in range(blocks.shape[0]):
        b = blocks[e].to(dev)
        codes = torch.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], 32).long()
        v = lut[codes] * torch.exp2(scales[e].to(dev).float() - 127.0).unsqueeze(-1)
        out.append(v.reshape(b.shape[0], -1).to(torch.bfloat16))
    return torch.stack(out)


def swiglu(h):
    gate = h[:, 0::2].clamp(max=7.0)
    up = h[:, 1::2].clamp(min=-7.0, max=7.0)
    return (up + 1.0) * gate * torch.sigmoid(1.702 * gate)


def diff(x, y):
    x = x.double().flatten()
    y = y.double().flatten()
    return float(1.0 - 2.0 * (x * y).sum() / (x * x + y * y).sum())


def ceilings(dev):
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ms = timed(lambda: dst.copy_(src), 10, flush)
    copy_bw = 2 * n / (ms * 1e-3)
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    ms = timed(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10, flush)
    fp8 = 2 * m**3 / (ms * 1e-3)
    a16 = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b16 = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    ms = timed(lambda: a16 @ b16, 10, flush)
    bf16 = 2 * m**3 / (ms * 1e-3)
    return {"copy_bytes_per_s": copy_bw, "fp8_flops": fp8, "bf16_flops": bf16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump")
    ap.add_argument("--dz-json", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda")
    meta = json.load(open(os.path.join(args.dump, "meta.json")))
    sh = meta["shape"]
    E, K, H, I = sh["experts"], sh["topk"], sh["hidden"], sh["intermediate"]
    d = args.dump
    w1 = dequant(load(f"{d}/w1_blocks.bin", np.uint8, (E, 2 * I, H // 32, 16)),
                 load(f"{d}/w1_scales.bin", np.uint8, (E, 2 * I, H // 32)), dev)
    w2 = dequant(load(f"{d}/w2_blocks.bin", np.uint8, (E, H, I // 32, 16)),
                 load(f"{d}/w2_scales.bin", np.uint8, (E, H, I // 32)), dev)
    b1 = load(f"{d}/b1.bin", np.int16, (E, 2 * I)).view(torch.bfloat16).to(dev).float()
    b2 = load(f"{d}/b2.bin", np.int16, (E, H)).view(torch.bfloat16).to(dev).float()
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)  # [E, K, N] column-major, as _grouped_mm wants

    # cuBLAS row-wise FP8 wants K a multiple of 128 here: pad with zeros (2880 -> 2944).
    def padk(v):
        k = v.shape[-1]
        return torch.nn.functional.pad(v, (0, (k + 127) // 128 * 128 - k))

    def rowwise_fp8(w):
        w = padk(w.float())
        s = w.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448.0
        return (w / s).to(torch.float8_e4m3fn), s.squeeze(-1)

    w1q, w1s = zip(*[rowwise_fp8(w1[e]) for e in range(E)])
    w2q, w2s = zip(*[rowwise_fp8(w2[e]) for e in range(E)])
    # Tensor-wise fallback (one scale per expert) where cuBLAS refuses row-wise scales.
    def tensorwise_fp8(w):
        w = padk(w.float())
        s = w.abs().amax().clamp(min=1e-30) / 448.0
        return (w / s).to(torch.float8_e4m3fn), s

    w1t8, w1ts = zip(*[tensorwise_fp8(w1[e]) for e in range(E)])
    w2t8, w2ts = zip(*[tensorwise_fp8(w2[e]) for e in range(E)])
    fp8_mode = {"mode": "rowwise"}
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)

    def route(ids):
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E)
        return flat, order, counts

    def grouped(x, ids, gw):
        flat, order, counts = route(ids)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        tok = order // K
        ex = flat[order]
        h = torch._grouped_mm(x[tok].to(torch.bfloat16), w1t, offs=offs).float() + b1[ex]
        a = swiglu(h).to(torch.bfloat16)
        y = torch._grouped_mm(a, w2t, offs=offs).float() + b2[ex]
        out = torch.zeros_like(x)
        out.index_add_(0, tok, y * gw.flatten()[order].unsqueeze(1))
        return out

    def quant_rows(v):
        v = padk(v)
        s = v.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448.0
        return (v / s).to(torch.float8_e4m3fn), s

    def expert_mm(v, e, first):
        """One expert's FP8 GEMM of bf16/fp32 rows v: row-wise scales, else tensor-wise."""
        wq, ws, wt, wts = (w1q, w1s, w1t8, w1ts) if first else (w2q, w2s, w2t8, w2ts)
        if fp8_mode["mode"] == "rowwise":
            vq, vs = quant_rows(v)
            try:
                return torch._scaled_mm(vq, wq[e].t(), scale_a=vs, scale_b=ws[e].unsqueeze(0), out_dtype=torch.bfloat16)
            except RuntimeError as ex:
                fp8_mode["mode"] = "tensorwise"
                fp8_mode["rowwise_error"] = str(ex)[:200]
        v = padk(v)
        s = v.abs().amax().clamp(min=1e-30) / 448.0
        return torch._scaled_mm((v / s).to(torch.float8_e4m3fn), wt[e].t(), scale_a=s, scale_b=wts[e],
                                out_dtype=torch.bfloat16)

    def scaled(x, ids, gw):
        flat, order, counts = route(ids)
        tok = order // K
        ex = flat[order]
        xs_ = x[tok]
        cnt = counts.tolist()
        h = torch.empty(len(tok), 2 * I, device=dev, dtype=torch.bfloat16)
        start = 0
        for e, c in enumerate(cnt):
            if c:
                h[start:start + c] = expert_mm(xs_[start:start + c], e, True)
            start += c
        a = swiglu(h.float() + b1[ex])
        y = torch.empty(len(tok), H, device=dev, dtype=torch.bfloat16)
        start = 0
        for e, c in enumerate(cnt):
            if c:
                y[start:start + c] = expert_mm(a[start:start + c], e, False)
            start += c
        out = torch.zeros_like(x)
        out.index_add_(0, tok, (y.float() + b2[ex]) * gw.flatten()[order].unsqueeze(1))
        return out

    peers = {"grouped_bf16": grouped, "scaled_mm_fp8": scaled}
    rows = []
    for r in meta["results"]:
        T = r["tokens"]
        x = load(f"{d}/T{T}_x.bin", np.float32, (T, H)).to(dev)
        ids = load(f"{d}/T{T}_ids.bin", np.int32, (T, K)).to(dev).long()
        gw = load(f"{d}/T{T}_gw.bin", np.float32, (T, K)).to(dev)
        ref = load(f"{d}/T{T}_out.bin", np.float32, (T, H)).to(dev)
        row = {"tokens": T}
        for name, fn in peers.items():
            try:
                out = fn(x, ids, gw)
                row[name + "_diff_vs_dz"] = diff(out, ref)
                row[name + "_ms"] = timed(lambda: fn(x, ids, gw), max(3, args.reps if T < 4096 else args.reps // 2),
                                          flush)
            except Exception as ex:  # report, keep going
                row[name + "_error"] = f"{type(ex).__name__}: {ex}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    del w1q, w2q, w1t8, w2t8
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "ceilings": ceilings(dev),
           "scaled_mm_fp8_scaling": fp8_mode, "results": rows}
    if args.dz_json:
        dz = json.load(open(args.dz_json))
        by_t = {r["tokens"]: r for r in rows}
        table = []
        print(f"\n{'tokens':>7} {'dz fused':>10} {'dz fp8':>10} {'dz best':>10} {'bf16 grp':>10} {'fp8 smm':>10}"
              f" {'speedup':>8} {'HBM%':>6} {'FP8%':>6}")
        for r in dz["results"]:
            p = by_t.get(r["tokens"], {})
            best_peer = min([v for k, v in p.items() if k.endswith("_ms")] or [float("nan")])
            dz_best = min(r["fused_ms"], r["fp8_ms"])
            t = {"tokens": r["tokens"], "dz_fused_ms": r["fused_ms"], "dz_fp8_ms": r["fp8_ms"], "dz_best_ms": dz_best,
                 "peer_grouped_bf16_ms": p.get("grouped_bf16_ms"), "peer_scaled_mm_fp8_ms": p.get("scaled_mm_fp8_ms"),
                 "speedup_vs_best_peer": best_peer / dz_best, "hbm_fraction": r["best_hbm_fraction"],
                 "fp8_peak_fraction": r["best_peak_fraction"]}
            table.append(t)
            f = lambda v: f"{v:10.3f}" if isinstance(v, float) else f"{'-':>10}"
            print(f"{r['tokens']:>7} {f(r['fused_ms'])} {f(r['fp8_ms'])} {f(dz_best)} {f(p.get('grouped_bf16_ms'))}"
                  f" {f(p.get('scaled_mm_fp8_ms'))} {t['speedup_vs_best_peer']:8.2f} {100 * t['hbm_fraction']:6.1f}"
                  f" {100 * t['fp8_peak_fraction']:6.1f}")
        res["summary"] = table
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    print(json.dumps(res["ceilings"]))


if __name__ == "__main__":
    main()
