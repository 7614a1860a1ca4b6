#!/usr/bin/env python3
# bench-experts-cuda.py: libmoe's experts backends on CUDA side by side with
# transformers' on the same GPU, in one run, on PERFORMANCE.md's layer table
# (bf16, routed experts of one layer, uniform random routing).
#
# On the GPU machine, through the bundle (tools/gpu-bundle.sh here first):
#
#   tools/gpu-run.sh bench [--shapes qwen3-30b-a3b,...] [--tokens 1,8,64,...]
#
# For each shape, transformers first: Qwen3MoeExperts with
# config._experts_implementation = eager / batched_mm / grouped_mm, random
# bf16 weights on the GPU; then its memory is freed and
# tools/moe-bench-cuda-experts (libmoe) runs the same shape. Both sides are
# timed the same way: warm-up, then batches of back-to-back calls closed by a
# device synchronize, the median over batches of (batch time / calls). The
# inputs are random on both sides (the same distribution, not the same
# bytes: libmoe's side tiles a seeded block). Prints one markdown table with
# the floor (PERFORMANCE.md's formula, the machine's measured ceilings) and
# the ratios; --json-out keeps every row.
#
# SPDX-License-Identifier: LGPL-2.1-or-later

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {
    # name: (H, I, E, K)
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "deepseek-v3": (7168, 2048, 256, 8),
    # DeepGEMM's contiguous grouped test shapes as one layer: gate_up is
    # (groups, M/group, N=4096, K=7168), down (groups, M/group, 7168, 2048)
    "deepgemm-4x8192": (7168, 2048, 4, 1),
    "deepgemm-8x4096": (7168, 2048, 8, 1),
}
BACKENDS = ("eager", "batched_mm", "grouped_mm")
COPY_BW = 4.3e12      # bytes/s, device-to-device copy measured on the H200
BF16_PEAK = 790e12    # FLOP/s, dense bf16 matmul measured on the H200


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--libmoe-bench", required=True, help="path of moe-bench-cuda-experts")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default="1,8,64,512,4096,16384")
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--max-call-ms", type=float, default=2000.0,
                   help="skip a backend (this T and larger) whose first call is slower")
    p.add_argument("--max-copy-gib", type=float, default=40.0,
                   help="skip transformers' batched_mm where its per-row weight copies exceed this")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--libmoe-backends", default=",".join(BACKENDS),
                   help="libmoe's backends; those transformers lacks get columns of their own")
    p.add_argument("--weights", default="bf16", help="libmoe's expert weights: bf16, fp8 or fp4")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def floor_us(H, I, E, K, T, weights="bf16"):
    """PERFORMANCE.md's floor; FP8: half the weight bytes, twice the matrix rate."""
    fp8 = weights == "fp8"
    touched = E * (1 - (1 - K / E) ** T)
    nbytes = touched * 3 * H * I * (1 if fp8 else 2) + 2 * T * H * 2 + T * K * 12
    flops = 2 * T * K * 3 * H * I
    return max(nbytes / COPY_BW, flops / (BF16_PEAK * (2 if fp8 else 1))) * 1e6


def time_calls(fn, sync, batches, max_call_ms):
    """Median over batches of per-call time (µs); None and the first call's ms if too slow."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first_ms = (time.perf_counter() - t0) * 1e3
    if first_ms > max_call_ms:
        return None, first_ms
    for _ in range(2):
        fn()
    sync()
    calls = int(min(200, max(1, 20.0 / max(first_ms, 0.001))))
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(per_call), first_ms


def transformers_rows(name, H, I, E, K, tokens, args):
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    dev = torch.device("cuda")
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                         num_experts_per_tok=K, hidden_act="silu")
    with torch.device("meta"):
        m = Qwen3MoeExperts(cfg)
    g = torch.Generator(device=dev).manual_seed(1234)
    m.gate_up_proj = torch.nn.Parameter(
        (torch.rand(E, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) * 2 - 1) * (1.7 / H ** 0.5),
        requires_grad=False)
    m.down_proj = torch.nn.Parameter(
        (torch.rand(E, H, I, device=dev, generator=g, dtype=torch.bfloat16) * 2 - 1) * (1.7 / I ** 0.5),
        requires_grad=False)
    m.eval()
    rows, too_slow = [], set()
    for T in tokens:
        x = torch.rand(T, H, device=dev, generator=g, dtype=torch.bfloat16) * 2 - 1
        idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=-1).indices.to(torch.int64)
        w = torch.rand(T, K, device=dev, generator=g) + 0.1
        w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
        for impl in BACKENDS:
            row = {"side": "transformers", "shape": name, "backend": impl, "T": T}
            need = T * K * 3 * H * I * 2
            if impl in too_slow:
                row["skipped"] = "a smaller T was too slow"
            elif impl == "batched_mm" and need > args.max_copy_gib * 2 ** 30:
                row["skipped"] = f"OOM: per-row weight copies {need / 2 ** 30:.0f} GiB"
            else:
                cfg._experts_implementation = impl
                try:
                    with torch.inference_mode():
                        med, first = time_calls(lambda: m(x, idx, w), torch.cuda.synchronize,
                                                args.batches, args.max_call_ms)
                    if med is None:
                        too_slow.add(impl)
                        row["skipped"] = f"one call took {first:.0f} ms"
                    else:
                        row["median_us"] = med
                except torch.OutOfMemoryError:
                    row["skipped"] = "OOM"
                    torch.cuda.empty_cache()
            log(f"  transformers {name} {impl:10s} T={T:5d}: {row.get('median_us', row.get('skipped'))}")
            rows.append(row)
    del m
    torch.cuda.empty_cache()
    return rows


def libmoe_rows(name, H, I, E, K, tokens, args):
    cmd = [args.libmoe_bench, "--shape", f"{H},{I},{E},{K}", "--tokens", ",".join(map(str, tokens)),
           "--batches", str(args.batches), "--max-call-ms", str(args.max_call_ms), "--weights", args.weights]
    for b in args.libmoe_backends.split(","):
        cmd += ["--backend", b]
    rows = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:
            r = json.loads(line)
            r.update(side="libmoe", shape=name)
            log(f"  libmoe       {name} {r['backend']:10s} T={r['T']:5d}: {r.get('median_us', r.get('skipped'))}"
                f"  diff vs eager {r.get('rel_diff_vs_eager', '-')}")
            rows.append(r)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} exited {proc.returncode}")
    return rows


def fmt(us):
    if us is None:
        return "—"
    return f"{us:.0f}" if us >= 10 else f"{us:.1f}"


def main():
    args = parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for name in args.shapes.split(","):
        H, I, E, K = SHAPES[name]
        log(f"{name}: H={H} I={I} E={E} K={K}")
        if not args.no_transformers:
            rows += transformers_rows(name, H, I, E, K, tokens, args)
        rows += libmoe_rows(name, H, I, E, K, tokens, args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)

    def get(side, shape, backend, T):
        for r in rows:
            if r["side"] == side and r["shape"] == shape and r["backend"] == backend and r["T"] == T:
                return r.get("median_us")
        return None

    moe_backends = args.libmoe_backends.split(",")
    extra = [b for b in moe_backends if b not in BACKENDS]
    print(f"libmoe expert weights: {args.weights} (transformers: bf16); floor for {args.weights}; "
          "TFLOP/s is the best libmoe backend's (2·T·K·3·H·I / time)")
    print("| shape (H, I, E, K) | T | floor | tf eager | tf batched | tf grouped "
          "| moe eager | moe batched | moe grouped | " + "".join(f"moe {b} | " for b in extra) +
          "best / floor | TFLOP/s | eager × | batched × | grouped × |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(extra) + "---:|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        H, I, E, K = SHAPES[name]
        for T in tokens:
            fl = floor_us(H, I, E, K, T, args.weights)
            tf = [get("transformers", name, b, T) for b in BACKENDS]
            mo = [get("libmoe", name, b, T) for b in BACKENDS + tuple(extra)]
            best = min([v for v in mo if v is not None], default=None)
            speedups = [f"{t / m:.1f}" if t and m else "—" for t, m in zip(tf, mo)]
            label = f"{name} ({H}, {I}, {E}, {K})" if T == tokens[0] else ""
            cells = f"| {label} | {T} | {fmt(fl)} | " + " | ".join(fmt(v) for v in tf + mo)
            if best:
                tflops = 2 * T * K * 3 * H * I / (best * 1e-6) / 1e12
                print(cells + f" | {best / fl:.2f}× | {tflops:.0f} | " + " | ".join(speedups) + " |")
            else:
                print(cells + " | — | — | — | — | — |")

if __name__ == "__main__":
    main()
