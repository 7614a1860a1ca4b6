// SPDX-License-Identifier: LGPL-2.1-or-later
//
// Moe.Experts through GJS: every fixture in tests/data/experts (written by
// Hugging Face transformers, whose float64 output is the oracle) run through
// every experts backend the registry finds, plus the errors a caller gets
// for bad inputs.
//
// Run as `gjs -m test-experts.js` from the build tree (meson sets
// GI_TYPELIB_PATH, MOE_PLUGIN_PATH, MOE_TEST_DATA). Any failed check makes
// it exit non-zero.

import GLib from 'gi://GLib';
import Gio from 'gi://Gio';
import Moe from 'gi://Moe?version=1';
import {test, run, assert, assertEqual, assertArrayEqual, assertLessEqual, assertMoeError,
    testData, typedView, bytesOf, relErr as relErrOf} from './harness.js';

const BACKENDS = ['batched_mm', 'eager', 'grouped_mm'];
const F32_TOL = 1e-5;
const BF16_TOL = 2e-2;

/* --- helpers -------------------------------------------------------------- */

function dataDir() {
    return testData('experts');
}

function listFixtures() {
    const dir = Gio.File.new_for_path(dataDir());
    const e = dir.enumerate_children('standard::name', Gio.FileQueryInfoFlags.NONE, null);
    const out = [];
    let info;
    while ((info = e.next_file(null)) !== null) {
        if (info.get_name().endsWith('.safetensors'))
            out.push(dir.get_child(info.get_name()).get_path());
    }
    return out.sort();
}

const FIXTURES = listFixtures();

function basename(path) {
    return GLib.path_get_basename(path);
}

// The tensor's elements as numbers (F64 read exactly, the rest via F32).
function values(tensor) {
    if (tensor.get_dtype() === Moe.DType.F64)
        return typedView(tensor.dup_bytes(), Float64Array);
    return typedView(tensor.to_f32_bytes(), Float32Array);
}

function i64Tensor(shape, ids) {
    return Moe.Tensor.new_from_bytes(Moe.DType.I64, shape,
        bytesOf(BigInt64Array.from(ids, x => BigInt(x))));
}

// ||got - ref|| / ||ref||
function relErr(got, ref) {
    return relErrOf(got, ref, 'reference output');
}

function flag(md, key) {
    const v = md[key] ?? 'false';
    assert(v === 'true' || v === 'false', `${key} is 'true' or 'false', not ${v}`);
    return v === 'true';
}

function meta(ck) {
    const md = ck.get_metadata();
    for (const k of ['T', 'E', 'K', 'H', 'I'])
        md[k] = parseInt(md[k]);
    return md;
}

// Builds Moe.Experts as the fixture's metadata describes them.
function makeExperts(ck, backend, dtype = Moe.DType.F32) {
    const md = ck.get_metadata();
    const load = name => {
        const t = ck.get_tensor(name);
        return t.get_dtype() === dtype ? t : t.to_dtype(dtype);
    };
    const ex = Moe.Experts.new(load('up_weight'), load('down_weight'));
    ex.activation = md.act.replace(/^"|"$/g, '');
    ex.has_gate = flag(md, 'has_gate');
    ex.is_transposed = flag(md, 'is_transposed');
    if (flag(md, 'interleaved_clamped_swiglu'))
        ex.gate_layout = Moe.GateLayout.INTERLEAVED;
    if (ck.has_tensor('up_bias'))
        ex.up_bias = load('up_bias');
    if (ck.has_tensor('down_bias'))
        ex.down_bias = load('down_bias');
    ex.implementation = backend;
    return ex;
}

function inputs(ck) {
    return [ck.get_tensor('hidden_states'), ck.get_tensor('top_k_index'), ck.get_tensor('top_k_weights')];
}

const registry = Moe.PluginRegistry.get_default();
// the backends that run on the CPU (deepgemm, sonicmoe… need a GPU)
const backends = registry.list_backends_for_device('cpu');

/* --- tests ----------------------------------------------------------------- */

test('registry lists the three backends', () => {
    for (const name of BACKENDS)
        assert(backends.includes(name), `${name} in [${backends}]`);
});

test('fixtures are present', () => {
    assert(FIXTURES.length > 0, `fixtures in ${dataDir()}`);
    for (const path of FIXTURES) {
        const md = Moe.Checkpoint.open(path).get_metadata();
        for (const key of ['act', 'has_gate', 'is_transposed', 'T', 'E', 'K', 'H', 'I'])
            assert(key in md, `${basename(path)} has metadata ${key}`);
    }
});

test('f32 output matches the float64 reference', () => {
    for (const path of FIXTURES) {
        const ck = Moe.Checkpoint.open(path);
        const md = meta(ck);
        const ref = values(ck.get_tensor('output_f64'));
        for (const backend of backends) {
            const what = `${basename(path)} ${backend}`;
            const ex = makeExperts(ck, backend);
            assertEqual(ex.num_experts, md.E, `${what} num-experts`);
            assertEqual(ex.hidden_size, md.H, `${what} hidden-size`);
            assertEqual(ex.intermediate_size, md.I, `${what} intermediate-size`);
            assert(ex.validate(), `${what} validates`);
            const out = ex.forward(...inputs(ck));
            assertEqual(out.get_dtype(), Moe.DType.F32, `${what} dtype`);
            assertArrayEqual(out.get_shape(), [md.T, md.H], `${what} shape`);
            assertLessEqual(relErr(values(out), ref), F32_TOL, `${what} relative error`);
        }
    }
});

test('bf16 output matches the float64 reference', () => {
    for (const path of FIXTURES) {
        const ck = Moe.Checkpoint.open(path);
        const ref = values(ck.get_tensor('output_f64'));
        const [hidden32, index, weights] = inputs(ck);
        const hidden = hidden32.to_dtype(Moe.DType.BF16);
        assertEqual(hidden.get_dtype(), Moe.DType.BF16, 'converted hidden_states');
        for (const backend of backends) {
            const what = `${basename(path)} ${backend} bf16`;
            const ex = makeExperts(ck, backend, Moe.DType.BF16);
            assertEqual(ex.up_weight.get_dtype(), Moe.DType.BF16, `${what} up-weight dtype`);
            const out = ex.forward(hidden, index, weights);
            assertEqual(out.get_dtype(), Moe.DType.BF16, `${what} dtype`);
            assertArrayEqual(out.get_shape(), hidden.get_shape(), `${what} shape`);
            assertLessEqual(relErr(values(out), ref), BF16_TOL, `${what} relative error`);
        }
    }
});

test('the backends agree', () => {
    for (const path of FIXTURES) {
        const ck = Moe.Checkpoint.open(path);
        const outs = backends.map(b => values(makeExperts(ck, b).forward(...inputs(ck))));
        for (let i = 1; i < backends.length; i++) {
            assertLessEqual(relErr(outs[i], outs[0]), F32_TOL,
                `${basename(path)}: ${backends[i]} vs ${backends[0]}`);
        }
    }
});

test('a sentinel slot contributes nothing', () => {
    const ck = Moe.Checkpoint.open(GLib.build_filenamev([dataDir(), 'silu_concat.safetensors']));
    const {T, K, E} = meta(ck);
    const [hidden, index, weights] = inputs(ck);
    const ids = Array.from(typedView(index.dup_bytes(), BigInt64Array), Number);
    const w = Float32Array.from(values(weights));
    const wZeroed = Float32Array.from(w);
    const idsSentinel = ids.slice();
    for (let t = 0; t < T; t++) {
        for (let k = 1; k < K; k++) {
            wZeroed[t * K + k] = 0;
            idsSentinel[t * K + k] = E;
        }
    }
    const wT = Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, K], bytesOf(w));
    const wZeroedT = Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, K], bytesOf(wZeroed));
    for (const backend of backends) {
        const ex = makeExperts(ck, backend);
        const want = values(ex.forward(hidden, index, wZeroedT));
        const got = values(ex.forward(hidden, i64Tensor([T, K], idsSentinel), wT));
        assertLessEqual(relErr(got, want), F32_TOL, `${backend} sentinel`);
    }
});

test('an unknown backend is reported with the available ones', () => {
    const ck = Moe.Checkpoint.open(FIXTURES[0]);
    const ex = makeExperts(ck, 'no-such-backend');
    assertEqual(ex.implementation, 'no-such-backend', 'implementation');
    const e = assertMoeError(() => ex.forward(...inputs(ck)), Moe.Error.UNKNOWN_BACKEND, 'unknown backend');
    assert(e.message.includes('no-such-backend'), `message names the backend: ${e.message}`);
    for (const name of backends)
        assert(e.message.includes(name), `message lists ${name}: ${e.message}`);
});

test('wrong-shaped hidden_states', () => {
    const ck = Moe.Checkpoint.open(FIXTURES[0]);
    const {T, H} = meta(ck);
    const [, index, weights] = inputs(ck);
    for (const backend of backends) {
        const ex = makeExperts(ck, backend);
        for (const shape of [[T, H + 1], [T * H], [1, T, H]]) {
            const bad = Moe.Tensor.new_zeros(Moe.DType.F32, shape);
            assertMoeError(() => ex.forward(bad, index, weights), Moe.Error.SHAPE_MISMATCH,
                `${backend} hidden_states [${shape}]`);
        }
    }
});

test('out-of-range expert ids', () => {
    const ck = Moe.Checkpoint.open(FIXTURES[0]);
    const {T, K, E} = meta(ck);
    const [hidden, index, weights] = inputs(ck);
    const ids = Array.from(typedView(index.dup_bytes(), BigInt64Array), Number);
    for (const backend of backends) {
        const ex = makeExperts(ck, backend);
        for (const badId of [-1, E + 1]) {
            const bad = ids.slice();
            bad[bad.length >> 1] = badId;
            assertMoeError(() => ex.forward(hidden, i64Tensor([T, K], bad), weights),
                Moe.Error.INVALID_ARGUMENT, `${backend} expert id ${badId}`);
        }
    }
});

test('index dtype', () => {
    const ck = Moe.Checkpoint.open(FIXTURES[0]);
    const {T, K} = meta(ck);
    const [hidden, index, weights] = inputs(ck);
    const ids = Array.from(typedView(index.dup_bytes(), BigInt64Array), Number);
    const asF32 = Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, K], bytesOf(Float32Array.from(ids)));
    const asI32 = Moe.Tensor.new_from_bytes(Moe.DType.I32, [T, K], bytesOf(Int32Array.from(ids)));
    for (const backend of backends) {
        const ex = makeExperts(ck, backend);
        assertMoeError(() => ex.forward(hidden, asF32, weights), Moe.Error.DTYPE_MISMATCH,
            `${backend} F32 top_k_index`);
        // I32 ids are accepted and give the same result as I64
        const want = values(ex.forward(hidden, index, weights));
        const got = values(ex.forward(hidden, asI32, weights));
        assertEqual(relErr(got, want), 0, `${backend} I32 ids`);
    }
});

test('GPU-only backends on the CPU: NOT_SUPPORTED, naming what they need', () => {
    const ck = Moe.Checkpoint.open(FIXTURES[0]);
    for (const [name, needs] of [['deepgemm', 'compute capability 9.0 (Hopper) or 10.x (Blackwell)'],
        ['sonicmoe', 'compute capability 9.0 or newer']]) {
        assert(registry.list_backends().includes(name), `${name} is installed`);
        assert(!backends.includes(name), `${name} is not listed for the CPU`);
        const e = assertMoeError(() => makeExperts(ck, name).forward(...inputs(ck)),
            Moe.Error.NOT_SUPPORTED, name);
        assert(e.message.includes(needs) && e.message.includes('these experts are on cpu'),
            `${name}: the message names the GPU requirement: ${e.message}`);
    }
});

test('weights that do not match has-gate', () => {
    const ck = Moe.Checkpoint.open(FIXTURES[0]);
    const ex = makeExperts(ck, 'eager');
    ex.has_gate = !ex.has_gate;
    assertMoeError(() => ex.validate(), Moe.Error.SHAPE_MISMATCH, 'validate');
    assertMoeError(() => ex.forward(...inputs(ck)), Moe.Error.SHAPE_MISMATCH, 'forward');
});

test('an unknown activation', () => {
    const ck = Moe.Checkpoint.open(FIXTURES[0]);
    const ex = makeExperts(ck, 'eager');
    ex.activation = 'no-such-activation';
    assertMoeError(() => ex.forward(...inputs(ck)), Moe.Error.INVALID_ARGUMENT, 'activation');
});

test('to_device: a copy with the same properties and output', () => {
    const ck = Moe.Checkpoint.open(FIXTURES[0]);
    const ex = makeExperts(ck, 'batched_mm');
    const copy = ex.to_device('cpu');
    assertEqual(copy.device, 'cpu', 'device');
    assertEqual(copy.implementation, 'batched_mm', 'implementation');
    assertEqual(copy.activation, ex.activation, 'activation');
    assertLessEqual(relErrOf(values(copy.forward(...inputs(ck))), values(ex.forward(...inputs(ck))), 'copy'),
        0, 'the copy\'s output');
    assertMoeError(() => ex.to_device('no-such-device'), Moe.Error.NO_DEVICE, 'unknown device');
});

/* --- run ------------------------------------------------------------------- */

run();
