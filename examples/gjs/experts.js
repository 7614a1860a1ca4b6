// SPDX-License-Identifier: LGPL-2.1-or-later
//
// Runs one MoE experts layer through every libmoe experts backend that runs
// on the CPU and prints how long each takes.
//
// Usage, from a build directory's dev environment:
//
//   meson devenv -C _build gjs -m ../examples/gjs/experts.js [CHECKPOINT [PREFIX]]
//
// CHECKPOINT is either one of the test fixtures (tests/data/experts/*.safetensors,
// which hold the layer's weights and inputs, and the reference output) or a
// model checkpoint such as data/pycoder-moe/model.safetensors, whose experts
// under PREFIX (default model.layers.0.mlp.experts) get made-up inputs.

import GLib from 'gi://GLib';
import Moe from 'gi://Moe?version=1';
import System from 'system';

const here = GLib.path_get_dirname(GLib.filename_from_uri(import.meta.url)[0]);
const DEFAULT = GLib.build_filenamev([here, '..', '..', 'tests', 'data', 'experts',
    'silu_many_tokens.safetensors']);

// A tensor's elements as a Float32Array (GLib.Bytes.get_data() gives a
// Uint8Array, which may not be 4-byte aligned: copy it then).
function floats(tensor) {
    let u8 = tensor.to_f32_bytes().get_data();
    if (u8.byteOffset % 4 !== 0)
        u8 = u8.slice();
    return new Float32Array(u8.buffer, u8.byteOffset, u8.length / 4);
}

function bytesOf(typedArray) {
    return new GLib.Bytes(new Uint8Array(typedArray.buffer, typedArray.byteOffset, typedArray.byteLength));
}

// Experts and inputs stored in a test fixture, configured from its metadata.
function fromFixture(ck) {
    const md = ck.get_metadata();
    const ex = Moe.Experts.new(ck.get_tensor('up_weight'), ck.get_tensor('down_weight'));
    ex.activation = md.act.replace(/"/g, '');        // stored JSON-quoted
    ex.has_gate = md.has_gate === 'true';
    ex.is_transposed = md.is_transposed === 'true';
    if (md.interleaved_clamped_swiglu === 'true')     // GPT-OSS
        ex.gate_layout = Moe.GateLayout.INTERLEAVED;
    if (ck.has_tensor('up_bias'))
        ex.up_bias = ck.get_tensor('up_bias');
    if (ck.has_tensor('down_bias'))
        ex.down_bias = ck.get_tensor('down_bias');
    const inputs = ['hidden_states', 'top_k_index', 'top_k_weights'].map(n => ck.get_tensor(n));
    return [ex, inputs, ck.get_tensor('output_f64')];
}

// One layer's experts from a model checkpoint, with made-up inputs.
function fromModel(ck, prefix, T = 64, K = 2) {
    const ex = ck.load_experts(prefix);
    const E = ex.num_experts, H = ex.hidden_size;
    const hidden = Float32Array.from({length: T * H}, (_, i) => Math.sin(i * 0.37));
    const ids = BigInt64Array.from({length: T * K}, (_, i) => BigInt((Math.floor(i / K) * 3 + i % K) % E));
    const weights = new Float32Array(T * K).fill(1 / K);
    return [ex, [
        // the hidden states take the weights' dtype (the demo model is bf16)
        Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, H], bytesOf(hidden)).to_dtype(ex.up_weight.get_dtype()),
        Moe.Tensor.new_from_bytes(Moe.DType.I64, [T, K], bytesOf(ids)),
        Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, K], bytesOf(weights)),
    ], null];
}

const [path = DEFAULT, prefix = 'model.layers.0.mlp.experts'] = ARGV;
let ex, inputs, reference;
try {
    const ck = Moe.Checkpoint.open(path);
    [ex, inputs, reference] = ck.has_tensor('hidden_states') ? fromFixture(ck) : fromModel(ck, prefix);
} catch (e) {
    printerr(`${path}: ${e.message}`);
    System.exit(1);
}

const [hidden, index] = inputs;
print(`${GLib.path_get_basename(path)}: E=${ex.num_experts} H=${ex.hidden_size} ` +
      `I=${ex.intermediate_size}, ${hidden.get_dim(0)} tokens, top-${index.get_dim(1)}, ` +
      `${Moe.dtype_get_name(hidden.get_dtype())}`);

const backends = Moe.PluginRegistry.get_default().list_backends_for_device('cpu');
print(`backends: ${backends.join(', ')}`);
const ref = reference ? floats(reference) : null;

for (const name of backends) {
    ex.implementation = name;
    let out, runs = 0, elapsed = 0;
    try {
        out = ex.forward(...inputs);                  // the first run also prepares
        const start = GLib.get_monotonic_time();      // microseconds
        while (runs < 3 || elapsed < 200e3) {
            out = ex.forward(...inputs);
            runs++;
            elapsed = GLib.get_monotonic_time() - start;
        }
    } catch (e) {
        print(`  ${name.padEnd(12)} failed: ${e.message}`);
        continue;
    }
    let line = `  ${name.padEnd(12)} ${(elapsed / 1e3 / runs).toFixed(3).padStart(8)} ms per forward`;
    if (ref) {
        const got = floats(out);
        let num = 0, den = 0;
        for (let i = 0; i < ref.length; i++) {
            num += (got[i] - ref[i]) ** 2;
            den += ref[i] ** 2;
        }
        line += `   rel. error vs reference ${Math.sqrt(num / den).toExponential(1)}`;
    }
    print(line);
}
