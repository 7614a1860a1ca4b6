#!/usr/bin/env python3
"""Counts meson's test log and prints 'N passed, N failed, N skipped'.
Exits non-zero if a test failed or if no test ran at all."""
import json, sys

counts = {'passed': 0, 'failed': 0, 'skipped': 0}
kinds = {'OK': 'passed', 'EXPECTEDFAIL': 'passed', 'SKIP': 'skipped'}
with open(sys.argv[1]) as log:
    for line in log:
        if line.strip():
            counts[kinds.get(json.loads(line)['result'], 'failed')] += 1
print('%(passed)d passed, %(failed)d failed, %(skipped)d skipped' % counts)
sys.exit(1 if counts['failed'] or counts['passed'] == 0 else 0)
