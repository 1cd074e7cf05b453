#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel durations by kernel name.

Usage: ncu --clock-control none --metrics gpu__time_duration.sum --csv CMD > F.csv
       tools/gpu/ncu_kernel_times.py F.csv [more.csv ...] [--top N]
ncu serialises kernels, so the sums exceed a run's wall time; they rank the kernels.
"""
import collections
import csv
import io
import sys

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1, "usecond": 1, "ms": 1e3, "msecond": 1e3}


def main(argv):
    top = 18
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    for name in argv:
        txt = open(name).read()
        i = txt.find('"ID"')
        if i < 0:
            print(f"== {name}: no ncu rows")
            continue
        tot, cnt = collections.defaultdict(float), collections.Counter()
        for r in csv.DictReader(io.StringIO(txt[i:])):
            if r.get("Metric Name") != "gpu__time_duration.sum":
                continue
            k = r["Kernel Name"].split("(")[0][:70]
            tot[k] += float(r["Metric Value"].replace(",", "")) * UNITS.get(r.get("Metric Unit", ""), 1)
            cnt[k] += 1
        print(f"== {name}: {sum(cnt.values())} kernels, {sum(tot.values()):.0f} us")
        for k, v in sorted(tot.items(), key=lambda x: -x[1])[:top]:
            print(f"{v:10.0f} us {cnt[k]:6d}  {k}")


if __name__ == "__main__":
    main(sys.argv[1:])
