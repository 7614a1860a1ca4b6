// SPDX-License-Identifier: LGPL-2.1-or-later
//
// Moe.Tensor, Moe.Checkpoint and Moe.PluginRegistry through GJS: building
// tensors from bytes, reading them back, dtype conversion, and the errors
// for bad shapes, sizes and names.
//
// Run as `gjs -m test-tensor.js`; any failed check makes it exit non-zero.

import GLib from 'gi://GLib';
import Moe from 'gi://Moe?version=1';
import System from 'system';
import {test, run, assert, assertEqual, assertArrayEqual, assertMoeError,
    testData, typedView, bytesOf} from './harness.js';

/* --- helpers -------------------------------------------------------------- */

function fixture(name) {
    return testData('experts', name);
}

/* --- tests ----------------------------------------------------------------- */

test('new_from_bytes round trip', () => {
    const vals = Float32Array.from([0.5, -1.25, 3.0, 1e-3, -7.75, 42.0]);
    const t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [2, 3], bytesOf(vals));
    assertEqual(t.get_dtype(), Moe.DType.F32, 'dtype');
    assertArrayEqual(t.get_shape(), [2, 3], 'shape');
    assertEqual(t.get_n_dims(), 2, 'n_dims');
    assertEqual(t.get_dim(0), 2, 'dim 0');
    assertEqual(t.get_dim(1), 3, 'dim 1');
    assertEqual(t.get_n_elements(), 6, 'n_elements');
    assertEqual(t.get_n_bytes(), 24, 'n_bytes');
    assert(t.has_shape([2, 3]), 'has_shape [2, 3]');
    assert(!t.has_shape([3, 2]), 'not has_shape [3, 2]');
    assertArrayEqual(typedView(t.to_f32_bytes(), Float32Array), vals, 'to_f32_bytes');
    assertArrayEqual(typedView(t.dup_bytes(), Float32Array), vals, 'dup_bytes');
});

test('the tensor owns a copy of its bytes', () => {
    const vals = Float32Array.from([1, 2, 3, 4]);
    const t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [4], bytesOf(vals));
    vals.fill(0);
    System.gc();
    assertArrayEqual(typedView(t.to_f32_bytes(), Float32Array), [1, 2, 3, 4], 'data');
});

test('scalars and empty tensors', () => {
    const s = Moe.Tensor.new_from_bytes(Moe.DType.F32, [], bytesOf(Float32Array.from([2.5])));
    assertArrayEqual(s.get_shape(), [], 'scalar shape');
    assertEqual(s.get_n_elements(), 1, 'scalar n_elements');
    assertArrayEqual(typedView(s.to_f32_bytes(), Float32Array), [2.5], 'scalar value');
    const e = Moe.Tensor.new_from_bytes(Moe.DType.F32, [0, 4], new GLib.Bytes(new Uint8Array(0)));
    assertEqual(e.get_n_elements(), 0, 'empty n_elements');
    assertArrayEqual(e.get_shape(), [0, 4], 'empty shape');
});

test('integer tensors', () => {
    const ids = BigInt64Array.from([0n, 7n, -1n, 2n ** 40n]);
    const t = Moe.Tensor.new_from_bytes(Moe.DType.I64, [4], bytesOf(ids));
    assertEqual(t.get_dtype(), Moe.DType.I64, 'dtype');
    assertEqual(t.get_n_bytes(), 32, 'n_bytes');
    assertEqual(JSON.stringify(Array.from(typedView(t.dup_bytes(), BigInt64Array), String)),
        JSON.stringify(Array.from(ids, String)), 'values');
    assertMoeError(() => t.to_f32_bytes(), Moe.Error.DTYPE_MISMATCH, 'I64 to F32');
});

test('zeros', () => {
    const t = Moe.Tensor.new_zeros(Moe.DType.BF16, [4, 5]);
    assertEqual(t.get_dtype(), Moe.DType.BF16, 'dtype');
    assertEqual(t.get_n_bytes(), 40, 'n_bytes');
    assertArrayEqual(typedView(t.to_f32_bytes(), Float32Array), new Array(20).fill(0), 'values');
});

test('to_dtype', () => {
    // exactly representable in bf16 and f16, so the round trip is exact
    const vals = Float32Array.from([1.5, -2.0, 0.25, 96.0, -0.375, 0.0]);
    const t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [6], bytesOf(vals));
    for (const [dtype, size] of [[Moe.DType.BF16, 2], [Moe.DType.F16, 2], [Moe.DType.F64, 8]]) {
        const c = t.to_dtype(dtype);
        assertEqual(c.get_dtype(), dtype, 'dtype');
        assertArrayEqual(c.get_shape(), [6], 'shape');
        assertEqual(c.get_n_bytes(), 6 * size, 'n_bytes');
        assertEqual(Moe.dtype_get_size(dtype), size, 'dtype size');
        assertArrayEqual(typedView(c.to_f32_bytes(), Float32Array), vals, `round trip via ${dtype}`);
    }
    // bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1
    const r = Moe.Tensor.new_from_bytes(Moe.DType.F32, [1], bytesOf(Float32Array.from([1 + 2 ** -9])));
    assertArrayEqual(typedView(r.to_dtype(Moe.DType.BF16).to_f32_bytes(), Float32Array), [1], 'bf16 rounding');
});

test('size mismatch', () => {
    for (const n of [20, 28, 0]) {
        const e = assertMoeError(
            () => Moe.Tensor.new_from_bytes(Moe.DType.F32, [2, 3], new GLib.Bytes(new Uint8Array(n))),
            Moe.Error.SHAPE_MISMATCH, `${n} bytes for [2, 3] F32`);
        assert(e.message.includes('24'), `message gives the needed size: ${e.message}`);
    }
});

test('negative dimension', () => {
    assertMoeError(() => Moe.Tensor.new_zeros(Moe.DType.F32, [2, -3]), Moe.Error.SHAPE_MISMATCH, 'zeros [2, -3]');
});

test('reshape', () => {
    const vals = Float32Array.from([0, 1, 2, 3, 4, 5]);
    const t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [2, 3], bytesOf(vals));
    const r = t.reshape([3, 2]);
    assertArrayEqual(r.get_shape(), [3, 2], 'shape');
    assertArrayEqual(typedView(r.to_f32_bytes(), Float32Array), vals, 'values');
    assertMoeError(() => t.reshape([4, 2]), Moe.Error.SHAPE_MISMATCH, 'reshape to 8 elements');
});

test('checkpoint open and read', () => {
    const path = fixture('silu_concat.safetensors');
    const ck = Moe.Checkpoint.open(path);
    assertEqual(ck.get_path(), path, 'path');
    const names = ck.list_tensors();
    for (const name of ['hidden_states', 'top_k_index', 'top_k_weights', 'up_weight', 'down_weight', 'output_f64']) {
        assert(names.includes(name), `${name} listed`);
        assert(ck.has_tensor(name), `has ${name}`);
    }
    assert(!ck.has_tensor('nope'), 'no tensor "nope"');
    const md = ck.get_metadata();
    assertEqual(ck.get_metadata_value('act'), md.act, 'get_metadata_value');
    assertEqual(ck.get_metadata_value('no-such-key'), null, 'missing metadata key');
    const T = parseInt(md.T), H = parseInt(md.H);
    const [ok, dtype, shape] = ck.get_tensor_info('hidden_states');
    assert(ok, 'get_tensor_info');
    assertEqual(dtype, Moe.DType.F32, 'info dtype');
    assertArrayEqual(shape, [T, H], 'info shape');
    assertArrayEqual(ck.get_tensor('hidden_states').get_shape(), [T, H], 'tensor shape');
    assertEqual(ck.get_tensor('top_k_index').get_dtype(), Moe.DType.I64, 'index dtype');
    assertEqual(ck.get_tensor('output_f64').get_dtype(), Moe.DType.F64, 'reference dtype');
});

test('checkpoint errors', () => {
    assertMoeError(() => Moe.Checkpoint.open(fixture('no-such-file.safetensors')), Moe.Error.NOT_FOUND, 'missing file');
    const ck = Moe.Checkpoint.open(fixture('silu_concat.safetensors'));
    assertMoeError(() => ck.get_tensor('no-such-tensor'), Moe.Error.NOT_FOUND, 'missing tensor');
});

test('registry backends', () => {
    const reg = Moe.PluginRegistry.get_default();
    assert(reg === Moe.PluginRegistry.get_default(), 'get_default is a singleton');
    const names = reg.list_backends();
    assertArrayEqual(names, [...names].sort(), 'sorted');
    for (const name of ['batched_mm', 'eager', 'grouped_mm']) {
        assert(names.includes(name), `${name} listed`);
        assert(reg.get_backend(name) !== null, `get_backend ${name}`);
    }
    const e = assertMoeError(() => reg.get_backend('no-such-backend'), Moe.Error.UNKNOWN_BACKEND, 'unknown backend');
    for (const name of names)
        assert(e.message.includes(name), `message lists ${name}`);
});

/* --- run ------------------------------------------------------------------- */

run();
