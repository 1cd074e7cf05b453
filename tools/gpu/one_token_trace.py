#!/usr/bin/env python3
"""Summarises a one-token stream trace (dz bench moe with DZ_BENCH_ONE_TOKEN_TRACE=PREFIX writes PREFIX_pP.csv:
per block and unit the producer's issue, the consumers' arrival and release, %globaltimer ns, and the unit's
projection and slot; unit 31 holds the block's start, its last group's end and its last sum of a row tile).

Usage: tools/gpu/one_token_trace.py F.csv[.gz] [--unit-bytes 23040] [--bin-us 1]
Prints when the first and last units were issued, arrived and were released, the arrival rate per time bin as
bytes per second, how long the producers waited for a free stage, and each slot's handoff from gate_up to down."""
import argparse
import csv
import gzip
import statistics


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--unit-bytes", type=int, default=16 * 1440 + 16 * 90, help="bytes a unit (120b shapes)")
    ap.add_argument("--bin-us", type=float, default=1.0)
    a = ap.parse_args()
    f = gzip.open(a.csv, "rt") if a.csv.endswith(".gz") else open(a.csv)
    rows = [tuple(int(v) for v in r.values()) for r in csv.DictReader(f)]
    blk = [r for r in rows if r[1] == 31]
    rows = [r for r in rows if r[1] != 31]
    t0 = min(r[2] for r in blk) if blk else min(r[2] for r in rows)
    us = lambda t: (t - t0) / 1000.0
    if blk:
        st = sorted(us(r[2]) for r in blk)
        en = sorted(us(r[3]) for r in blk if r[3])
        sm = sorted(us(r[4]) for r in blk if r[4])
        print(f"blocks start {st[0]:.2f}..{st[-1]:.2f} us, end {en[0]:.2f}..{en[-1]:.2f}" +
              (f", last row-tile sum {sm[-1]:.2f}" if sm else ""))
    iss = [us(r[2]) for r in rows]
    arr = [us(r[3]) for r in rows if r[3]]
    rel = [us(r[4]) for r in rows if r[4]]
    print(f"units {len(rows)} blocks {len(set(r[0] for r in rows))}")
    print(f"issue   first {min(iss):6.2f} last {max(iss):6.2f} us")
    print(f"arrive  first {min(arr):6.2f} last {max(arr):6.2f} us")
    print(f"release first {min(rel):6.2f} last {max(rel):6.2f} us")
    ends = {}
    for r in rows:
        if r[4]:
            ends[r[0]] = max(ends.get(r[0], 0), us(r[4]))
    e = sorted(ends.values())
    print(f"block's last release: min {e[0]:.2f} median {statistics.median(e):.2f} max {e[-1]:.2f} us")
    nb = int(max(arr) / a.bin_us) + 1
    hist = [0] * nb
    for t in arr:
        hist[int(t / a.bin_us)] += 1
    print("arrivals a bin (TB/s):", " ".join(f"{h * a.unit_bytes / (a.bin_us * 1e-6) / 1e12:.2f}" for h in hist))
    # Issue i waits for the release of unit i - stages of its group; report the gap issue(i) - issue(i - 1).
    by_block = {}
    for r in rows:
        by_block.setdefault(r[0], []).append(r)
    gaps = []
    for b, rs in by_block.items():
        rs.sort(key=lambda r: r[1])
        gaps += [(rs[k][2] - rs[k - 1][2]) / 1000.0 for k in range(1, len(rs))]
    gaps.sort()
    print(f"issue gaps (us): median {statistics.median(gaps):.2f} p90 {gaps[int(0.9 * len(gaps))]:.2f} max {gaps[-1]:.2f}")
    lat = sorted(us(r[3]) - us(r[2]) for r in rows if r[3])
    print(f"issue -> arrive (us): min {lat[0]:.2f} median {statistics.median(lat):.2f} p90 {lat[int(0.9 * len(lat))]:.2f} max {lat[-1]:.2f}")
    # The handoff a slot (traces with proj and slot columns): when its last gate_up unit was released, and when its
    # down units arrived (a down unit's arrival includes its wait for the slot's image).
    if rows and len(rows[0]) >= 7:
        for s in sorted({r[6] for r in rows if r[6] >= 0}):
            gu = [us(r[4]) for r in rows if r[5] == 0 and r[6] == s and r[4]]
            dn = sorted(us(r[3]) for r in rows if r[5] == 1 and r[6] == s and r[3])
            if gu and dn:
                print(f"slot {s}: gate_up done {max(gu):.2f} us, its down units arrive {dn[0]:.2f} .. median "
                      f"{statistics.median(dn):.2f} .. {dn[-1]:.2f} (first {dn[0] - max(gu):+.2f} after)")


if __name__ == "__main__":
    main()
