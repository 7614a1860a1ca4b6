// SPDX-License-Identifier: LGPL-2.1-or-later
//
// The small test harness and helpers the GJS tests share: test() to
// register a test, run() to run them all as TAP (exiting non-zero if any
// failed), assertions, and helpers for test data and tensors.

import GLib from 'gi://GLib';
import Moe from 'gi://Moe?version=1';
import System from 'system';

/* --- a small test harness ------------------------------------------------ */

const tests = [];
export function test(name, fn) {
    tests.push([name, fn]);
}

export function assert(cond, msg) {
    if (!cond)
        throw new Error(`assertion failed: ${msg}`);
}

export function assertEqual(got, want, msg) {
    if (got !== want)
        throw new Error(`${msg}: got ${got}, want ${want}`);
}

export function assertArrayEqual(got, want, msg) {
    assertEqual(JSON.stringify(Array.from(got)), JSON.stringify(Array.from(want)), msg);
}

// Equality through JSON as is (object keys in the order they come).
export function assertJsonEqual(got, want, msg) {
    const g = JSON.stringify(got), w = JSON.stringify(want);
    if (g !== w)
        throw new Error(`${msg}: got ${g}, want ${w}`);
}

// Deep equality through JSON, object keys sorted (hash tables come back in
// no particular order).
export function canonical(v) {
    if (Array.isArray(v) || ArrayBuffer.isView(v))
        return Array.from(v, canonical);
    if (v !== null && typeof v === 'object')
        return Object.fromEntries(Object.keys(v).sort().map(k => [k, canonical(v[k])]));
    return v;
}

export function assertDeepEqual(got, want, msg) {
    const g = JSON.stringify(canonical(got)), w = JSON.stringify(canonical(want));
    if (g !== w)
        throw new Error(`${msg}: got ${g}, want ${w}`);
}

export function assertLessEqual(got, bound, msg) {
    if (!(got <= bound))
        throw new Error(`${msg}: ${got} is not <= ${bound}`);
}

// Runs fn, which must throw a GLib.Error in the Moe.Error domain with code.
export function assertMoeError(fn, code, msg) {
    try {
        fn();
    } catch (e) {
        if (!(e instanceof GLib.Error))
            throw new Error(`${msg}: expected a GLib.Error, got ${e}`);
        if (!e.matches(Moe.Error, code))
            throw new Error(`${msg}: expected Moe.Error code ${code}, got domain ${e.domain} code ${e.code}: ${e.message}`);
        return e;
    }
    throw new Error(`${msg}: no error was thrown`);
}

// Runs every test registered with test(), printing TAP; exits non-zero if
// any failed.
export function run() {
    let failed = 0;
    print(`1..${tests.length}`);
    tests.forEach(([name, fn], i) => {
        try {
            fn();
            print(`ok ${i + 1} - ${name}`);
        } catch (e) {
            failed++;
            print(`not ok ${i + 1} - ${name}`);
            for (const line of `${e}\n${e.stack ?? ''}`.split('\n'))
                print(`# ${line}`);
        }
    });
    if (failed > 0) {
        printerr(`${failed} of ${tests.length} tests failed`);
        System.exit(1);
    }
}

/* --- helpers -------------------------------------------------------------- */

// A path under the test data: $MOE_TEST_DATA, or tests/data next to this
// file, joined with parts.
export function testData(...parts) {
    let dir = GLib.getenv('MOE_TEST_DATA');
    if (!dir) {
        const here = GLib.path_get_dirname(GLib.filename_from_uri(import.meta.url)[0]);
        dir = GLib.build_filenamev([here, '..', 'data']);
    }
    return GLib.build_filenamev([dir, ...parts]);
}

// The directory of one model fixture in tests/data/models.
export function modelDir(family) {
    return testData('models', family);
}

// A typed array over a GLib.Bytes' data, copied if it is not aligned.
export function typedView(bytes, Type) {
    let u8 = bytes.get_data();
    if (u8.byteOffset % Type.BYTES_PER_ELEMENT !== 0)
        u8 = u8.slice();
    return new Type(u8.buffer, u8.byteOffset, u8.length / Type.BYTES_PER_ELEMENT);
}

export function bytesOf(typedArray) {
    return new GLib.Bytes(new Uint8Array(typedArray.buffer, typedArray.byteOffset, typedArray.byteLength));
}

// An I64 tensor's elements as numbers.
export function ints(tensor) {
    assertEqual(tensor.get_dtype(), Moe.DType.I64, 'token ids are I64');
    return Array.from(typedView(tensor.dup_bytes(), BigInt64Array), Number);
}

// A [B, L] I64 tensor as B arrays of numbers.
export function rows(tensor) {
    const flat = ints(tensor);
    const [B, L] = tensor.get_shape();
    return Array.from({length: B}, (_, i) => flat.slice(i * L, (i + 1) * L));
}

// B arrays of L numbers as a [B, L] I64 tensor.
export function i64Tensor(rows_) {
    const flat = BigInt64Array.from(rows_.flat(), x => BigInt(x));
    return Moe.Tensor.new_from_bytes(Moe.DType.I64, [rows_.length, rows_[0].length],
        new GLib.Bytes(new Uint8Array(flat.buffer)));
}

// ||got - ref|| / ||ref||, checking the lengths match and ref is not all zeros.
export function relErr(got, ref, what = 'reference') {
    assertEqual(got.length, ref.length, 'element count');
    let num = 0, den = 0;
    for (let i = 0; i < ref.length; i++) {
        const d = got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    assert(den > 0, `${what} is not all zeros`);
    return Math.sqrt(num / den);
}

export function greedy(n) {
    return new Moe.GenerationConfig({max_new_tokens: n, do_sample: false});
}
