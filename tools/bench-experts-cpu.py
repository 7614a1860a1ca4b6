#!/usr/bin/env python3
# bench-experts-cpu.py: libmoe's experts backends side by side with
# transformers' own ones, on the CPU, same inputs, same thread count.
#
# Run with the benchmark venv (torch + transformers; never part of the tests):
#
#   /opt/benchvenv/bin/python tools/bench-experts-cpu.py [--build-dir _build-bench] [--threads 2]
#
# It builds the cases (the silu_many_tokens fixture as is, and a
# Qwen1.5-MoE-A2.7B-shaped layer with seeded random weights and routing,
# with a float64 reference), times transformers' Qwen2MoeExperts with
# config._experts_implementation = eager / batched_mm / grouped_mm under
# torch.inference_mode, runs tools/moe-bench-experts (libmoe) on the same
# case files, and prints one markdown table (plus the raw results as JSON
# with --json-out).
#
# SPDX-License-Identifier: LGPL-2.1-or-later

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKENDS = ("eager", "batched_mm", "grouped_mm")
REPO = Path(__file__).resolve().parent.parent


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--build-dir", default=str(REPO / "_build-bench"),
                   help="libmoe build directory (holds tools/moe-bench-experts and plugins/)")
    p.add_argument("--threads", type=int, default=2, help="torch threads and OPENBLAS_NUM_THREADS (default 2)")
    p.add_argument("--dtypes", default="f32,bf16", help="comma-separated: f32, bf16 (default both)")
    p.add_argument("--tokens", default="1,8,64,512", help="token counts for the Qwen-shaped layer")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per row (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--budget-s", type=float, default=6.0,
                   help="seconds per row after which repeating stops (at least --min-repeat runs)")
    p.add_argument("--min-repeat", type=int, default=3)
    p.add_argument("--max-call-s", type=float, default=20.0,
                   help="skip a transformers row whose single call would take longer than this")
    p.add_argument("--mem-fraction", type=float, default=0.5,
                   help="skip a transformers batched_mm row needing more than this fraction of MemAvailable")
    p.add_argument("--quiet-busy", type=float, default=0.15,
                   help="before each measurement wait until other processes use less than this fraction of the CPUs")
    p.add_argument("--quiet-wait-s", type=float, default=20.0, help="but wait at most this long")
    p.add_argument("--retries", type=int, default=2,
                   help="measure a (backend, T) pair again when other processes took over --quiet-busy meanwhile")
    p.add_argument("--resume", default=None, metavar="FILE",
                   help="keep every measured pair in FILE; a later run with the same build re-measures only"
                        " the pairs that were measured while other processes were busy")
    p.add_argument("--max-minutes", type=float, default=0,
                   help="start no new measurement after this many minutes (use with --resume)")
    p.add_argument("--no-qwen", action="store_true", help="only the fixture case")
    p.add_argument("--fixture", default=str(REPO / "tests/data/experts/silu_many_tokens.safetensors"))
    p.add_argument("--case-dir", default=None,
                   help="write the case files here and keep them (reused when present); default: a temp dir, removed")
    p.add_argument("--json-out", default=None, help="also write every result as JSON here")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


ARGS = parse_args()
# Pin the thread counts before torch (and its OpenMP / MKL) start.
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))
os.environ.setdefault("MKL_NUM_THREADS", str(ARGS.threads))

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Qwen2MoeConfig  # noqa: E402
from transformers.integrations import moe as tf_moe  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts  # noqa: E402

torch.set_num_threads(ARGS.threads)
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------- cases

def reference_f64(hidden, idx, wts, up, down):
    """The layer in float64, one expert at a time (no f64 copy of all weights)."""
    T, H = hidden.shape
    K = idx.shape[1]
    I = down.shape[2]
    out = torch.zeros(T, H, dtype=torch.float64)
    x64 = hidden.double()
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        g_u = x64[tok] @ up[e].double().T
        h = torch.nn.functional.silu(g_u[:, :I]) * g_u[:, I:]
        y = h @ down[e].double().T
        out.index_add_(0, tok, y * wts[tok, slot].double()[:, None])
    del K
    return out


def qwen_case(path, T, seed):
    H, I, E, K = 2048, 1408, 60, 4
    g = torch.Generator().manual_seed(seed)
    up = (torch.randn(E, 2 * I, H, generator=g) * 0.02).contiguous()
    down = (torch.randn(E, H, I, generator=g) * 0.02).contiguous()
    hidden = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    wts, idx = torch.topk(probs, K, dim=-1)           # qwen2_moe: norm_topk_prob False
    idx = idx.to(torch.int64).contiguous()
    wts = wts.to(torch.float32).contiguous()
    t0 = time.perf_counter()
    ref = reference_f64(hidden, idx, wts, up, down)
    log(f"  float64 reference: {time.perf_counter() - t0:.1f} s")
    tensors = {"hidden_states": hidden, "top_k_index": idx, "top_k_weights": wts,
               "up_weight": up, "down_weight": down, "output_f64": ref}
    meta = {"act": '"silu"', "has_gate": "true", "is_transposed": "false", "has_bias": "false",
            "interleaved_clamped_swiglu": "false", "sentinel": "false",
            "T": str(T), "H": str(H), "I": str(I), "E": str(E), "K": str(K),
            "shape": "qwen1.5-moe-a2.7b", "seed": str(seed)}
    t0 = time.perf_counter()
    save_file(tensors, str(path), metadata=meta)
    log(f"  wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s")
    return tensors


# ---------------------------------------------------------------- transformers

def make_module(t, dtype):
    E, two_I, H = t["up_weight"].shape
    I = two_I // 2
    cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                         num_experts_per_tok=t["top_k_index"].shape[1], hidden_act="silu")
    with torch.device("meta"):
        m = Qwen2MoeExperts(cfg)
    # the same weights, no copy for f32 (one rounded copy for bf16)
    m.gate_up_proj = torch.nn.Parameter(t["up_weight"].to(dtype), requires_grad=False)
    m.down_proj = torch.nn.Parameter(t["down_weight"].to(dtype), requires_grad=False)
    m.eval()
    return m, cfg


def rel_err(out, ref):
    d = out.double() - ref
    return (d.norm() / ref.norm()).item()


def check_dispatch(m, impl, x):
    """Which function transformers' forward will run for impl, and for
    grouped_mm whether the native torch grouped GEMM or the per-expert
    fallback op runs."""
    fn = tf_moe.ALL_EXPERTS_FUNCTIONS.get_interface(impl, None)
    name = "Qwen2MoeExperts.forward (model loop)" if fn is None else fn.__name__
    if impl == "eager" and fn is not None:
        raise RuntimeError(f"eager dispatches to {fn}")
    if impl != "eager" and fn is None:
        raise RuntimeError(f"{impl} is not registered in ExpertsInterface")
    if impl == "grouped_mm":
        offs = torch.zeros(m.num_experts, dtype=torch.int32)
        native = tf_moe._can_use_grouped_mm(x, m.gate_up_proj, offs)
        name += " → " + ("torch.nn.functional.grouped_mm" if native else "grouped_mm_fallback (torch.mm per expert)")
    return name


def time_transformers(m, cfg, x, idx, w, impl, ref):
    """Times one transformers implementation on (x, idx, w); returns a result dict."""
    T = x.shape[0]
    E, two_I, H = m.gate_up_proj.shape
    I = two_I // 2
    K = idx.shape[1]
    dtype_name = next(k for k, v in TORCH_DTYPES.items() if v == x.dtype)
    res = {"backend": impl, "dtype": dtype_name, "T": T}
    if impl == "batched_mm":
        need = T * K * (two_I * H + H * I) * m.gate_up_proj.element_size()
        if need > ARGS.mem_fraction * mem_available():
            res["skipped"] = (f"OOM: per-row weight copies {need / 2**30:.0f} GiB"
                              f" > {ARGS.mem_fraction:g}×{mem_available() / 2**30:.0f} GiB free")
            log(f"  transformers {impl:10s} T={T:4d} {dtype_name}: skipped, {res['skipped']}")
            return res
    cfg._experts_implementation = impl
    res["dispatch"] = check_dispatch(m, impl, x)
    times = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = m(x, idx, w)
        first = time.perf_counter() - t0
        res["rel_err"] = rel_err(out, ref)
        if out.dtype != x.dtype or out.shape != x.shape:
            raise RuntimeError(f"{impl}: output {out.dtype} {tuple(out.shape)}")
        if first > ARGS.max_call_s:
            res["skipped"] = f"one call took {first:.0f} s"
            log(f"  transformers {impl:10s} T={T:4d} {dtype_name}: skipped, {res['skipped']}")
            return res
        started = time.perf_counter() - first
        for i in range(ARGS.warmup - 1):
            if time.perf_counter() - started > ARGS.budget_s * 0.25:
                break   # a slow row needs one warm-up call, not all of them
            out = m(x, idx, w)
        started = time.perf_counter()
        for i in range(ARGS.repeat):
            t0 = time.perf_counter()
            out = m(x, idx, w)
            t1 = time.perf_counter()
            times.append((t1 - t0) * 1e6)
            if i + 1 >= ARGS.min_repeat and t1 - started > ARGS.budget_s:
                break
        del out
    res["median_us"] = statistics.median(times)
    res["min_us"] = min(times)
    res["runs"] = len(times)
    log(f"  transformers {impl:10s} T={T:4d} {dtype_name}: {res['median_us']:10.0f} µs"
        f" (min {res['min_us']:.0f}, {res['runs']} runs)  rel_err {res['rel_err']:.2e}  [{res['dispatch']}]")
    return res


# ---------------------------------------------------------------- load from elsewhere

def _cpu_snapshot():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    t = os.times()
    # all CPUs: busy and total jiffies; this process and its waited-for children: seconds
    return sum(v[:8]) - v[3] - v[4], sum(v[:8]), t.user + t.system + t.children_user + t.children_system


def others_share(a, b):
    """Fraction of all CPU time between snapshots a and b used by other processes."""
    tick = os.sysconf("SC_CLK_TCK")
    total = b[1] - a[1]
    if total <= 0:
        return 0.0
    return max(0.0, ((b[0] - a[0]) - (b[2] - a[2]) * tick) / total)


def wait_quiet():
    """Waits (at most --quiet-wait-s) until other processes use under
    --quiet-busy of the CPUs (sampled while this script is idle)."""
    deadline = time.perf_counter() + ARGS.quiet_wait_s
    while True:
        a = _cpu_snapshot()
        time.sleep(0.5)
        busy = others_share(a, _cpu_snapshot())
        if busy <= ARGS.quiet_busy or time.perf_counter() >= deadline:
            return busy


def measured(fn):
    """Runs fn(); returns (its result, the share of the CPUs other processes used meanwhile)."""
    a = _cpu_snapshot()
    r = fn()
    return r, others_share(a, _cpu_snapshot())


# ---------------------------------------------------------------- libmoe

def libmoe_env():
    b = Path(ARGS.build_dir).resolve()
    env = dict(os.environ)
    env["MOE_PLUGIN_PATH"] = ":".join(str(b / "plugins" / n) for n in BACKENDS)
    env["MOE_PLUGIN_SYSTEM_PATH"] = ""
    env["LD_LIBRARY_PATH"] = str(b / "libmoe") + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["OPENBLAS_NUM_THREADS"] = str(ARGS.threads)
    env["OMP_NUM_THREADS"] = str(ARGS.threads)
    return env


def libmoe_cmd(case, dtype_name, tokens, backend=None):
    tool = Path(ARGS.build_dir).resolve() / "tools" / "moe-bench-experts"
    cmd = [str(tool), "--case", str(case), "--dtype", dtype_name,
           "--warmup", str(ARGS.warmup), "--repeat", str(ARGS.repeat),
           "--min-repeat", str(ARGS.min_repeat), "--budget-s", str(ARGS.budget_s)]
    if tokens:
        cmd += ["--tokens", ",".join(str(t) for t in tokens)]
    if backend:
        cmd += ["--backend", backend]
    return cmd


# the kernels OpenBLAS ran in libmoe's processes (moe-bench-experts says)
LIBMOE_BLAS_CORES = set()


def run_libmoe(case, dtype_name, tokens, backend=None):
    cmd = libmoe_cmd(case, dtype_name, tokens, backend)
    log("  $ " + " ".join(cmd))
    p = subprocess.run(cmd, env=libmoe_env(), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"moe-bench-experts failed ({p.returncode}): {p.stderr.strip()}")
    out = {}
    for line in p.stdout.splitlines():
        r = json.loads(line)
        out[(r["T"], r["backend"])] = r
        LIBMOE_BLAS_CORES.add(r.get("blas_core") or "(not OpenBLAS)")
        log(f"  libmoe       {r['backend']:10s} T={r['T']:4d} {dtype_name}: {r['median_us']:10.0f} µs"
            f" (min {r['min_us']}, {r['runs']} runs)  rel_err {r['rel_err']:.2e}")
    return out


# ---------------------------------------------------------------- report

def fmt_us(v):
    if v >= 10000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}"


def git(*a):
    try:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment_lines():
    lines = []
    dirty = git("status", "--porcelain", "--", "libmoe", "plugins")
    lines.append(f"- commit {git('rev-parse', '--short', 'HEAD') or '(unknown)'}"
                 + (" (libmoe/ or plugins/ had uncommitted changes)" if dirty else "")
                 + f"; libmoe build dir {Path(ARGS.build_dir).resolve()} (build digest {build_stamp()})")
    lines.append("- command: " + " ".join([Path(sys.executable).as_posix()] + sys.argv))
    lines.append(f"- python {platform.python_version()}, torch {torch.__version__}"
                 f" (BLAS: {'MKL' if torch.backends.mkl.is_available() else 'other'},"
                 f" CPU capability {torch.backends.cpu.get_cpu_capability()}), transformers {transformers.__version__}")
    try:
        ob = ctypes.CDLL("libopenblas.so.0")
        ob.openblas_get_config.restype = ctypes.c_char_p
        ob.openblas_get_corename.restype = ctypes.c_char_p
        lines.append(f"- libmoe BLAS: OpenBLAS `{ob.openblas_get_config().decode()}`; its dispatch picks"
                     f" core `{ob.openblas_get_corename().decode()}` here, libmoe's runs had"
                     f" `{', '.join(sorted(LIBMOE_BLAS_CORES)) or '(none run)'}`")
    except (OSError, AttributeError):
        lines.append("- libmoe BLAS: (libopenblas.so.0 not loadable here)")
    lines.append(f"- threads: torch.set_num_threads({ARGS.threads}) (get_num_threads() = {torch.get_num_threads()}),"
                 f" OPENBLAS_NUM_THREADS={ARGS.threads} for libmoe")
    for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        lines.append(f"- {k}={os.environ.get(k, '(unset)')}")
    lines.append("- load average at the end: " + " ".join(f"{v:.2f}" for v in os.getloadavg()))
    try:
        with open("/proc/pressure/cpu") as f:
            lines.append("- CPU pressure at the end (/proc/pressure/cpu): " + f.readline().strip())
    except OSError:
        pass
    lines.append(f"- timing: warm-up {ARGS.warmup}, median of up to {ARGS.repeat} calls"
                 f" (at least {ARGS.min_repeat}; a row stops repeating after {ARGS.budget_s:g} s)")
    return lines


def table(rows):
    head = ["case", "T", "dtype"]
    for b in BACKENDS:
        head += [f"{b} libmoe µs", f"{b} transformers µs", f"{b} tf/libmoe"]
    head += ["best libmoe / best tf"]
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]
    for r in rows:
        cells = [r["case"], str(r["T"]), r["dtype"]]
        best_l, best_t = None, None
        for b in BACKENDS:
            lb, tb = r["libmoe"].get(b), r["tf"].get(b)
            lv = lb["median_us"] if lb and lb.get("median_us") is not None else None
            tv = tb.get("median_us") if tb else None
            cells.append(fmt_us(lv) if lv is not None else "—")
            cells.append(fmt_us(tv) if tv is not None else f"skipped ({tb['skipped']})" if tb else "—")
            cells.append(f"{tv / lv:.2f}×" if lv and tv else "—")
            if lv is not None:
                best_l = lv if best_l is None else min(best_l, lv)
            if tv is not None:
                best_t = tv if best_t is None else min(best_t, tv)
        cells.append(f"{best_t / best_l:.2f}×" if best_l and best_t else "—")
        out.append("| " + " | ".join(cells) + " |")
    return out


def min_table(rows):
    head = ["case", "T", "dtype"]
    for b in BACKENDS:
        head += [f"{b} libmoe", f"{b} tf", "tf/libmoe"]
    out = ["| " + " | ".join(head) + " |",
           "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]
    for r in rows:
        cells = [r["case"], str(r["T"]), r["dtype"]]
        for b in BACKENDS:
            lb, tb = r["libmoe"].get(b), r["tf"].get(b)
            lv = lb.get("min_us") if lb else None
            tv = tb.get("min_us") if tb else None
            cells += [fmt_us(lv) if lv is not None else "—", fmt_us(tv) if tv is not None else "skipped",
                      f"{tv / lv:.2f}×" if lv and tv else "—"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def err_table(rows):
    head = ["case", "T", "dtype"] + [f"{b} libmoe / transformers" for b in BACKENDS]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        cells = [r["case"], str(r["T"]), r["dtype"]]
        for b in BACKENDS:
            lb, tb = r["libmoe"].get(b), r["tf"].get(b)
            le = f"{lb['rel_err']:.1e}" if lb and lb.get("rel_err") is not None else "—"
            te = f"{tb['rel_err']:.1e}" if tb and tb.get("rel_err") is not None else "—"
            cells.append(f"{le} / {te}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def case_tokens(path):
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return f.get_slice("hidden_states").get_shape()[0]


def build_stamp():
    """A digest of the libmoe build that is timed (library, plugins, tool)."""
    import hashlib
    b = Path(ARGS.build_dir).resolve()
    h = hashlib.sha256()
    for f in sorted([*(b / "libmoe").glob("libmoe-*.so.*.*.*"), *(b / "plugins").glob("*/libmoe-*.so"),
                     b / "tools" / "moe-bench-experts"]):
        if f.is_file():
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def main():
    dtypes = [d.strip() for d in ARGS.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in TORCH_DTYPES:
            sys.exit(f"unknown dtype {d}")
    tokens = [int(v) for v in ARGS.tokens.split(",") if v.strip()]
    tool = Path(ARGS.build_dir).resolve() / "tools" / "moe-bench-experts"
    if not tool.exists():
        sys.exit(f"{tool} is missing: build with `meson setup {ARGS.build_dir} -Dtests=false && ninja -C {ARGS.build_dir}`")

    started = time.perf_counter()
    tmp = None
    if ARGS.case_dir:
        case_dir = Path(ARGS.case_dir)
        case_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="moe-bench-")
        case_dir = Path(tmp.name)
    rows = []
    cases = []

    fixture = Path(ARGS.fixture)
    cases.append(("silu_many_tokens (H128 I64 E32 K8)", fixture, None))
    if not ARGS.no_qwen:
        T_max = max(tokens)
        path = case_dir / f"qwen15moe_T{T_max}_seed{ARGS.seed}.safetensors"
        if path.exists():
            log(f"reusing {path}")
        else:
            log(f"building the Qwen1.5-MoE-A2.7B-shaped case (T up to {T_max})")
            qwen_case(path, T_max, ARGS.seed)
        cases.append(("qwen1.5-moe-a2.7b (H2048 I1408 E60 K4)", path, tokens))

    # --resume: pairs measured earlier with the same libmoe build are kept when
    # they were measured on a quiet machine (or are too slow to redo)
    stamp = build_stamp()
    saved = {}
    if ARGS.resume and Path(ARGS.resume).exists():
        with open(ARGS.resume) as f:
            old = json.load(f)
        if old.get("build") == stamp and old.get("threads") == ARGS.threads:
            saved = old.get("pairs", {})
            log(f"resuming from {ARGS.resume}: {len(saved)} pairs")
        else:
            log(f"{ARGS.resume} holds another build or thread count: measuring everything again")
    deadline = started + ARGS.max_minutes * 60 if ARGS.max_minutes else None

    def save():
        if ARGS.resume:
            with open(ARGS.resume, "w") as f:
                json.dump({"build": stamp, "threads": ARGS.threads, "pairs": saved}, f, indent=1)

    def settled(p):
        slow = max((p["tf"] or {}).get("median_us") or 0, (p["libmoe"] or {}).get("median_us") or 0) > 2e6
        return max(p["others"]) <= ARGS.quiet_busy or slow or "median_us" not in (p["tf"] or {})

    for name, path, toks in cases:
        keys = [(d, T, b) for d in dtypes for T in (toks or [case_tokens(path)]) for b in BACKENDS]
        if all(f"{name}|{T}|{d}|{b}" in saved and settled(saved[f"{name}|{T}|{d}|{b}"]) for d, T, b in keys):
            continue
        log(f"case {name}: {path}")
        # private copies: safetensors maps the file, and mapped pages can be
        # evicted and re-read from disk in the middle of a timed call
        t = {k: v.clone() for k, v in load_file(str(path)).items()}
        ts = toks or [t["hidden_states"].shape[0]]
        for d in dtypes:
            m = cfg = None
            for T in ts:
                x = t["hidden_states"][:T].to(TORCH_DTYPES[d]).contiguous()
                idx = t["top_k_index"][:T].contiguous()
                w = t["top_k_weights"][:T].contiguous()   # the router's fp32 weights, as in the model
                ref = t["output_f64"][:T]
                for b in BACKENDS:
                    key = f"{name}|{T}|{d}|{b}"
                    best = saved.get(key)
                    if best is not None and settled(best):
                        continue
                    if deadline is not None and time.perf_counter() > deadline:
                        log(f"  --max-minutes reached: {key} left for a later --resume run")
                        continue
                    if m is None:
                        m, cfg = make_module(t, TORCH_DTYPES[d])
                    # libmoe and transformers back to back, each after waiting
                    # for the machine to go quiet; again (up to --retries
                    # times) when other processes took CPU time meanwhile
                    for attempt in range(1 + ARGS.retries):
                        wait_quiet()
                        lib, lo = measured(lambda: run_libmoe(path, d, [T] if toks else None, b).get((T, b)))
                        wait_quiet()
                        tf, to = measured(lambda: time_transformers(m, cfg, x, idx, w, b, ref))
                        cand = {"libmoe": lib, "tf": tf, "others": [lo, to],
                                "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
                        if best is None or max(cand["others"]) < max(best["others"]):
                            best = cand
                        saved[key] = best
                        save()
                        if settled(best) or attempt == ARGS.retries:
                            break
                        log(f"  (other processes took {max(lo, to):.0%} of the CPUs; measuring {b} again)")
            del m, cfg
        del t

    rows = []
    for name, path, toks in cases:
        for d in dtypes:
            for T in (toks or [case_tokens(path)]):
                row = {"case": name, "T": T, "dtype": d, "libmoe": {}, "tf": {}, "others_share": {}}
                for b in BACKENDS:
                    p = saved.get(f"{name}|{T}|{d}|{b}")
                    if p is not None:
                        row["libmoe"][b], row["tf"][b], row["others_share"][b] = p["libmoe"], p["tf"], p["others"]
                if row["others_share"]:
                    rows.append(row)

    elapsed = time.perf_counter() - started
    lines = ["### Environment", ""] + environment_lines() + [f"- wall time of this run: {elapsed:.0f} s", ""]
    lines += ["### Median µs per call (ratio > 1: libmoe is faster)", ""] + table(rows) + [""]
    lines += ["### Fastest call, µs (less sensitive to other load on the machine)", ""] + min_table(rows) + [""]
    lines += ["### Relative error ‖out − ref‖ / ‖ref‖ vs the float64 reference (libmoe / transformers)", ""]
    lines += err_table(rows) + [""]
    busy = [(r, b, max(v)) for r in rows for b, v in r["others_share"].items() if max(v) > ARGS.quiet_busy]
    lines += ["### Other load on the machine", ""]
    if busy:
        lines.append(f"Rows where other processes took more than {ARGS.quiet_busy:.0%} of the CPU time while they were"
                     f" measured, even at the least loaded of up to {1 + ARGS.retries} tries (libmoe or transformers side,"
                     f" whichever was worse): "
                     + ", ".join(f"{r['case'].split()[0]} T={r['T']} {r['dtype']} {b} ({v:.0%})" for r, b, v in busy))
    else:
        lines.append(f"Other processes took under {ARGS.quiet_busy:.0%} of the CPU time during every row.")
    lines.append("")
    disp = {}
    for r in rows:
        for b, v in r["tf"].items():
            if v.get("dispatch"):
                disp.setdefault(b, set()).add(v["dispatch"])
    lines += ["### What transformers ran", ""]
    for b in BACKENDS:
        lines.append(f"- `{b}`: " + "; ".join(sorted(disp.get(b, {"(not run)"}))))
    lines.append("")
    print("\n".join(lines))

    if ARGS.json_out:
        with open(ARGS.json_out, "w") as f:
            json.dump({"rows": rows, "threads": ARGS.threads, "elapsed_s": elapsed, "build": stamp}, f, indent=1)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
