// SPDX-License-Identifier: LGPL-2.1-or-later
//
// Moe.Model.generate_async on a GLib.MainLoop, from GJS: tokens stream in
// through the token callback while the loop keeps serving a
// GLib.timeout_add; the result matches transformers' greedy generation
// (tests/data/models); a Gio.Cancellable stops a generation mid-way and
// leaves the model usable with its experts map restored; a model loads
// with new_from_pretrained_async.
//
// Every generate_async is started from inside the running loop, so the
// main context is owned while the worker delivers tokens and signals.
//
// Run as `gjs -m test-mainloop.js` from the build tree (meson sets
// GI_TYPELIB_PATH, MOE_PLUGIN_PATH, MOE_TEST_DATA). Any failed check makes
// it exit non-zero.

import GLib from 'gi://GLib';
import Gio from 'gi://Gio';
import Moe from 'gi://Moe?version=1';
import {test, run, assert, assertEqual, assertJsonEqual as assertDeepEqual,
    modelDir, typedView, ints, rows, i64Tensor, greedy} from './harness.js';

const FAMILY = 'mixtral';
const LOOP_TIMEOUT_S = 60;

/* --- helpers -------------------------------------------------------------- */

function reference(family, name) {
    return Moe.Checkpoint.open(GLib.build_filenamev([modelDir(family), 'reference.safetensors'])).get_tensor(name);
}

function relErr(got, ref) {
    let num = 0, den = 0;
    for (let i = 0; i < ref.length; i++) {
        num += (got[i] - ref[i]) ** 2;
        den += ref[i] ** 2;
    }
    return Math.sqrt(num / den);
}

function load(family, backend = 'grouped_mm') {
    const opts = new Moe.LoadOptions({dtype: 'float32', experts_implementation: backend});
    return Moe.Model.new_from_pretrained(modelDir(family), opts, null);
}

const PROMPT = rows(reference(FAMILY, 'input_ids'))[0];
const GENERATED = rows(reference(FAMILY, 'generated'))[0];

// Runs loop until it quits; throws if it took longer than LOOP_TIMEOUT_S.
function runLoop(loop) {
    let timedOut = false;
    const id = GLib.timeout_add_seconds(GLib.PRIORITY_DEFAULT, LOOP_TIMEOUT_S, () => {
        timedOut = true;
        loop.quit();
        return GLib.SOURCE_REMOVE;
    });
    loop.run();
    if (timedOut)
        throw new Error(`the main loop did not finish within ${LOOP_TIMEOUT_S} s`);
    GLib.source_remove(id);
}


// One generate_async on a fresh GLib.MainLoop, with a timeout ticking every
// tickMs. Returns what the callbacks saw, in the order they ran.
function generateOnLoop(model, ids, config, {tickMs = 2, cancellable = null, onTick = null} = {}) {
    const loop = new GLib.MainLoop(null, false);
    const run = {events: [], steps: [], shapes: [], ticks: 0, ticksAtFinish: -1, result: null, error: null, late: 0};
    let finished = false;
    const tickId = GLib.timeout_add(GLib.PRIORITY_DEFAULT, tickMs, () => {
        run.ticks++;
        run.events.push('tick');
        onTick?.(run);
        return GLib.SOURCE_CONTINUE;
    });
    GLib.idle_add(GLib.PRIORITY_DEFAULT, () => {
        model.generate_async(ids, null, config, (m, tokens) => {
            if (finished)
                run.late++;
            // recorded, checked afterwards: a throw here would only be logged
            run.shapes.push(JSON.stringify(tokens.get_shape()));
            run.steps.push(ints(tokens));
            run.events.push('token');
        }, cancellable, (m, res) => {
            finished = true;
            run.ticksAtFinish = run.ticks;
            try {
                run.result = m.generate_finish(res);
            } catch (e) {
                run.error = e;
            }
            loop.quit();
        });
        return GLib.SOURCE_REMOVE;
    });
    try {
        runLoop(loop);
    } finally {
        GLib.source_remove(tickId);
    }
    // anything still queued (there should be nothing)
    const ctx = GLib.MainContext.default();
    while (ctx.pending())
        ctx.iteration(false);
    const want = JSON.stringify([ids.get_dim(0)]);
    assert(run.shapes.every(s => s === want), `one token per sequence per step: ${run.shapes}`);
    return run;
}

function perSequence(steps) {
    return steps.length ? steps[0].map((_, i) => steps.map(s => s[i])) : [];
}

/* --- tests ----------------------------------------------------------------- */

test('tokens stream in order and the result is transformers\' generation', () => {
    const model = load(FAMILY);
    const phases = [];
    model.connect('phase-changed', (m, phase) => phases.push(phase));
    const run = generateOnLoop(model, i64Tensor([PROMPT]), greedy(12));
    assertEqual(run.error, null, 'no error');
    assertEqual(run.steps.length, 12, 'one callback per step');
    assertDeepEqual(perSequence(run.steps), [GENERATED.slice(PROMPT.length)], 'streamed tokens');
    assertDeepEqual(rows(run.result), [GENERATED], 'the result is the fixture\'s generated');
    assertEqual(run.late, 0, 'no token after the finish callback');
    assertDeepEqual(phases, [Moe.Phase.PREFILL, Moe.Phase.DECODE, Moe.Phase.IDLE], 'phases');
});

test('the main loop keeps running while a long generation streams', () => {
    // 8 copies of the prompt, 500 new tokens: long enough (about a second)
    // for the 2 ms timeout to fire many times before the result comes
    const model = load(FAMILY);
    const n = 500;
    const run = generateOnLoop(model, i64Tensor(Array(8).fill(PROMPT)), greedy(n), {tickMs: 2});
    assertEqual(run.error, null, 'no error');
    assertEqual(run.steps.length, n, 'one callback per step');
    print(`# ${n} steps of 8 sequences; the 2 ms timeout fired ${run.ticksAtFinish} times meanwhile`);
    assert(run.ticksAtFinish >= 5, `the timeout fired ${run.ticksAtFinish} times before the generation finished`);
    const first = run.events.indexOf('token'), last = run.events.lastIndexOf('token');
    const between = run.events.slice(first, last).filter(e => e === 'tick').length;
    assert(between >= 3, `the timeout fired ${between} times between the first and the last token`);
    const seqs = perSequence(run.steps);
    assertDeepEqual(seqs[0].slice(0, 12), GENERATED.slice(PROMPT.length), 'the first 12 tokens');
    for (const s of seqs)
        assertDeepEqual(s, seqs[0], 'every copy of the prompt continues alike');
    assertDeepEqual(rows(run.result), Array(8).fill([...PROMPT, ...seqs[0]]), 'result = prompt + streamed tokens');
    assertDeepEqual(rows(run.result)[0].slice(0, GENERATED.length), GENERATED, 'result starts with the fixture\'s generated');
});

test('cancelling mid-way from a timeout', () => {
    const model = load(FAMILY);
    model.decode_switch = Moe.DecodeSwitch.ALWAYS;
    const changes = [];
    model.connect('experts-implementation-changed', (m, key, o, n) => changes.push([key, o, n]));
    const cancellable = new Gio.Cancellable();
    const n = 500;
    let cancelledAfter = -1;
    const run = generateOnLoop(model, i64Tensor(Array(8).fill(PROMPT)), greedy(n), {
        cancellable,
        onTick: r => {
            if (r.steps.length >= 3 && cancelledAfter < 0) {
                cancelledAfter = r.steps.length;
                cancellable.cancel();
            }
        },
    });
    assert(run.error !== null, 'generate_finish threw');
    assert(run.error instanceof GLib.Error, `a GLib.Error: ${run.error}`);
    assert(run.error.matches(Gio.IOErrorEnum, Gio.IOErrorEnum.CANCELLED),
        `G_IO_ERROR_CANCELLED, not ${run.error.domain}/${run.error.code}: ${run.error.message}`);
    assertEqual(run.result, null, 'no result');
    assert(cancelledAfter >= 3, 'cancelled after some tokens');
    print(`# cancelled after ${cancelledAfter} steps; ${run.steps.length} of ${n} ran`);
    assert(run.steps.length < n, `stopped mid-way (${run.steps.length} of ${n} steps)`);
    assertDeepEqual(perSequence(run.steps)[0].slice(0, 3), GENERATED.slice(PROMPT.length, PROMPT.length + 3),
        'the tokens before the cancel');
    assertDeepEqual(model.get_experts_implementation(), {'': 'grouped_mm'}, 'experts map restored');
    assertDeepEqual(changes, [['', 'grouped_mm', 'batched_mm'], ['', 'batched_mm', 'grouped_mm']], 'switch and restore');
    assertEqual(model.phase, Moe.Phase.IDLE, 'idle');
    // still usable
    const again = generateOnLoop(model, i64Tensor([PROMPT]), greedy(12));
    assertEqual(again.error, null, 'the next generation has no error');
    assertDeepEqual(rows(again.result), [GENERATED], 'the next generation');
    assertDeepEqual(rows(model.generate(i64Tensor([PROMPT]), greedy(12), null)), [GENERATED], 'a synchronous one');
});

test('new_from_pretrained_async on the main loop', () => {
    const loop = new GLib.MainLoop(null, false);
    let model = null, error = null, ticks = 0;
    const tickId = GLib.timeout_add(GLib.PRIORITY_DEFAULT, 1, () => {
        ticks++;
        return GLib.SOURCE_CONTINUE;
    });
    GLib.idle_add(GLib.PRIORITY_DEFAULT, () => {
        const opts = new Moe.LoadOptions({dtype: 'float32', experts_implementation: 'batched_mm'});
        Moe.Model.new_from_pretrained_async(modelDir('olmoe'), opts, null, (source, res) => {
            try {
                model = Moe.Model.new_from_pretrained_finish(res);
            } catch (e) {
                error = e;
            }
            loop.quit();
        });
        return GLib.SOURCE_REMOVE;
    });
    runLoop(loop);
    GLib.source_remove(tickId);
    assertEqual(error, null, 'no error');
    assert(model instanceof Moe.Model, 'a Moe.Model');
    assertDeepEqual(model.get_experts_implementation(), {'': 'batched_mm'}, 'map');
    const err = relErr(typedView(model.forward(reference('olmoe', 'input_ids')).to_f32_bytes(), Float32Array),
        typedView(reference('olmoe', 'logits').to_f32_bytes(), Float32Array));
    assert(err <= 1e-4, `logits rel err ${err}`);
    const run = generateOnLoop(model, i64Tensor([rows(reference('olmoe', 'input_ids'))[0]]), greedy(12));
    assertDeepEqual(rows(run.result), rows(reference('olmoe', 'generated')), 'generation');
});

/* --- run ------------------------------------------------------------------- */

run();
