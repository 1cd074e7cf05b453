#!/usr/bin/env python3
"""The MoE layer's medians over several `dz bench moe` runs, against issue 7's targets.

Usage: tools/gpu/moe_targets.py RUN1.json RUN2.json ... [--out F.json]
Each run: `dz bench moe --tokens 1,8,4096,16384 --no-components --reps 8 --out RUNi.json`, in separate
processes (the spread between runs is part of the measurement). Targets, on the bench's ceilings:
1-8 tokens >= 70% of HBM bandwidth on the FP4 bytes; 16384 tokens >= 60% of FP8 peak. Rows up to 64 tokens
also give the layer inside a decode step (`step_ms`: calls back to back on disjoint experts), judged apart.
"""
import json
import statistics
import sys


def main(argv):
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    runs = [json.load(open(f)) for f in argv]
    if not runs:
        sys.exit(__doc__)
    ceil = runs[0]["ceilings"]
    rows = []
    for T in sorted({r["tokens"] for run in runs for r in run["results"]}):
        got = [r for run in runs for r in run["results"] if r["tokens"] == T]
        ms = statistics.median(r["auto_ms"] for r in got)
        row = {"tokens": T, "path": got[0]["auto_path"], "runs": len(got),
               "auto_ms": [r["auto_ms"] for r in got], "median_ms": ms,
               "hbm_fraction": got[0]["fp4_bytes"] / (ms * 1e-3) / ceil["hbm_bytes_per_s"],
               "fp8_fraction": got[0]["flops"] / (ms * 1e-3) / ceil["fp8_flops"]}
        reads = [r["plain_read_ms"] for r in got if r.get("plain_read_ms")]
        if reads:
            row["plain_read_ms"] = statistics.median(reads)
        # The layer inside a decode step (calls back to back on disjoint experts; `step_ms`).
        steps = [r for r in got if r.get("step_ms")]
        if steps:
            sm = statistics.median(r["step_ms"] for r in steps)
            row["step_ms"], row["step_runs"] = sm, [r["step_ms"] for r in steps]
            row["step_hbm_fraction"] = steps[0]["step_fp4_bytes"] / (sm * 1e-3) / ceil["hbm_bytes_per_s"]
            sr = [r["step_plain_read_ms"] for r in steps if r.get("step_plain_read_ms")]
            if sr:
                row["step_plain_read_ms"] = statistics.median(sr)
        if T <= 8:
            row["target"], row["met"] = "hbm_fraction >= 0.70", row["hbm_fraction"] >= 0.70
            if "step_hbm_fraction" in row:
                row["met_in_step"] = row["step_hbm_fraction"] >= 0.70
        elif T >= 16384:
            row["target"], row["met"] = "fp8_fraction >= 0.60", row["fp8_fraction"] >= 0.60
        rows.append(row)
        line = f"T={T:6d} {row['path']:6s} median {ms:.4f} ms of {len(got)} runs: {100 * row['hbm_fraction']:.1f}% of HBM, " \
               f"{100 * row['fp8_fraction']:.1f}% of FP8 peak"
        if "target" in row:
            line += f"; target {row['target']}: {'met' if row['met'] else 'not met'}"
        print(line)
        if "step_ms" in row:
            print(f"         in a step: median {row['step_ms']:.4f} ms a call, {100 * row['step_hbm_fraction']:.1f}% of HBM"
                  + (f" (a plain read so: {row['step_plain_read_ms']:.4f} ms)" if "step_plain_read_ms" in row else "")
                  + ("" if T > 8 else f"; target: {'met' if row['met_in_step'] else 'not met'} in a step"))
    res = {"device": runs[0]["meta"].get("gpu"), "commit": runs[0]["meta"].get("commit"), "ceilings": ceil, "rows": rows}
    if out:
        json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
