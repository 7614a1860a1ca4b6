#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
#
# Moe.Model through PyGObject: every family in tests/data/models (checkpoints
# with random weights; transformers 5.17 wrote their logits and greedy
# generations, the oracle) run with every experts backend, plus backend
# selection per sub-config, the experts-implementation-changed and
# phase-changed signals, the decode switch, and generate_async on a
# GLib.MainLoop with streaming, cancellation and errors.
#
# Runs from the build tree (meson sets GI_TYPELIB_PATH, MOE_PLUGIN_PATH,
# MOE_TEST_DATA); exits non-zero on any failure.

import array
import json
import math
import os
import struct
import threading
import time
import unittest

import gi

gi.require_version('Moe', '1')
from gi.repository import Gio, GLib, Moe  # noqa: E402

FAMILIES = ('deepseek_v3', 'gpt_oss', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe', 'qwen3_vl_moe')
BACKENDS = ('eager', 'batched_mm', 'grouped_mm')
F32_TOL = 1e-4
BF16_TOL = 2e-2
LOOP_TIMEOUT_S = 60

# the map qwen3_vl_moe's reference.json recorded get_experts_implementation() for
VL_MAP = {'': 'grouped_mm', 'text_config': 'grouped_mm', 'vision_config': 'eager'}


def data_dir():
    d = os.environ.get('MOE_TEST_DATA')
    if not d:
        d = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data')
    return os.path.join(d, 'models')


def model_dir(family):
    return os.path.join(data_dir(), family)


_refs = {}


def reference(family, name, file='reference.safetensors'):
    key = (family, file)
    if key not in _refs:
        _refs[key] = Moe.Checkpoint.open(os.path.join(model_dir(family), file))
    return _refs[key].get_tensor(name)


def reference_json(family):
    with open(os.path.join(model_dir(family), 'reference.json')) as f:
        return json.load(f)


def floats(tensor):
    return array.array('f', tensor.to_f32_bytes().get_data())


def ints(tensor):
    """An I64 tensor's elements as a flat list of Python ints."""
    assert tensor.get_dtype() == Moe.DType.I64, Moe.dtype_get_name(tensor.get_dtype())
    data = tensor.dup_bytes().get_data()
    return list(struct.unpack('<%dq' % (len(data) // 8), data))


def rows(tensor):
    """A [B, L] I64 tensor as a list of B lists."""
    B, L = tensor.get_shape()
    flat = ints(tensor)
    return [flat[i * L:(i + 1) * L] for i in range(B)]


def i64_tensor(rows_):
    flat = [x for r in rows_ for x in r]
    return Moe.Tensor.new_from_bytes(Moe.DType.I64, [len(rows_), len(rows_[0])],
                                     GLib.Bytes(struct.pack('<%dq' % len(flat), *flat)))


def rel_err(got, ref):
    """||got - ref|| / ||ref||."""
    assert len(got) == len(ref), (len(got), len(ref))
    num = math.fsum((g - r) ** 2 for g, r in zip(got, ref))
    den = math.fsum(r * r for r in ref)
    assert den > 0, 'reference is all zeros'
    return math.sqrt(num / den)


def prompt(family):
    """input_ids[0] as a [1, T] tensor: the prompt `generated` continues."""
    return i64_tensor(rows(reference(family, 'input_ids'))[:1])


def expected(family):
    """The fixture's greedy generation: input_ids[0] and 12 new tokens."""
    return rows(reference(family, 'generated'))[0]


def greedy(n):
    return Moe.GenerationConfig(max_new_tokens=n, do_sample=False)


def load(family, backend=None, impl_map=None, dtype='float32'):
    opts = Moe.LoadOptions(dtype=dtype, device='cpu')
    if backend is not None:
        opts.props.experts_implementation = backend
    if impl_map is not None:
        opts.set_experts_implementation_map(impl_map)
    return Moe.Model.new_from_pretrained(model_dir(family), opts, None)


def run_loop(loop, timeout_s=LOOP_TIMEOUT_S):
    """Runs loop until it quits; False if timeout_s passed first."""
    timed_out = []

    def on_timeout():
        timed_out.append(True)
        loop.quit()
        return GLib.SOURCE_REMOVE

    source = GLib.timeout_add_seconds(timeout_s, on_timeout)
    loop.run()
    if not timed_out:
        GLib.source_remove(source)
    return not timed_out


class AsyncRun:
    """One generate_async on its own GLib.MainLoop. The call is made from
    inside the running loop, so the main context is owned while the worker
    delivers tokens and signals. What the callbacks see is recorded and
    checked afterwards (an exception raised in a callback would only be
    printed, not fail the test)."""

    def __init__(self, model, input_ids, config, cancellable=None, on_token=None, tick_ms=0,
                 attention_mask=None):
        self.model = model
        self.steps = []           # one entry per token callback: the [B] tokens
        self.shapes = []
        self.threads = set()
        self.late = 0             # token callbacks after the finish callback
        self.finished_at = None
        self.result = None
        self.error = None
        self.ticks = 0
        self.ticks_at_finish = None
        self.user_data = []
        main = threading.get_ident()
        loop = GLib.MainLoop()

        def token(m, tokens, *data):
            self.threads.add(threading.get_ident() == main and m is model)
            if self.finished_at is not None:
                self.late += 1
            self.shapes.append(list(tokens.get_shape()))
            self.steps.append(ints(tokens))
            if on_token is not None:
                on_token(len(self.steps))

        def done(m, result, *data):
            self.finished_at = time.perf_counter()
            self.ticks_at_finish = self.ticks
            self.user_data = list(data)
            try:
                self.result = m.generate_finish(result)
            except GLib.Error as e:
                self.error = e
            loop.quit()

        def tick():
            self.ticks += 1
            return GLib.SOURCE_CONTINUE

        def start():
            self.started_at = time.perf_counter()
            model.generate_async(input_ids, attention_mask, config, token,
                                 cancellable=cancellable, callback=done, user_data='done-data')
            return GLib.SOURCE_REMOVE

        ticker = GLib.timeout_add(tick_ms, tick) if tick_ms else None
        GLib.idle_add(start)
        self.completed = run_loop(loop)
        if ticker is not None:
            GLib.source_remove(ticker)
        # token callbacks queued after the finish (there should be none)
        ctx = GLib.MainContext.default()
        while ctx.pending():
            ctx.iteration(False)

    def tokens_per_sequence(self):
        """The streamed tokens regrouped per sequence: [B][steps]."""
        if not self.steps:
            return []
        return [[step[i] for step in self.steps] for i in range(len(self.steps[0]))]


class ModelTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.backends = list(Moe.PluginRegistry.get_default().list_backends())

    def assertMoeError(self, cm, code):
        err = cm.exception
        self.assertTrue(err.matches(Moe.error_quark(), code),
                        'expected %s, got %s (%d): %s' % (code, err.domain, err.code, err.message))

    def assertCancelled(self, err):
        self.assertIsNotNone(err, 'the generation was not cancelled')
        self.assertIsInstance(err, GLib.Error)
        self.assertTrue(err.matches(Gio.io_error_quark(), Gio.IOErrorEnum.CANCELLED),
                        'expected G_IO_ERROR_CANCELLED, got %s (%d): %s'
                        % (err.domain, err.code, err.message))

    # --- the fixtures ------------------------------------------------------

    def test_fixtures_present(self):
        present = sorted(d for d in os.listdir(data_dir())
                         if os.path.isfile(os.path.join(data_dir(), d, 'config.json')))
        self.assertEqual(present, sorted(FAMILIES))
        for name in BACKENDS:
            self.assertIn(name, self.backends)
        for family in FAMILIES:
            with self.subTest(family=family):
                self.assertEqual(list(reference(family, 'input_ids').get_shape()), [2, 9])
                self.assertEqual(reference(family, 'input_ids').get_dtype(), Moe.DType.I64)
                self.assertEqual(list(reference(family, 'logits').get_shape()), [2, 9, 320])
                self.assertEqual(list(reference(family, 'generated').get_shape()), [1, 21])
                self.assertEqual(expected(family)[:9], rows(reference(family, 'input_ids'))[0])

    # --- whole models against transformers -----------------------------------

    def test_fp32_logits_every_backend(self):
        for family in FAMILIES:
            ids = reference(family, 'input_ids')
            ref = floats(reference(family, 'logits'))
            for backend in BACKENDS:
                with self.subTest(family=family, backend=backend):
                    model = load(family, backend)
                    self.assertEqual(model.props.dtype, 'float32')
                    self.assertEqual(model.props.device, 'cpu')
                    self.assertEqual(model.get_vocab_size(), 320)
                    self.assertEqual(set(model.get_experts_implementation().values()), {backend})
                    self.assertEqual(model.props.experts_implementation, backend)
                    logits = model.forward(ids)
                    self.assertEqual(logits.get_dtype(), Moe.DType.F32)
                    self.assertEqual(list(logits.get_shape()), [2, 9, 320])
                    self.assertLessEqual(rel_err(floats(logits), ref), F32_TOL)

    def test_fp32_logits_after_switching_backends(self):
        # one model, switched at run time: each forward uses the new backend
        for family in FAMILIES:
            model = load(family, 'grouped_mm')
            ids = reference(family, 'input_ids')
            ref = floats(reference(family, 'logits'))
            for backend in BACKENDS + ('eager',):
                with self.subTest(family=family, backend=backend):
                    model.set_experts_implementation(backend)
                    self.assertEqual(set(model.get_experts_implementation().values()), {backend})
                    self.assertLessEqual(rel_err(floats(model.forward(ids)), ref), F32_TOL)

    def test_logit_comparison_discriminates(self):
        # the tolerance is meaningful: other input ids give other logits
        family = 'mixtral'
        model = load(family)
        ids = rows(reference(family, 'input_ids'))
        swapped = i64_tensor([ids[1], ids[0]])
        self.assertGreater(rel_err(floats(model.forward(swapped)),
                                   floats(reference(family, 'logits'))), 100 * F32_TOL)

    def test_bf16_logits_every_backend(self):
        for family in FAMILIES:
            ids = reference(family, 'input_ids')
            model = load(family, dtype='bfloat16')
            self.assertEqual(model.props.dtype, 'bfloat16')
            for backend in BACKENDS:
                with self.subTest(family=family, backend=backend):
                    model.set_experts_implementation(backend)
                    ref = floats(reference(family, 'logits_bf16_' + backend,
                                           'reference_bf16_backends.safetensors'))
                    self.assertLessEqual(rel_err(floats(model.forward(ids)), ref), BF16_TOL)

    def test_greedy_generation_every_backend(self):
        for family in FAMILIES:
            want = expected(family)
            for backend in BACKENDS:
                with self.subTest(family=family, backend=backend):
                    model = load(family, backend)
                    out = model.generate(prompt(family), greedy(len(want) - 9), None)
                    self.assertEqual(out.get_dtype(), Moe.DType.I64)
                    self.assertEqual(list(out.get_shape()), [1, len(want)])
                    self.assertEqual(rows(out)[0], want)
                    self.assertEqual(model.props.phase, Moe.Phase.IDLE)

    def test_generation_batch_and_i32_prompt(self):
        family = 'qwen3_moe'
        want = expected(family)
        model = load(family)
        p = rows(prompt(family))[0]
        # the same prompt twice: both sequences continue as the fixture does
        out = model.generate(i64_tensor([p, p]), greedy(12), None)
        self.assertEqual(rows(out), [want, want])
        # I32 ids are accepted
        as_i32 = Moe.Tensor.new_from_bytes(Moe.DType.I32, [1, len(p)],
                                           GLib.Bytes(array.array('i', p).tobytes()))
        self.assertEqual(rows(model.generate(as_i32, greedy(12), None))[0], want)
        # an all-ones mask is the same as none
        ones = i64_tensor([[1] * len(p)])
        self.assertEqual(rows(model.generate_with_mask(prompt(family), ones, greedy(12), None))[0], want)
        ids = reference(family, 'input_ids')
        self.assertEqual(rel_err(floats(model.forward_with_mask(ids, i64_tensor([[1] * 9] * 2))),
                                 floats(model.forward(ids))), 0.0)

    # --- backend selection per sub-config -------------------------------------

    def test_qwen3_vl_moe_sub_config_map(self):
        want = reference_json('qwen3_vl_moe')['get_experts_implementation_after_set']
        self.assertEqual(want, VL_MAP)
        # at load time
        model = load('qwen3_vl_moe', 'grouped_mm', VL_MAP)
        self.assertEqual(model.get_experts_implementation(), want)
        self.assertEqual(model.props.experts_implementation, 'grouped_mm')
        self.assertEqual(model.dup_experts_implementation_for('vision_config'), 'eager')
        self.assertEqual(model.dup_experts_implementation_for('text_config'), 'grouped_mm')
        self.assertIsNone(model.dup_experts_implementation_for('audio_config'))
        ref = floats(reference('qwen3_vl_moe', 'logits'))
        self.assertLessEqual(rel_err(floats(model.forward(reference('qwen3_vl_moe', 'input_ids'))), ref),
                             F32_TOL)
        # after loading, as transformers' set_experts_implementation(dict)
        model = load('qwen3_vl_moe', 'batched_mm')
        self.assertEqual(model.get_experts_implementation(),
                         {'': 'batched_mm', 'text_config': 'batched_mm', 'vision_config': 'batched_mm'})
        model.set_experts_implementation_map(VL_MAP)
        self.assertEqual(model.get_experts_implementation(), want)
        # keys the model does not have are ignored
        model.set_experts_implementation_map({'audio_config': 'eager'})
        self.assertEqual(model.get_experts_implementation(), want)
        # the map overrides the single name; keys it leaves out take the name
        model = load('qwen3_vl_moe', 'grouped_mm', {'': 'eager', 'text_config': 'batched_mm'})
        self.assertEqual(model.get_experts_implementation(),
                         {'': 'eager', 'text_config': 'batched_mm', 'vision_config': 'grouped_mm'})
        # the text backbone runs text_config's backend, whichever it is
        for backend in BACKENDS:
            with self.subTest(text_config=backend):
                model.set_experts_implementation_for('text_config', backend)
                self.assertEqual(model.dup_experts_implementation_for('text_config'), backend)
                self.assertLessEqual(rel_err(floats(model.forward(reference('qwen3_vl_moe', 'input_ids'))),
                                             ref), F32_TOL)

    def test_load_options_map_round_trip(self):
        opts = Moe.LoadOptions(dtype='float32', device='cpu', experts_implementation='grouped_mm')
        opts.set_experts_implementation_map({'': 'eager', 'text_config': 'grouped_mm'})
        self.assertEqual(opts.dup_experts_implementation_map(), {'': 'eager', 'text_config': 'grouped_mm'})
        self.assertEqual(opts.props.experts_implementation, 'grouped_mm')
        self.assertEqual(opts.props.decode_switch, Moe.DecodeSwitch.AUTO)
        opts.props.decode_switch = Moe.DecodeSwitch.ALWAYS
        model = Moe.Model.new_from_pretrained(model_dir('mixtral'), opts, None)
        self.assertEqual(model.get_experts_implementation(), {'': 'eager'})
        self.assertEqual(model.props.decode_switch, Moe.DecodeSwitch.ALWAYS)

    def test_unknown_backend(self):
        model = load('qwen3_vl_moe', 'grouped_mm', VL_MAP)
        events = []
        model.connect('experts-implementation-changed', lambda m, k, o, n: events.append((k, o, n)))
        with self.assertRaises(GLib.Error) as cm:
            model.set_experts_implementation('no-such-backend')
        self.assertMoeError(cm, Moe.Error.UNKNOWN_BACKEND)
        message = cm.exception.message
        self.assertIn('no-such-backend', message)
        for name in set(BACKENDS) | set(self.backends):
            self.assertIn(name, message)
        self.assertEqual(model.get_experts_implementation(), VL_MAP)
        # a map is applied all or none
        with self.assertRaises(GLib.Error) as cm:
            model.set_experts_implementation_map({'text_config': 'eager', 'vision_config': 'no-such-backend'})
        self.assertMoeError(cm, Moe.Error.UNKNOWN_BACKEND)
        self.assertIn('no-such-backend', cm.exception.message)
        self.assertEqual(model.get_experts_implementation(), VL_MAP)
        with self.assertRaises(GLib.Error) as cm:
            model.set_experts_implementation_for('text_config', 'no-such-backend')
        self.assertMoeError(cm, Moe.Error.UNKNOWN_BACKEND)
        # one key: a sub-config the model lacks is an error here
        with self.assertRaises(GLib.Error) as cm:
            model.set_experts_implementation_for('audio_config', 'eager')
        self.assertMoeError(cm, Moe.Error.NOT_FOUND)
        self.assertEqual(model.get_experts_implementation(), VL_MAP)
        self.assertEqual(events, [])
        # and at load time
        with self.assertRaises(GLib.Error) as cm:
            load('mixtral', 'no-such-backend')
        self.assertMoeError(cm, Moe.Error.UNKNOWN_BACKEND)
        for name in BACKENDS:
            self.assertIn(name, cm.exception.message)
        with self.assertRaises(GLib.Error) as cm:
            load('qwen3_vl_moe', 'grouped_mm', {'vision_config': 'no-such-backend'})
        self.assertMoeError(cm, Moe.Error.UNKNOWN_BACKEND)

    # --- signals -----------------------------------------------------------

    def test_experts_implementation_changed(self):
        model = load('qwen3_vl_moe', 'grouped_mm')
        every, text, vision, top, notified = [], [], [], [], []
        model.connect('experts-implementation-changed', lambda m, k, o, n: every.append((k, o, n)))
        model.connect('experts-implementation-changed::text_config', lambda m, k, o, n: text.append((k, o, n)))
        model.connect('experts-implementation-changed::vision_config',
                      lambda m, k, o, n: vision.append((k, o, n)))
        # the top-level "" entry has no detail one can connect to by name
        # ("name::" is not a valid signal name): it is watched through
        # notify::experts-implementation, or by filtering on the key
        model.connect('experts-implementation-changed',
                      lambda m, k, o, n: top.append((k, o, n)) if k == '' else None)
        model.connect('notify::experts-implementation',
                      lambda m, pspec: notified.append(m.props.experts_implementation))

        def drain():
            got = (sorted(every), list(text), list(vision), list(top), list(notified))
            for lst in (every, text, vision, top, notified):
                del lst[:]
            return got

        # one key
        model.set_experts_implementation_map({'text_config': 'eager'})
        self.assertEqual(drain(), ([('text_config', 'grouped_mm', 'eager')],
                                   [('text_config', 'grouped_mm', 'eager')], [], [], []))
        # every key, each from where it was
        model.set_experts_implementation('batched_mm')
        self.assertEqual(drain(), ([('', 'grouped_mm', 'batched_mm'),
                                    ('text_config', 'eager', 'batched_mm'),
                                    ('vision_config', 'grouped_mm', 'batched_mm')],
                                   [('text_config', 'eager', 'batched_mm')],
                                   [('vision_config', 'grouped_mm', 'batched_mm')],
                                   [('', 'grouped_mm', 'batched_mm')],
                                   ['batched_mm']))
        # nothing changes, nothing is emitted
        model.set_experts_implementation('batched_mm')
        model.set_experts_implementation_map({'text_config': 'batched_mm', 'audio_config': 'eager'})
        self.assertEqual(drain(), ([], [], [], [], []))
        # only the keys that change
        model.set_experts_implementation_map({'': 'batched_mm', 'text_config': 'grouped_mm',
                                              'vision_config': 'eager'})
        self.assertEqual(drain(), ([('text_config', 'batched_mm', 'grouped_mm'),
                                    ('vision_config', 'batched_mm', 'eager')],
                                   [('text_config', 'batched_mm', 'grouped_mm')],
                                   [('vision_config', 'batched_mm', 'eager')], [], []))
        # the property is the "" entry
        model.props.experts_implementation = 'eager'
        self.assertEqual(drain(), ([('', 'batched_mm', 'eager')], [], [],
                                   [('', 'batched_mm', 'eager')], ['eager']))
        self.assertEqual(model.get_experts_implementation(),
                         {'': 'eager', 'text_config': 'grouped_mm', 'vision_config': 'eager'})
        model.set_experts_implementation_for('text_config', 'eager')
        self.assertEqual(drain(), ([('text_config', 'grouped_mm', 'eager')],
                                   [('text_config', 'grouped_mm', 'eager')], [], [], []))

    def test_phase_changed_during_generate(self):
        model = load('olmoe')
        phases, notified = [], []
        model.connect('phase-changed', lambda m, phase: phases.append((phase, m.props.phase)))
        model.connect('notify::phase', lambda m, pspec: notified.append(m.props.phase))
        self.assertEqual(model.props.phase, Moe.Phase.IDLE)
        out = model.generate(prompt('olmoe'), greedy(12), None)
        self.assertEqual(rows(out)[0], expected('olmoe'))
        P = Moe.Phase
        self.assertEqual(phases, [(P.PREFILL, P.PREFILL), (P.DECODE, P.DECODE), (P.IDLE, P.IDLE)])
        self.assertEqual(notified, [P.PREFILL, P.DECODE, P.IDLE])
        self.assertIsInstance(phases[0][0], Moe.Phase)
        # forward is not a generation
        del phases[:]
        model.forward(reference('olmoe', 'input_ids'))
        self.assertEqual(phases, [])

    # --- the decode switch ----------------------------------------------------

    def watch_generation(self, model, family, n=12):
        """Generates synchronously, recording the map inside each
        phase-changed handler and every experts-implementation-changed."""
        seen, changes = [], []
        h1 = model.connect('phase-changed', lambda m, phase: seen.append(
            (phase, m.get_experts_implementation(), m.props.experts_implementation)))
        h2 = model.connect('experts-implementation-changed',
                           lambda m, k, o, n: changes.append((k, o, n, m.props.phase)))
        out = model.generate(prompt(family), greedy(n), None)
        model.disconnect(h1)
        model.disconnect(h2)
        return rows(out)[0], seen, changes

    def test_decode_switch_always(self):
        P = Moe.Phase
        model = load('qwen3_vl_moe', impl_map=VL_MAP)
        self.assertEqual(model.props.device, 'cpu')
        self.assertEqual(model.props.decode_switch, Moe.DecodeSwitch.AUTO)
        notified = []
        model.connect('notify::decode-switch', lambda m, pspec: notified.append(m.props.decode_switch))
        model.props.decode_switch = Moe.DecodeSwitch.ALWAYS
        self.assertEqual(model.props.decode_switch, Moe.DecodeSwitch.ALWAYS)
        self.assertEqual(model.get_decode_switch(), Moe.DecodeSwitch.ALWAYS)
        self.assertEqual(notified, [Moe.DecodeSwitch.ALWAYS])

        out, seen, changes = self.watch_generation(model, 'qwen3_vl_moe')
        self.assertEqual(out, expected('qwen3_vl_moe'))
        decode_map = {'': 'batched_mm', 'text_config': 'batched_mm', 'vision_config': 'eager'}
        self.assertEqual(seen, [(P.PREFILL, VL_MAP, 'grouped_mm'),
                                (P.DECODE, decode_map, 'batched_mm'),
                                (P.IDLE, VL_MAP, 'grouped_mm')])
        # grouped_mm entries switch when decoding begins (still in the
        # prefill phase) and come back at the end; eager ones stay
        self.assertEqual(sorted(changes[:2]), [('', 'grouped_mm', 'batched_mm', P.PREFILL),
                                               ('text_config', 'grouped_mm', 'batched_mm', P.PREFILL)])
        self.assertEqual(sorted(c[:3] for c in changes[2:]), [('', 'batched_mm', 'grouped_mm'),
                                                              ('text_config', 'batched_mm', 'grouped_mm')])
        self.assertEqual(len(changes), 4)
        self.assertEqual(model.get_experts_implementation(), VL_MAP)

        # a single-config family, and every family's tokens unchanged by the switch
        for family in FAMILIES:
            with self.subTest(family=family):
                m = load(family, 'grouped_mm')
                m.props.decode_switch = Moe.DecodeSwitch.ALWAYS
                out, seen, changes = self.watch_generation(m, family)
                self.assertEqual(out, expected(family))
                during = [s[1] for s in seen if s[0] == P.DECODE]
                self.assertEqual(len(during), 1)
                self.assertEqual(set(during[0].values()), {'batched_mm'})
                self.assertEqual(set(m.get_experts_implementation().values()), {'grouped_mm'})
                self.assertEqual(len(changes), 2 * len(during[0]))

    def test_decode_switch_by_tokens(self):
        # beyond transformers: the fixtures' 9-token prompt has 18 (token,
        # slot) rows for 8 experts (prefill stays grouped_mm), one decode
        # token 2 (batched_mm), on the CPU too
        P = Moe.Phase
        model = load('qwen3_moe', 'grouped_mm')
        model.props.decode_switch = Moe.DecodeSwitch.BY_TOKENS
        out, seen, changes = self.watch_generation(model, 'qwen3_moe')
        self.assertEqual(out, expected('qwen3_moe'))
        self.assertEqual([(s[0], s[2]) for s in seen],
                         [(P.PREFILL, 'grouped_mm'), (P.DECODE, 'batched_mm'), (P.IDLE, 'grouped_mm')])
        self.assertEqual(len(changes), 2)

    def test_decode_switch_only_touches_grouped_mm(self):
        model = load('mixtral', 'eager')
        model.props.decode_switch = Moe.DecodeSwitch.ALWAYS
        out, seen, changes = self.watch_generation(model, 'mixtral')
        self.assertEqual(out, expected('mixtral'))
        self.assertEqual([s[1] for s in seen], [{'': 'eager'}] * 3)
        self.assertEqual(changes, [])

    def test_decode_switch_never_and_auto_on_cpu(self):
        P = Moe.Phase
        for policy in (Moe.DecodeSwitch.NEVER, Moe.DecodeSwitch.AUTO):
            with self.subTest(policy=policy):
                model = load('qwen3_vl_moe', impl_map=VL_MAP)
                model.props.decode_switch = policy
                self.assertEqual(model.props.decode_switch, policy)
                out, seen, changes = self.watch_generation(model, 'qwen3_vl_moe')
                self.assertEqual(out, expected('qwen3_vl_moe'))
                self.assertEqual(seen, [(P.PREFILL, VL_MAP, 'grouped_mm'),
                                        (P.DECODE, VL_MAP, 'grouped_mm'),
                                        (P.IDLE, VL_MAP, 'grouped_mm')])
                self.assertEqual(changes, [])

    # --- generate_async on a GLib.MainLoop ---------------------------------------

    def test_generate_async_streams_tokens(self):
        for family in ('mixtral', 'qwen3_vl_moe'):
            with self.subTest(family=family):
                want = expected(family)
                model = load(family)
                sync = model.generate(prompt(family), greedy(12), None)
                phases = []
                model.connect('phase-changed', lambda m, phase: phases.append(phase))
                run = AsyncRun(model, prompt(family), greedy(12))
                self.assertTrue(run.completed, 'generate_async did not finish in time')
                self.assertIsNone(run.error)
                self.assertEqual(run.user_data, ['done-data'])
                # one callback per step, each with the step's [B] tokens, in order
                self.assertEqual(len(run.steps), 12)
                self.assertEqual(run.shapes, [[1]] * 12)
                self.assertEqual(run.tokens_per_sequence(), [want[9:]])
                # on the main thread, before the finish callback
                self.assertEqual(run.threads, {True})
                self.assertEqual(run.late, 0)
                # the same result as the synchronous call, and as transformers
                self.assertEqual(rows(run.result), rows(sync))
                self.assertEqual(rows(run.result)[0], want)
                self.assertEqual(phases, [Moe.Phase.PREFILL, Moe.Phase.DECODE, Moe.Phase.IDLE])
                self.assertEqual(model.props.phase, Moe.Phase.IDLE)

    def test_generate_async_batch_and_token_data(self):
        family = 'deepseek_v3'
        model = load(family)
        ids = reference(family, 'input_ids')
        sync = rows(model.generate(ids, greedy(16), None))
        run = AsyncRun(model, ids, greedy(16))
        self.assertIsNone(run.error)
        self.assertEqual(run.shapes, [[2]] * 16)
        self.assertEqual(rows(run.result), sync)
        self.assertEqual(run.tokens_per_sequence(), [r[9:] for r in sync])
        self.assertEqual(sync[0][:21], expected(family))
        # token_data reaches the callback (PyGObject takes it as a tuple here)
        got = []
        loop = GLib.MainLoop()

        def start():
            model.generate_async(prompt(family), None, greedy(3),
                                 lambda m, t, data: got.append(data), ('token-data',),
                                 callback=lambda m, r, *d: (got.append(rows(m.generate_finish(r))), loop.quit()))
            return GLib.SOURCE_REMOVE

        GLib.idle_add(start)
        self.assertTrue(run_loop(loop))
        self.assertEqual(got, ['token-data'] * 3 + [[expected(family)[:12]]])

    def test_generate_async_main_loop_keeps_running(self):
        # 8 copies of the prompt and 500 new tokens: long enough for a 2 ms
        # timeout to fire many times while the worker generates
        family = 'mixtral'
        model = load(family)
        p = rows(prompt(family))[0]
        run = AsyncRun(model, i64_tensor([p] * 8), greedy(500), tick_ms=2)
        self.assertTrue(run.completed)
        self.assertIsNone(run.error)
        self.assertEqual(len(run.steps), 500)
        self.assertGreaterEqual(run.ticks_at_finish, 5,
                                'the main loop was blocked during generate_async')
        seqs = run.tokens_per_sequence()
        self.assertEqual(seqs[0][:12], expected(family)[9:])
        self.assertTrue(all(s == seqs[0] for s in seqs))
        self.assertEqual(rows(run.result), [p + seqs[0]] * 8)

    def test_generate_async_cancel_midway(self):
        P = Moe.Phase
        family = 'mixtral'
        model = load(family, 'grouped_mm')
        model.props.decode_switch = Moe.DecodeSwitch.ALWAYS
        p = rows(prompt(family))[0]
        cancellable = Gio.Cancellable()
        phases, changes = [], []
        model.connect('phase-changed', lambda m, phase: phases.append(phase))
        model.connect('experts-implementation-changed', lambda m, k, o, n: changes.append((k, o, n)))

        def on_token(n):
            if n == 3:
                cancellable.cancel()

        # 8 sequences of 500 tokens take about a second: the cancel comes mid-way
        run = AsyncRun(model, i64_tensor([p] * 8), greedy(500), cancellable=cancellable, on_token=on_token)
        self.assertTrue(run.completed)
        self.assertIsNone(run.result)
        self.assertCancelled(run.error)
        self.assertGreaterEqual(len(run.steps), 3)
        self.assertLess(len(run.steps), 500, 'the generation ran to the end: not cancelled mid-way')
        self.assertEqual(run.tokens_per_sequence()[0][:3], expected(family)[9:12])
        # the map is restored and the model idle
        self.assertEqual(model.get_experts_implementation(), {'': 'grouped_mm'})
        self.assertEqual(changes, [('', 'grouped_mm', 'batched_mm'), ('', 'batched_mm', 'grouped_mm')])
        self.assertEqual(phases, [P.PREFILL, P.DECODE, P.IDLE])
        self.assertEqual(model.props.phase, P.IDLE)
        # and the model is usable, synchronously and asynchronously
        self.assertEqual(rows(model.generate(prompt(family), greedy(12), None))[0], expected(family))
        self.assertLessEqual(rel_err(floats(model.forward(reference(family, 'input_ids'))),
                                     floats(reference(family, 'logits'))), F32_TOL)
        again = AsyncRun(model, prompt(family), greedy(12))
        self.assertIsNone(again.error)
        self.assertEqual(rows(again.result)[0], expected(family))
        self.assertEqual(model.get_experts_implementation(), {'': 'grouped_mm'})

    def test_generate_cancelled_before_start(self):
        family = 'qwen2_moe'
        model = load(family)
        cancellable = Gio.Cancellable()
        cancellable.cancel()
        run = AsyncRun(model, prompt(family), greedy(12), cancellable=cancellable)
        self.assertCancelled(run.error)
        self.assertEqual(run.steps, [])
        with self.assertRaises(GLib.Error) as cm:
            model.generate(prompt(family), greedy(12), cancellable)
        self.assertCancelled(cm.exception)
        self.assertEqual(model.props.phase, Moe.Phase.IDLE)
        self.assertEqual(rows(model.generate(prompt(family), greedy(12), None))[0], expected(family))

    def test_generate_async_error(self):
        model = load('qwen3_moe')
        bad = Moe.Tensor.new_zeros(Moe.DType.F32, [1, 4])
        run = AsyncRun(model, bad, greedy(4))
        self.assertTrue(run.completed)
        self.assertIsNotNone(run.error)
        self.assertTrue(run.error.matches(Moe.error_quark(), Moe.Error.DTYPE_MISMATCH), run.error.message)
        self.assertEqual(run.steps, [])

    def test_async_callbacks_never_run_on_the_worker(self):
        # g_main_context_invoke() would run a callback at once on the worker
        # whenever the caller is not iterating its context (here: busy before
        # loop.run()); libmoe always queues them on the caller's context.
        family = 'mixtral'
        model = load(family)
        main = threading.get_ident()
        threads = []
        model.connect('phase-changed', lambda m, phase: threads.append(threading.get_ident() == main))
        loop = GLib.MainLoop()
        model.generate_async(prompt(family), None, greedy(4),
                             lambda m, t, *d: threads.append(threading.get_ident() == main),
                             callback=lambda m, r, *d: loop.quit())
        time.sleep(0.5)   # the main thread is busy; the worker finishes meanwhile
        self.assertTrue(run_loop(loop))
        self.assertEqual(len(threads), 3 + 4)
        self.assertEqual(set(threads), {True})

    def test_token_data_released_on_the_callers_thread(self):
        # The worker usually drops the task's last reference; the token
        # callback's data (a JS closure in GJS, which must not be freed off
        # its thread) is still released on the caller's thread.
        family = 'mixtral'
        model = load(family)
        main = threading.get_ident()
        released = []

        class Tracker:
            def __del__(self):
                released.append(threading.get_ident() == main)

        loop = GLib.MainLoop()
        for _ in range(20):
            def start():
                model.generate_async(prompt(family), None, greedy(2), lambda m, t, d: None, (Tracker(),),
                                     callback=lambda m, r, *d: (m.generate_finish(r), loop.quit()))
                return GLib.SOURCE_REMOVE
            GLib.idle_add(start)
            self.assertTrue(run_loop(loop))
        # the data is released by an idle on this thread's context
        deadline = time.time() + 10
        while len(released) < 20 and time.time() < deadline:
            GLib.MainContext.default().iteration(False)
            time.sleep(0.005)
        self.assertEqual(len(released), 20)
        self.assertEqual(set(released), {True})

    # --- loading -----------------------------------------------------------

    def test_new_from_pretrained_async(self):
        loop = GLib.MainLoop()
        out = {}
        main = threading.get_ident()
        opts = Moe.LoadOptions(dtype='float32', experts_implementation='batched_mm')

        def done(source, result, *data):
            out['thread'] = threading.get_ident() == main
            try:
                out['model'] = Moe.Model.new_from_pretrained_finish(result)
            except GLib.Error as e:
                out['error'] = e
            loop.quit()

        def start(path):
            Moe.Model.new_from_pretrained_async(path, opts, None, done)
            return GLib.SOURCE_REMOVE

        GLib.idle_add(start, model_dir('gpt_oss'))
        self.assertTrue(run_loop(loop))
        self.assertNotIn('error', out)
        self.assertTrue(out['thread'])
        model = out['model']
        self.assertEqual(model.get_experts_implementation(), {'': 'batched_mm'})
        self.assertLessEqual(rel_err(floats(model.forward(reference('gpt_oss', 'input_ids'))),
                                     floats(reference('gpt_oss', 'logits'))), F32_TOL)
        # its signals come on the caller's thread, during the call
        events = []
        model.connect('experts-implementation-changed', lambda m, k, o, n: events.append(
            (k, o, n, threading.get_ident() == main)))
        model.set_experts_implementation('eager')
        self.assertEqual(events, [('', 'batched_mm', 'eager', True)])
        self.assertEqual(rows(model.generate(prompt('gpt_oss'), greedy(12), None))[0], expected('gpt_oss'))

        # a missing directory is an error through the finish function
        out.clear()
        GLib.idle_add(start, os.path.join(data_dir(), 'no-such-model'))
        self.assertTrue(run_loop(loop))
        self.assertNotIn('model', out)
        self.assertTrue(out['error'].matches(Moe.error_quark(), Moe.Error.NOT_FOUND), out['error'].message)


if __name__ == '__main__':
    unittest.main(verbosity=2)
