#!/usr/bin/env python3
# ncu-stalls.py: where a kernel's warps wait, from Nsight Compute's stall
# sampling. Input: the source page of a report as CSV (optionally gzipped),
#
#   ncu --clock-control none -k regex:grouped_gemm_tma --launch-skip 8 --launch-count 4 \
#       --section WarpStateStats --section SourceCounters -f -o /tmp/r moe-bench-cuda-experts ...
#   ncu -i /tmp/r.ncu-rep --page source --csv --print-source sass > r.csv
#
# For the profiled kernel with the most samples: its SASS lines in address
# order that hold ≥ 0.4% of the samples (and every wgmma, barrier, bulk copy
# and global store), with the running share and the top two stall reasons;
# then the epilogue's share of samples, instructions and code — from the
# main loop's last wgmma wait (WARPGROUP.DEPBAR 0x0) to the next EXIT — and
# the stall reasons and opcodes there. (How the epilogue work of Dec 3 was
# found and measured: BENCHMARKS.md.)
#
# SPDX-License-Identifier: LGPL-2.1-or-later

import csv
import gzip
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
ALWAYS = ("HGMMA", "BAR.SYNC", "EXIT", "UTMALDG", "STG")


def kernels(path):
    """(name, header, rows) of each kernel block of the CSV"""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"] + [len(rows)]
    for a, b in zip(starts, starts[1:]):
        head = rows[a + 1]
        yield rows[a][1], head, [r for r in rows[a + 2:b] if len(r) == len(head)]


def number(v):
    return float(v) if v else 0.0


def main(path):
    blocks = list(kernels(path))
    if not blocks:
        sys.exit(f"{path}: no 'Kernel Name' block (ncu --page source --csv --print-source sass)")
    name, head, body = max(blocks, key=lambda k: sum(number(r[k[1].index(SAMPLES)]) for r in k[2]))
    s_col, x_col = head.index(SAMPLES), head.index(EXECUTED)
    reasons = [i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(number(r[s_col]) for r in body)
    print(f"{name[:120]}: {total:.0f} samples")

    def top(r, n=2):
        return ", ".join(f"{head[i][6:]} {number(r[i]):.0f}" for i in sorted(reasons, key=lambda i: -number(r[i]))[:n])

    running = 0.0
    for r in body:
        s = number(r[s_col])
        running += s
        if s >= 0.004 * total or any(k in r[1] for k in ALWAYS):
            print(f"{r[0][-5:]} {s:7.0f} {100 * running / total:5.1f}% ex {r[x_col]:>9} {r[1][:60]:60} {top(r)}")

    lines = [(int(r[0], 16), r) for r in body]
    lo = next((a for a, r in lines if "DEPBAR.LE gsb0, 0x0" in r[1]), None)
    hi = next((a for a, r in lines if lo is not None and a > lo and "EXIT" in r[1]), None)
    if lo is None or hi is None:
        print("no wgmma main loop (WARPGROUP.DEPBAR 0x0 ... EXIT) found: no epilogue share")
        return
    epilogue = [r for a, r in lines if lo <= a < hi]
    samples = sum(number(r[s_col]) for r in epilogue)
    executed = sum(number(r[x_col]) for r in epilogue)
    stalls, opcodes = Counter(), Counter()
    for r in epilogue:
        for i in reasons:
            stalls[head[i][6:]] += number(r[i])
        op = r[1].split()[1] if r[1].startswith("@") else r[1].split()[0]
        opcodes[op.split(".")[0]] += number(r[x_col])
    print(f"epilogue {lo:x}-{hi:x}: {samples:.0f} of {total:.0f} samples ({100 * samples / total:.1f}%), "
          f"{executed:.0f} of {sum(number(r[x_col]) for r in body):.0f} warp instructions, {hi - lo} bytes of code")
    print("  stalls:", ", ".join(f"{k} {v:.0f}" for k, v in stalls.most_common(8)))
    print("  opcodes (executed):", ", ".join(f"{k} {v:.0f}" for k, v in opcodes.most_common(12)))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: ncu-stalls.py REPORT-SOURCE.csv[.gz]")
    main(sys.argv[1])
