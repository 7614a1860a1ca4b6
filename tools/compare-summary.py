#!/usr/bin/env python3
# compare-summary.py: the table of tools/gpu-run.sh compare's output (read
# from a file or stdin): a row per measurement (prefill, prefill-generate,
# decode B=… prompt=…), a column per side (baseline, candidates, this), each
# cell its tok/s in every round, and each side's mean against the
# reference's: the baseline where there is one, else this bundle.
# --extra-us: decode rows only, each side's extra µs a step over the
# reference (ms/step), for tools/gpu-run.sh repeat-costs.
#
# SPDX-License-Identifier: LGPL-2.1-or-later
import re
import sys
from collections import OrderedDict

args = sys.argv[1:]
extra_us = '--extra-us' in args
if extra_us:
    args.remove('--extra-us')
side = None
runs = OrderedDict()      # measurement -> side -> [tok/s, ...]
steps = OrderedDict()     # decode measurement -> side -> [ms/step, ...]
sides = []
for line in (open(args[0]) if args else sys.stdin):
    m = re.match(r'^== (\S+) \((.*)\), round', line)
    if m:
        side = f'{m.group(1)} ({m.group(2)})'
        if side not in sides:
            sides.append(side)
        continue
    m = re.match(r'^(\S+) (.*?) ?tok/s=([0-9.]+)', line)
    if m and side is not None:
        key = f'{m.group(1)} {m.group(2)}'.strip()
        runs.setdefault(key, OrderedDict()).setdefault(side, []).append(float(m.group(3)))
        ms = re.search(r'ms/step=([0-9.]+)', line)
        if ms:
            steps.setdefault(key, OrderedDict()).setdefault(side, []).append(float(ms.group(1)))

if not runs:
    sys.exit('no measurements in the input')
ref = next((s for s in sides if s.startswith('baseline ')),
           next((s for s in sides if s.startswith('this ')), sides[0]))


def mean(v):
    return sum(v) / len(v)


def table(title, data, cell):
    """A row per measurement of @data, a column per side: cell (values,
    the reference's values, whether this is the reference)"""
    print(f'| {title} | ' + ' | '.join(s + (' = ref' if s == ref else '') for s in sides) + ' |')
    print('|---|' + '---:|' * len(sides))
    for key, by_side in data.items():
        base = by_side.get(ref)
        print(f'| {key} | ' + ' | '.join(cell(by_side[s], base, s == ref) if by_side.get(s) else '—'
                                         for s in sides) + ' |')


def tok_s_cell(v, base, is_ref):
    text = ' / '.join(f'{x:,.1f}' for x in v)
    return text if is_ref or not base else text + f' ({mean(v) / mean(base) - 1:+.1%})'


def extra_us_cell(v, base, is_ref):
    if is_ref:
        return ' / '.join(f'{1000 * x:,.1f}' for x in v)
    return f'{1000 * (mean(v) - mean(base)):+,.1f}' if base else '—'


if extra_us:
    if not steps:
        sys.exit('no decode steps in the input')
    table('µs a step (extra over the reference)', steps, extra_us_cell)
else:
    table('tok/s', runs, tok_s_cell)
