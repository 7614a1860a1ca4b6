#!/usr/bin/env python3
# bench-model-cuda.py: a whole model, libmoe beside transformers on the same
# GPU: prefill and decode tokens/s on PERFORMANCE.md's whole-model shape
# (Qwen1.5-MoE-A2.7B, random bf16 weights).
#
# On the GPU machine, through the bundle (tools/gpu-bundle.sh here first):
#
#   tools/gpu-run.sh model-bench [--no-transformers] [--backend NAME] [--json-out FILE] ...
#
# 1. Writes the random checkpoint once (--model-dir; skipped when its
#    config.json is there): built on the meta device, materialised on the
#    GPU in bf16, weights ~ N(0, 0.02), norms 1, biases 0, then
#    save_pretrained (transformers' own on-disk keys) and a
#    generation_config.json.
# 2. transformers: from_pretrained(dtype=bf16, device_map="cuda",
#    experts_implementation=--tf-backend). Prefill: forward of a [1, P]
#    prompt, and generate of it with one new token. Decode: for each batch
#    B, generate of a [B, 16] prompt (--decode-prompt), greedy, min_new_tokens=max_new_tokens
#    (no end token can stop it; the output length is checked), tok/s =
#    B·S / (time(1 + S new) − time(1 new)). One untimed call, then the
#    median of --repeats, each closed by torch.cuda.synchronize(). Its
#    generate does the decode switch (grouped_mm → batched_mm) itself.
#    Then the model is freed.
# 3. libmoe: moe-bench-model (--libmoe-bench) on the same checkpoint with
#    --device cuda --dtype bfloat16, timed the same way (it prints one
#    "KIND key=value ..." line per measurement; those are parsed).
# 4. One markdown table: metric | transformers | libmoe | ratio | target,
#    the targets from PERFORMANCE.md; --json-out keeps everything.
#
# Prompts are random ids on both sides (same distribution, not the same
# ids). libmoe's forward returns the full [1, P, vocab] F32 logits on the
# host (transformers' stay on the GPU in bf16); the "generate 1 token"
# prefill row has neither side pay for that.
#
# SPDX-License-Identifier: LGPL-2.1-or-later

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

# Qwen/Qwen1.5-MoE-A2.7B's shape (the rest: Qwen2MoeConfig's defaults)
SHAPE = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
    num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
    moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
    max_position_embeddings=8192, decoder_sparse_step=1, norm_topk_prob=False,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
)
TARGETS = {"prefill": 100000, "decode 1": 600, "decode 8": 2500}   # tok/s, PERFORMANCE.md


def parse_args():
    p = argparse.ArgumentParser(description="libmoe vs transformers, whole model on CUDA")
    p.add_argument("--libmoe-bench", required=True, help="path of moe-bench-model")
    p.add_argument("--model-dir", default="/tmp/qwen1.5-moe-a2.7b-random")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--decode-prompt", type=int, default=16, help="decode prompt length (both sides)")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"],
                   help="decoder layers of the checkpoint written (fewer: a quick model to profile)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="grouped_mm", help="libmoe's experts backend")
    p.add_argument("--tf-backend", default="grouped_mm", help="transformers' experts_implementation")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--json-out", default=None)
    return p.parse_args()


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def write_checkpoint(path, layers):
    if os.path.exists(os.path.join(path, "config.json")):
        log(f"checkpoint: {path} is there")
        return
    import torch
    from transformers import GenerationConfig, Qwen2MoeConfig, Qwen2MoeForCausalLM

    t0 = time.perf_counter()
    cfg = Qwen2MoeConfig(**dict(SHAPE, num_hidden_layers=layers))
    # meta then to_empty: no float32 copy and no per-module init on the host
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen2MoeForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1234)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                t.fill_(1.0)
            elif name.endswith("bias"):
                t.zero_()
            else:
                t.normal_(0.0, 0.02, generator=g)
    n = sum(t.numel() for t in model.parameters())
    log(f"checkpoint: {n / 1e9:.2f} B parameters on the GPU in {time.perf_counter() - t0:.1f} s; saving")
    # into a side directory first: a run killed mid-write leaves no config.json behind
    tmp = path.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    GenerationConfig(bos_token_id=SHAPE["bos_token_id"], eos_token_id=SHAPE["eos_token_id"],
                     do_sample=False).save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    log(f"checkpoint: written to {path} in {time.perf_counter() - t0:.1f} s")


def median_time(fn, repeats, sync):
    """One untimed call, then the median wall time (s) of `repeats` calls."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transformers_results(args, batches, res):
    """Fills res as it goes, so a failure keeps what was measured."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, device_map="cuda",
                                                 experts_implementation=args.tf_backend)
    model.eval()
    log(f"transformers: loaded in {time.perf_counter() - t0:.1f} s, experts {model.get_experts_implementation()}")
    V = model.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(1234)
    sync = torch.cuda.synchronize
    res["load_s"] = time.perf_counter() - t0

    def generate(ids, n):
        # min_new_tokens = max_new_tokens masks the end token: nothing stops early
        gc_ = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               eos_token_id=SHAPE["eos_token_id"], pad_token_id=SHAPE["eos_token_id"])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc_)
        if out.shape[1] != ids.shape[1] + n:
            raise RuntimeError(f"generate stopped early: {out.shape[1] - ids.shape[1]} of {n} tokens")

    with torch.inference_mode():
        if args.prefill > 0:
            P = args.prefill
            ids = torch.randint(0, V, (1, P), device="cuda", generator=g)
            s = median_time(lambda: model(input_ids=ids), args.repeats, sync)
            res["prefill"] = {"P": P, "tok/s": P / s, "ms": s * 1e3}
            log(f"transformers: prefill P={P} tok/s={P / s:.1f} ms={s * 1e3:.2f}")
            s = median_time(lambda: generate(ids, 1), args.repeats, sync)
            res["prefill-generate"] = {"P": P, "tok/s": P / s, "ms": s * 1e3}
            log(f"transformers: prefill-generate P={P} tok/s={P / s:.1f} ms={s * 1e3:.2f}")
        S = args.decode_steps
        for B in batches:
            ids = torch.randint(0, V, (B, args.decode_prompt), device="cuda", generator=g)
            s1 = median_time(lambda: generate(ids, 1), args.repeats, sync)
            sS = median_time(lambda: generate(ids, 1 + S), args.repeats, sync)
            dt = sS - s1
            res[f"decode {B}"] = {"B": B, "S": S, "tok/s": B * S / dt, "ms/step": dt * 1e3 / S}
            log(f"transformers: decode B={B} S={S} tok/s={B * S / dt:.1f} ms/step={dt * 1e3 / S:.3f}")


def libmoe_results(args):
    """Runs moe-bench-model; its lines "KIND key=value ..." keyed as transformers_results()' are."""
    cmd = [args.libmoe_bench, "--model", args.model_dir, "--device", "cuda", "--dtype", "bfloat16",
           "--prefill", str(args.prefill), "--batches", args.batches,
           "--decode-steps", str(args.decode_steps), "--decode-prompt", str(args.decode_prompt),
           "--repeats", str(args.repeats)]
    if args.backend:
        cmd += ["--backend", args.backend]
    log("libmoe: " + " ".join(cmd))
    res = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log("  " + line.rstrip())
            words = line.split()
            if not words or words[0] not in ("load", "prefill", "prefill-generate", "decode"):
                if line.startswith("moe-bench-model:"):
                    res["error"] = line.strip()
                continue
            kv = {}
            for w in words[1:]:
                k, _, v = w.partition("=")
                for conv in (int, float, str):
                    try:
                        kv[k] = conv(v)
                        break
                    except ValueError:
                        pass
            key = f"decode {kv['B']}" if words[0] == "decode" else words[0]
            res[key] = kv
    if proc.returncode != 0:
        res.setdefault("error", f"{cmd[0]} exited {proc.returncode}")
    return res


def main():
    args = parse_args()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    write_checkpoint(args.model_dir, args.layers)

    tf = {}
    if not args.no_transformers:
        import torch
        try:
            transformers_results(args, batches, tf)
        except Exception as e:  # keep going: libmoe's numbers are still worth having
            log(f"transformers: failed: {type(e).__name__}: {e}")
            tf["error"] = f"{type(e).__name__}: {e}"[:500]
        # the model went with transformers_results()' frame: give its memory back for libmoe's
        gc.collect()
        torch.cuda.empty_cache()
    moe = libmoe_results(args)

    rows = []
    if args.prefill > 0:
        rows += [("prefill", f"prefill {args.prefill} tok (forward, all logits)", "prefill"),
                 ("prefill-generate", f"prefill {args.prefill} tok (generate 1 token)", "prefill")]
    rows += [(f"decode {B}", f"decode batch {B}, tok/s", f"decode {B}") for B in batches]

    def cell(side, key):
        v = side.get(key, {}).get("tok/s")
        return (f"{v:,.0f}" if v is not None else "—"), v

    print(f"\nQwen1.5-MoE-A2.7B shape, random bf16 weights; transformers experts {args.tf_backend}, "
          f"libmoe {args.backend or 'default'}; decode: {args.decode_steps} steps after a {args.decode_prompt}-token "
          f"prompt; median of {args.repeats}")
    print("| metric | transformers | libmoe | ratio | target |")
    print("|---|---:|---:|---:|---|")
    for key, label, target_key in rows:
        ts, tv = cell(tf, key)
        ms, mv = cell(moe, key)
        ratio = f"{mv / tv:.1f}×" if tv and mv else "—"
        target = TARGETS.get(target_key)
        tcell = "—" if target is None else (
            f"≥ {target:,}" + ("" if mv is None else (" (met)" if mv >= target else " (missed)")))
        print(f"| {label} | {ts} | {ms} | {ratio} | {tcell} |")
    for name, side in (("transformers", tf), ("libmoe", moe)):
        if "error" in side:
            print(f"\n{name}: {side['error']}")

    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"shape": SHAPE, "args": vars(args), "transformers": tf, "libmoe": moe}, f, indent=1)
    if "error" in moe:
        sys.exit(1)


if __name__ == "__main__":
    main()
