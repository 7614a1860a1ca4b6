#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
#
# Runs one MoE experts layer through every libmoe experts backend that runs
# on the CPU and prints how long each takes.
#
# Usage, from a build directory's dev environment:
#
#   meson devenv -C _build python3 ../examples/python/experts.py [CHECKPOINT [PREFIX]]
#
# CHECKPOINT is either one of the test fixtures (tests/data/experts/*.safetensors,
# which hold the layer's weights and inputs, and the reference output) or a
# model checkpoint such as data/pycoder-moe/model.safetensors, whose experts
# under PREFIX (default model.layers.0.mlp.experts) get made-up inputs.

import array
import math
import os
import random
import struct
import sys
import time

import gi

gi.require_version('Moe', '1')
from gi.repository import GLib, Moe  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..')
DEFAULT = os.path.join(REPO, 'tests', 'data', 'experts', 'silu_many_tokens.safetensors')


def floats(tensor):
    """A tensor's elements as a Python array of floats."""
    return array.array('f', tensor.to_f32_bytes().get_data())


def from_fixture(ck):
    """Experts and inputs stored in a test fixture, configured from its metadata."""
    md = ck.get_metadata()
    ex = Moe.Experts.new(ck.get_tensor('up_weight'), ck.get_tensor('down_weight'))
    ex.props.activation = md['act'].strip('"')          # stored JSON-quoted
    ex.props.has_gate = md['has_gate'] == 'true'
    ex.props.is_transposed = md['is_transposed'] == 'true'
    if md.get('interleaved_clamped_swiglu') == 'true':   # GPT-OSS
        ex.props.gate_layout = Moe.GateLayout.INTERLEAVED
    if ck.has_tensor('up_bias'):
        ex.set_up_bias(ck.get_tensor('up_bias'))
    if ck.has_tensor('down_bias'):
        ex.set_down_bias(ck.get_tensor('down_bias'))
    inputs = [ck.get_tensor(n) for n in ('hidden_states', 'top_k_index', 'top_k_weights')]
    return ex, inputs, ck.get_tensor('output_f64')


def from_model(ck, prefix, T=64, K=2):
    """One layer's experts from a model checkpoint, with random inputs."""
    ex = ck.load_experts(prefix)
    E, H = ex.props.num_experts, ex.props.hidden_size
    rng = random.Random(0)
    hidden = array.array('f', (rng.gauss(0, 1) for _ in range(T * H)))
    ids = [e for t in range(T) for e in rng.sample(range(E), K)]
    hidden_t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, H], GLib.Bytes(hidden.tobytes()))
    # the hidden states take the weights' dtype (the demo model is bf16)
    hidden_t = hidden_t.to_dtype(ex.get_up_weight().get_dtype())
    index_t = Moe.Tensor.new_from_bytes(Moe.DType.I64, [T, K],
                                        GLib.Bytes(struct.pack('<%dq' % len(ids), *ids)))
    weights_t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, K],
                                          GLib.Bytes(array.array('f', [1.0 / K] * (T * K)).tobytes()))
    return ex, [hidden_t, index_t, weights_t], None


def main(argv):
    path = argv[1] if len(argv) > 1 else DEFAULT
    prefix = argv[2] if len(argv) > 2 else 'model.layers.0.mlp.experts'
    try:
        ck = Moe.Checkpoint.open(path)
        if ck.has_tensor('hidden_states'):
            ex, inputs, reference = from_fixture(ck)
        else:
            ex, inputs, reference = from_model(ck, prefix)
    except GLib.Error as e:
        print('%s: %s' % (path, e.message), file=sys.stderr)
        return 1

    hidden = inputs[0]
    print('%s: E=%d H=%d I=%d, %d tokens, top-%d, %s' % (
        os.path.basename(path), ex.props.num_experts, ex.props.hidden_size,
        ex.props.intermediate_size, hidden.get_dim(0), inputs[1].get_dim(1),
        Moe.dtype_get_name(hidden.get_dtype())))

    backends = Moe.PluginRegistry.get_default().list_backends_for_device('cpu')
    print('backends:', ', '.join(backends))
    ref = floats(reference) if reference is not None else None

    for name in backends:
        ex.props.implementation = name
        try:
            out = ex.forward(*inputs)                    # the first run also prepares
            runs, start = 0, time.perf_counter()
            while runs < 3 or time.perf_counter() - start < 0.2:
                out = ex.forward(*inputs)
                runs += 1
        except GLib.Error as e:
            print('  %-12s failed: %s' % (name, e.message))
            continue
        ms = (time.perf_counter() - start) * 1e3 / runs
        line = '  %-12s %8.3f ms per forward' % (name, ms)
        if ref is not None:
            got = floats(out)
            err = math.sqrt(sum((g - r) ** 2 for g, r in zip(got, ref)) / sum(r * r for r in ref))
            line += '   rel. error vs reference %.1e' % err
        print(line)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
