#!/usr/bin/env python3
# ncu-summary.py: per-kernel GPU time from an Nsight Compute CSV (ncu --csv
# --page raw --metrics gpu__time_duration.sum), as one table: kernel, calls,
# total µs, µs per call, share; with a second argument N, then the last N
# kernels in launch order (one step's sequence). tools/gpu-run.sh profile
# writes the CSV.
#
# SPDX-License-Identifier: LGPL-2.1-or-later

import csv
import re
import sys
from collections import defaultdict


def short(name):
    # "void (anonymous namespace)::gemv_kernel<__nv_bfloat16, 1, 0>(MoeCudaGemv)" -> "gemv_kernel<__nv_bfloat16, 1, 0>"
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = re.sub(r"^void ", "", name)
    return re.sub(r"\(.*\)$", "", name)[:90]


def main():
    lines = open(sys.argv[1], errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if '"Kernel Name"' in l), None)
    if start is None:
        sys.exit("no kernel rows in " + sys.argv[1])
    timed = []
    for r in csv.DictReader(lines[start:]):
        try:
            ns = float(r.get("gpu__time_duration.sum", "").replace(",", ""))
        except ValueError:
            continue          # the units row
        timed.append((short(r["Kernel Name"]), ns / 1000.0))
    rows = timed
    total = defaultdict(float)
    calls = defaultdict(int)
    for k, us in timed:
        total[k] += us
        calls[k] += 1
    grand = sum(total.values())
    print(f"{len(rows)} kernels, {grand:.1f} µs of GPU time")
    print("| kernel | calls | total µs | µs/call | share |")
    print("|---|---:|---:|---:|---:|")
    for k in sorted(total, key=total.get, reverse=True):
        print(f"| `{k}` | {calls[k]} | {total[k]:.1f} | {total[k] / calls[k]:.2f} | {100 * total[k] / grand:.1f}% |")
    tail = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if tail > 0:
        print(f"\nthe last {min(tail, len(timed))} kernels in launch order (µs):")
        for k, us in timed[-tail:]:
            print(f"{us:9.2f}  {k}")


main()
