#!/usr/bin/env python3
"""Compare two [T, vocab] float32 logits arrays (`dz logits --out`), e.g. the CUDA backend's against the CPU
backend's on the same prompt: per-row cosine, max abs difference (relative to the row's largest magnitude), and
whether each row's argmax agrees (or the reference's top two are within --tie of each other). Prints one JSON
line (and writes it with --json); exits 1 when the smallest cosine is under --min-cosine or an argmax differs
outside a near-tie."""
import argparse
import json
import sys

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("test", help="logits to check (.npy)")
    ap.add_argument("ref", help="reference logits (.npy)")
    ap.add_argument("--min-cosine", type=float, default=0.999)
    ap.add_argument("--tie", type=float, default=1e-2, help="top-2 gap of the reference under which argmax may differ")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    x = np.load(a.test).astype(np.float64)
    r = np.load(a.ref).astype(np.float64)
    if x.shape != r.shape:
        print(json.dumps({"error": f"shapes differ: {x.shape} vs {r.shape}"}))
        return 1
    cos = (x * r).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(r, axis=1))
    rel = np.abs(x - r).max(1) / np.abs(r).max(1)
    top2 = np.sort(r, axis=1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    agree = x.argmax(1) == r.argmax(1)
    out = {
        "rows": int(x.shape[0]),
        "vocab": int(x.shape[1]),
        "min_cosine": float(cos.min()),
        "mean_cosine": float(cos.mean()),
        "max_rel_abs_diff": float(rel.max()),
        "argmax_agree": int(agree.sum()),
        "argmax_differs_at_near_tie": int((~agree & (gap < a.tie)).sum()),
        "argmax_differs": int((~agree & (gap >= a.tie)).sum()),
        "min_cosine_required": a.min_cosine,
    }
    out["ok"] = bool(out["min_cosine"] >= a.min_cosine and out["argmax_differs"] == 0)
    line = json.dumps(out)
    print(line)
    if a.json:
        with open(a.json, "w") as f:
            f.write(line + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
