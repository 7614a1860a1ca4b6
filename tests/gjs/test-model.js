// SPDX-License-Identifier: LGPL-2.1-or-later
//
// Moe.Model through GJS: checkpoints from tests/data/models (random
// weights; transformers 5.17 wrote their logits and greedy generations, the
// oracle) loaded, run forward with every experts backend and compared with
// transformers' logits; backends listed and switched, per sub-config for
// qwen3_vl_moe; the experts-implementation-changed (plain and detailed) and
// phase-changed signals; the decode switch.
//
// Run as `gjs -m test-model.js` from the build tree (meson sets
// GI_TYPELIB_PATH, MOE_PLUGIN_PATH, MOE_TEST_DATA). Any failed check makes
// it exit non-zero.

import GLib from 'gi://GLib';
import Moe from 'gi://Moe?version=1';
import {test, run, assert, assertEqual, assertDeepEqual, assertLessEqual, assertMoeError,
    modelDir, typedView, rows, i64Tensor, relErr, greedy} from './harness.js';

const FAMILIES = ['deepseek_v3', 'gpt_oss', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe', 'qwen3_vl_moe'];
const BACKENDS = ['eager', 'batched_mm', 'grouped_mm'];
const F32_TOL = 1e-4;
// the map qwen3_vl_moe's reference.json recorded get_experts_implementation() for
const VL_MAP = {'': 'grouped_mm', 'text_config': 'grouped_mm', 'vision_config': 'eager'};

/* --- helpers -------------------------------------------------------------- */

const refs = new Map();
function reference(family, name, file = 'reference.safetensors') {
    const key = `${family}/${file}`;
    if (!refs.has(key))
        refs.set(key, Moe.Checkpoint.open(GLib.build_filenamev([modelDir(family), file])));
    return refs.get(key).get_tensor(name);
}

function referenceJson(family) {
    const [, bytes] = GLib.file_get_contents(GLib.build_filenamev([modelDir(family), 'reference.json']));
    return JSON.parse(new TextDecoder().decode(bytes));
}

function floats(tensor) {
    return typedView(tensor.to_f32_bytes(), Float32Array);
}

function prompt(family) {
    return i64Tensor(rows(reference(family, 'input_ids')).slice(0, 1));
}

function expected(family) {
    return rows(reference(family, 'generated'))[0];
}

function load(family, backend = null, map = null) {
    const opts = new Moe.LoadOptions({dtype: 'float32', device: 'cpu'});
    if (backend !== null)
        opts.experts_implementation = backend;
    if (map !== null)
        opts.set_experts_implementation_map(map);
    return Moe.Model.new_from_pretrained(modelDir(family), opts, null);
}

function values(obj) {
    return [...new Set(Object.values(obj))].sort();
}

const backends = Moe.PluginRegistry.get_default().list_backends();

/* --- tests ----------------------------------------------------------------- */

test('the registry lists the three backends', () => {
    for (const name of BACKENDS)
        assert(backends.includes(name), `${name} in [${backends}]`);
});

test('fp32 logits match transformers with every backend', () => {
    for (const family of FAMILIES) {
        const ids = reference(family, 'input_ids');
        const ref = floats(reference(family, 'logits'));
        for (const backend of BACKENDS) {
            const what = `${family} ${backend}`;
            const model = load(family, backend);
            assertEqual(model.dtype, 'float32', `${what} dtype`);
            assertEqual(model.device, 'cpu', `${what} device`);
            assertEqual(model.experts_implementation, backend, `${what} experts-implementation`);
            assertDeepEqual(values(model.get_experts_implementation()), [backend], `${what} map`);
            const logits = model.forward(ids);
            assertEqual(logits.get_dtype(), Moe.DType.F32, `${what} logits dtype`);
            assertDeepEqual(logits.get_shape(), [2, 9, 320], `${what} logits shape`);
            assertLessEqual(relErr(floats(logits), ref), F32_TOL, `${what} relative error`);
        }
    }
});

test('switching backends on a loaded model', () => {
    for (const family of ['mixtral', 'gpt_oss']) {
        const model = load(family);
        assertEqual(model.experts_implementation, 'grouped_mm', `${family} default backend`);
        const ids = reference(family, 'input_ids');
        const ref = floats(reference(family, 'logits'));
        for (const backend of [...backends].filter(b => BACKENDS.includes(b)).reverse()) {
            model.set_experts_implementation(backend);
            assertDeepEqual(model.get_experts_implementation(), {'': backend}, `${family} map`);
            assertEqual(model.dup_experts_implementation_for(''), backend, `${family} "" entry`);
            assertLessEqual(relErr(floats(model.forward(ids)), ref), F32_TOL, `${family} ${backend}`);
        }
        // through the property too
        model.experts_implementation = 'eager';
        assertDeepEqual(model.get_experts_implementation(), {'': 'eager'}, `${family} map via property`);
        assertLessEqual(relErr(floats(model.forward(ids)), ref), F32_TOL, `${family} eager via property`);
    }
});

test('greedy generation matches transformers token for token', () => {
    for (const family of FAMILIES) {
        const model = load(family);
        const out = model.generate(prompt(family), greedy(12), null);
        assertDeepEqual(out.get_shape(), [1, 21], `${family} shape`);
        assertDeepEqual(rows(out)[0], expected(family), `${family} tokens`);
    }
});

test('qwen3_vl_moe: a backend per sub-config', () => {
    const want = referenceJson('qwen3_vl_moe').get_experts_implementation_after_set;
    assertDeepEqual(want, VL_MAP, 'reference.json records the map set');
    const model = load('qwen3_vl_moe', 'grouped_mm', VL_MAP);
    assertDeepEqual(model.get_experts_implementation(), want, 'map after load');
    assertEqual(model.dup_experts_implementation_for('vision_config'), 'eager', 'vision_config');
    assertEqual(model.dup_experts_implementation_for('audio_config'), null, 'a key the model lacks');
    const ids = reference('qwen3_vl_moe', 'input_ids');
    const ref = floats(reference('qwen3_vl_moe', 'logits'));
    assertLessEqual(relErr(floats(model.forward(ids)), ref), F32_TOL, 'logits');

    const other = load('qwen3_vl_moe', 'eager');
    assertDeepEqual(other.get_experts_implementation(),
        {'': 'eager', 'text_config': 'eager', 'vision_config': 'eager'}, 'one name for every key');
    other.set_experts_implementation_map({...VL_MAP, 'audio_config': 'batched_mm'});
    assertDeepEqual(other.get_experts_implementation(), want, 'map set after load, unknown keys ignored');
    for (const backend of BACKENDS) {
        other.set_experts_implementation_for('text_config', backend);
        assertLessEqual(relErr(floats(other.forward(ids)), ref), F32_TOL, `text_config ${backend}`);
    }
});

test('an unknown backend is an error that lists the valid names', () => {
    const model = load('qwen3_vl_moe', null, VL_MAP);
    let emitted = 0;
    model.connect('experts-implementation-changed', () => emitted++);
    const e = assertMoeError(() => model.set_experts_implementation('no-such-backend'),
        Moe.Error.UNKNOWN_BACKEND, 'set_experts_implementation');
    assert(e.message.includes('no-such-backend'), `message names the backend: ${e.message}`);
    for (const name of new Set([...BACKENDS, ...backends]))
        assert(e.message.includes(name), `message lists ${name}: ${e.message}`);
    assertMoeError(() => model.set_experts_implementation_map({'text_config': 'eager', 'vision_config': 'nope'}),
        Moe.Error.UNKNOWN_BACKEND, 'a map with one bad entry');
    assertMoeError(() => model.set_experts_implementation_for('audio_config', 'eager'),
        Moe.Error.NOT_FOUND, 'a key the model lacks');
    assertDeepEqual(model.get_experts_implementation(), VL_MAP, 'nothing changed');
    assertEqual(emitted, 0, 'no signal');
    assertMoeError(() => load('mixtral', 'no-such-backend'), Moe.Error.UNKNOWN_BACKEND, 'at load time');
});

test('experts-implementation-changed, plain and detailed', () => {
    const model = load('qwen3_vl_moe', 'grouped_mm');
    const every = [], text = [], notified = [];
    model.connect('experts-implementation-changed', (m, key, oldName, newName) => every.push([key, oldName, newName]));
    model.connect('experts-implementation-changed::text_config',
        (m, key, oldName, newName) => text.push([key, oldName, newName]));
    model.connect('notify::experts-implementation', m => notified.push(m.experts_implementation));
    const drain = () => {
        const got = [every.splice(0).sort(), text.splice(0), notified.splice(0)];
        return got;
    };

    model.set_experts_implementation_map({'vision_config': 'eager'});
    assertDeepEqual(drain(), [[['vision_config', 'grouped_mm', 'eager']], [], []], 'vision_config only');

    model.set_experts_implementation('batched_mm');
    assertDeepEqual(drain(), [
        [['', 'grouped_mm', 'batched_mm'], ['text_config', 'grouped_mm', 'batched_mm'],
            ['vision_config', 'eager', 'batched_mm']],
        [['text_config', 'grouped_mm', 'batched_mm']],
        ['batched_mm'],
    ], 'every key');

    model.set_experts_implementation('batched_mm');
    assertDeepEqual(drain(), [[], [], []], 'no change, no signal');

    model.set_experts_implementation_for('text_config', 'eager');
    assertDeepEqual(drain(), [[['text_config', 'batched_mm', 'eager']], [['text_config', 'batched_mm', 'eager']], []],
        'text_config only');

    model.experts_implementation = 'grouped_mm';
    assertDeepEqual(drain(), [[['', 'batched_mm', 'grouped_mm']], [], ['grouped_mm']], 'the property');
});

test('phase-changed and the decode switch', () => {
    const P = Moe.Phase;
    const watch = (model, family) => {
        const seen = [], changes = [];
        const h1 = model.connect('phase-changed', (m, phase) => seen.push([phase, m.get_experts_implementation()]));
        const h2 = model.connect('experts-implementation-changed', (m, key, o, n) => changes.push([key, o, n]));
        const out = rows(model.generate(prompt(family), greedy(12), null))[0];
        model.disconnect(h1);
        model.disconnect(h2);
        assertDeepEqual(out, expected(family), `${family} tokens`);
        return [seen, changes];
    };

    // on the CPU, AUTO does not switch; ALWAYS does, for grouped_mm entries only
    const model = load('qwen3_vl_moe', null, VL_MAP);
    assertEqual(model.decode_switch, Moe.DecodeSwitch.AUTO, 'default policy');
    let [seen, changes] = watch(model, 'qwen3_vl_moe');
    assertDeepEqual(seen, [[P.PREFILL, VL_MAP], [P.DECODE, VL_MAP], [P.IDLE, VL_MAP]], 'AUTO on the CPU');
    assertDeepEqual(changes, [], 'AUTO: no change');

    model.decode_switch = Moe.DecodeSwitch.ALWAYS;
    assertEqual(model.decode_switch, Moe.DecodeSwitch.ALWAYS, 'policy set');
    [seen, changes] = watch(model, 'qwen3_vl_moe');
    const decodeMap = {'': 'batched_mm', 'text_config': 'batched_mm', 'vision_config': 'eager'};
    assertDeepEqual(seen, [[P.PREFILL, VL_MAP], [P.DECODE, decodeMap], [P.IDLE, VL_MAP]], 'ALWAYS');
    assertDeepEqual(changes.slice(0, 2).sort(), [['', 'grouped_mm', 'batched_mm'], ['text_config', 'grouped_mm', 'batched_mm']],
        'switched at decode');
    assertDeepEqual(changes.slice(2).sort(), [['', 'batched_mm', 'grouped_mm'], ['text_config', 'batched_mm', 'grouped_mm']],
        'restored at the end');
    assertDeepEqual(model.get_experts_implementation(), VL_MAP, 'map restored');

    model.decode_switch = Moe.DecodeSwitch.NEVER;
    [seen, changes] = watch(model, 'qwen3_vl_moe');
    assertDeepEqual(seen, [[P.PREFILL, VL_MAP], [P.DECODE, VL_MAP], [P.IDLE, VL_MAP]], 'NEVER');
    assertDeepEqual(changes, [], 'NEVER: no change');
    assertEqual(model.phase, P.IDLE, 'idle after generating');
});

/* --- run ------------------------------------------------------------------- */

run();
