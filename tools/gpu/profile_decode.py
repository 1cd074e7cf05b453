#!/usr/bin/env python3
"""Where a dayzero decode step spends its GPU time: per-kernel totals of eager decode steps
(no CUDA graphs, no programmatic dependent launch: each kernel its own launch and its own time)
through torch.profiler, whose CUPTI tracing sees every kernel of the process, libdayzero's
included. Needs PyTorch with CUDA and the Python binding. With --prefill N the profiled "step"
is one prompt of N tokens appended to a fresh session instead (--steps of them).

    DAYZERO_LIB=build/libdayzero.so python3 tools/gpu/profile_decode.py MODEL_DIR [--ctx 128]
        [--steps 16] [--batch 1] [--prefill N] [--json OUT]

Prints a table (kernel, calls per step, us per step, share) and writes it as JSON with --json.
"""
import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=128, help="prompt tokens before the profiled steps")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="sessions decoded together (one batched step)")
    ap.add_argument("--prefill", type=int, default=0, help="profile prompts of this many tokens instead")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ["DZ_CUDA_GRAPHS"] = "0"  # read at each forward: every kernel a separate launch
    # Programmatic dependent launch off as well: with it a kernel starts (and its span in the trace
    # begins) while the previous one still runs, so the per-kernel times would overlap.
    os.environ["DZ_CUDA_PDL"] = "0"
    import torch
    from torch.profiler import ProfilerActivity, profile

    import dayzero as dz

    torch.zeros(1, device="cuda")  # the CUDA context before the library's, same primary context
    t0 = time.time()
    model = dz.Model(a.model, device=dz.Device.CUDA)
    print(f"opened {a.model} in {time.time() - t0:.1f} s", flush=True)
    rng = random.Random(1)
    nv = model.tokenizer.vocab_size if model.tokenizer else 1000
    if a.prefill:
        pages = -(-a.prefill // 64) + 1
        arena = model.arena(page_tokens=64, capacity_pages=2 * pages + 4)

        def step():  # one prompt, one pass, into a fresh session (its pages freed with it)
            s = arena.session(prefill_chunk=a.prefill)
            s.append([rng.randrange(nv) for _ in range(a.prefill)])
            s.close()

        step()  # warm-up: plans, workspaces
    else:
        per_session = -(-(a.ctx + a.steps + 8) // 64)  # pages of 64 tokens, every layer
        arena = model.arena(page_tokens=64, capacity_pages=a.batch * per_session + 4)
        sessions = [arena.session() for _ in range(a.batch)]
        for s in sessions:
            s.append([rng.randrange(nv) for _ in range(a.ctx)])

        def step():
            dz.decode_batch(sessions, [rng.randrange(nv) for _ in sessions])

        for _ in range(3):  # warm-up: plans, workspaces
            step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        r = rows.setdefault(e.name, [0, 0.0])
        r[0] += 1
        r[1] += e.device_time if hasattr(e, "device_time") else e.cuda_time
    per_step = sum(v[1] for v in rows.values()) / a.steps
    table = sorted(((k, v[0] / a.steps, v[1] / a.steps) for k, v in rows.items()), key=lambda x: -x[2])
    what = f"prefill of {a.prefill} tokens" if a.prefill else f"batch {a.batch}, context {a.ctx}"
    # A sum of durations: kernels on the MoE layer's second stream (the next
    # experts' folding, at the lowest priority) overlap others and count whole.
    print(f"{what}: kernel time {per_step:.1f} us per step, summed over "
          f"{sum(v[0] for v in rows.values()) / a.steps:.0f} kernels/copies (overlapping ones count whole)")
    print(f"{'us/step':>9} {'share':>6} {'calls':>6}  kernel")
    for name, calls, us in table[:40]:
        print(f"{us:9.1f} {100 * us / per_step:5.1f}% {calls:6.1f}  {name[:110]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "batch": a.batch, "ctx": a.ctx, "prefill": a.prefill, "steps": a.steps,
                       "gpu_us_per_step": per_step,
                       "kernels": [{"name": n, "calls_per_step": c, "us_per_step": u} for n, c, u in table]}, f, indent=1)


if __name__ == "__main__":
    main()
