#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
#
# Moe.Experts through PyGObject: every fixture in tests/data/experts (written
# by Hugging Face transformers, whose float64 output is the oracle) run
# through every experts backend the registry finds, plus the errors a caller
# gets for bad inputs.
#
# Runs from the build tree (meson sets GI_TYPELIB_PATH, MOE_PLUGIN_PATH,
# MOE_TEST_DATA); exits non-zero on any failure.

import array
import glob
import math
import os
import struct
import unittest

import gi

gi.require_version('Moe', '1')
from gi.repository import GLib, Moe  # noqa: E402

BACKENDS = ('batched_mm', 'eager', 'grouped_mm')
F32_TOL = 1e-5
BF16_TOL = 2e-2


def data_dir():
    d = os.environ.get('MOE_TEST_DATA')
    if not d:
        d = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data')
    return os.path.join(d, 'experts')


FIXTURES = sorted(glob.glob(os.path.join(data_dir(), '*.safetensors')))


def values(tensor):
    """The tensor's elements as Python floats (F64 read exactly, the rest via F32)."""
    if tensor.get_dtype() == Moe.DType.F64:
        return array.array('d', tensor.dup_bytes().get_data())
    return array.array('f', tensor.to_f32_bytes().get_data())


def rel_err(got, ref):
    """||got - ref|| / ||ref||."""
    assert len(got) == len(ref), (len(got), len(ref))
    num = math.fsum((g - r) ** 2 for g, r in zip(got, ref))
    den = math.fsum(r * r for r in ref)
    assert den > 0, 'reference output is all zeros'
    return math.sqrt(num / den)


def flag(md, key):
    value = md.get(key, 'false')
    assert value in ('true', 'false'), (key, value)
    return value == 'true'


def make_experts(ck, backend, dtype=Moe.DType.F32):
    """Builds Moe.Experts as the fixture's metadata describes them."""
    md = ck.get_metadata()

    def load(name):
        t = ck.get_tensor(name)
        return t.to_dtype(dtype) if dtype != t.get_dtype() else t

    ex = Moe.Experts.new(load('up_weight'), load('down_weight'))
    ex.props.activation = md['act'].strip('"')
    ex.props.has_gate = flag(md, 'has_gate')
    ex.props.is_transposed = flag(md, 'is_transposed')
    if flag(md, 'interleaved_clamped_swiglu'):
        ex.props.gate_layout = Moe.GateLayout.INTERLEAVED
    # Biases go through the setters: assigning a temporary to ex.props.*
    # makes PyGObject warn and add a reference that is never dropped.
    if ck.has_tensor('up_bias'):
        ex.set_up_bias(load('up_bias'))
    if ck.has_tensor('down_bias'):
        ex.set_down_bias(load('down_bias'))
    ex.props.implementation = backend
    return ex


def inputs(ck):
    return (ck.get_tensor('hidden_states'),
            ck.get_tensor('top_k_index'),
            ck.get_tensor('top_k_weights'))


def i64_tensor(shape, ids):
    return Moe.Tensor.new_from_bytes(Moe.DType.I64, shape,
                                     GLib.Bytes(struct.pack('<%dq' % len(ids), *ids)))


class ExpertsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.registry = Moe.PluginRegistry.get_default()
        # the backends that run on the CPU (deepgemm, sonicmoe… need a GPU)
        cls.backends = list(cls.registry.list_backends_for_device('cpu'))

    def assertMoeError(self, cm, code):
        err = cm.exception
        self.assertTrue(err.matches(Moe.error_quark(), code),
                        'expected %s, got %s (%d): %s'
                        % (code, err.domain, err.code, err.message))

    def test_registry_lists_the_three_backends(self):
        for name in BACKENDS:
            self.assertIn(name, self.backends)

    def test_fixtures_present(self):
        self.assertGreater(len(FIXTURES), 0, 'no fixtures in ' + data_dir())
        for path in FIXTURES:
            md = Moe.Checkpoint.open(path).get_metadata()
            for key in ('act', 'has_gate', 'is_transposed', 'T', 'E', 'K', 'H', 'I'):
                self.assertIn(key, md, path)

    def test_f32_matches_reference(self):
        for path in FIXTURES:
            ck = Moe.Checkpoint.open(path)
            md = ck.get_metadata()
            ref = values(ck.get_tensor('output_f64'))
            T, H = int(md['T']), int(md['H'])
            for backend in self.backends:
                with self.subTest(fixture=os.path.basename(path), backend=backend):
                    ex = make_experts(ck, backend)
                    self.assertEqual(ex.props.num_experts, int(md['E']))
                    self.assertEqual(ex.props.hidden_size, H)
                    self.assertEqual(ex.props.intermediate_size, int(md['I']))
                    ex.validate()
                    out = ex.forward(*inputs(ck))
                    self.assertEqual(out.get_dtype(), Moe.DType.F32)
                    self.assertEqual(list(out.get_shape()), [T, H])
                    err = rel_err(values(out), ref)
                    self.assertLessEqual(err, F32_TOL)

    def test_f32_matches_transformers_outputs(self):
        # transformers' own f32 batched_mm/grouped_mm results, for good measure
        for path in FIXTURES:
            ck = Moe.Checkpoint.open(path)
            out = values(make_experts(ck, 'grouped_mm').forward(*inputs(ck)))
            for name in ('output_batched_mm', 'output_grouped_mm'):
                if ck.has_tensor(name):
                    with self.subTest(fixture=os.path.basename(path), output=name):
                        self.assertLessEqual(rel_err(out, values(ck.get_tensor(name))), F32_TOL)

    def test_bf16_matches_reference(self):
        for path in FIXTURES:
            ck = Moe.Checkpoint.open(path)
            ref = values(ck.get_tensor('output_f64'))
            hidden, index, weights = inputs(ck)
            hidden = hidden.to_dtype(Moe.DType.BF16)
            self.assertEqual(hidden.get_dtype(), Moe.DType.BF16)
            for backend in self.backends:
                with self.subTest(fixture=os.path.basename(path), backend=backend):
                    ex = make_experts(ck, backend, Moe.DType.BF16)
                    self.assertEqual(ex.get_up_weight().get_dtype(), Moe.DType.BF16)
                    out = ex.forward(hidden, index, weights)
                    self.assertEqual(out.get_dtype(), Moe.DType.BF16)
                    self.assertEqual(list(out.get_shape()), list(hidden.get_shape()))
                    self.assertLessEqual(rel_err(values(out), ref), BF16_TOL)

    def test_backends_agree(self):
        for path in FIXTURES:
            ck = Moe.Checkpoint.open(path)
            outs = {b: values(make_experts(ck, b).forward(*inputs(ck))) for b in self.backends}
            first = self.backends[0]
            for other in self.backends[1:]:
                with self.subTest(fixture=os.path.basename(path), a=first, b=other):
                    self.assertLessEqual(rel_err(outs[other], outs[first]), F32_TOL)

    def test_sentinel_slot_contributes_nothing(self):
        # id E marks a slot this rank does not own: its weight must not matter
        path = os.path.join(data_dir(), 'silu_concat.safetensors')
        ck = Moe.Checkpoint.open(path)
        md = ck.get_metadata()
        T, K, E = int(md['T']), int(md['K']), int(md['E'])
        hidden, index, weights = inputs(ck)
        ids = list(struct.unpack('<%dq' % (T * K), index.dup_bytes().get_data()))
        w = array.array('f', weights.to_f32_bytes().get_data())
        # keep only slot 0 of each token, as the reference computed with slot 1 zeroed
        w_zeroed = array.array('f', w)
        ids_sentinel = list(ids)
        for t in range(T):
            for k in range(1, K):
                w_zeroed[t * K + k] = 0.0
                ids_sentinel[t * K + k] = E
        w_zeroed_t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, K], GLib.Bytes(w_zeroed.tobytes()))
        w_t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, K], GLib.Bytes(w.tobytes()))
        for backend in self.backends:
            with self.subTest(backend=backend):
                ex = make_experts(ck, backend)
                want = values(ex.forward(hidden, index, w_zeroed_t))
                got = values(ex.forward(hidden, i64_tensor([T, K], ids_sentinel), w_t))
                self.assertLessEqual(rel_err(got, want), F32_TOL)

    def test_unknown_backend(self):
        ck = Moe.Checkpoint.open(FIXTURES[0])
        ex = make_experts(ck, 'no-such-backend')
        self.assertEqual(ex.props.implementation, 'no-such-backend')
        with self.assertRaises(GLib.Error) as cm:
            ex.forward(*inputs(ck))
        self.assertMoeError(cm, Moe.Error.UNKNOWN_BACKEND)
        self.assertIn('no-such-backend', cm.exception.message)
        for name in self.backends:
            self.assertIn(name, cm.exception.message)

    def test_to_device(self):
        # experts.to_device() as torch's module.to(): a copy, properties kept
        ck = Moe.Checkpoint.open(FIXTURES[0])
        ex = make_experts(ck, 'batched_mm')
        copy = ex.to_device('cpu')
        self.assertEqual(copy.props.device, 'cpu')
        self.assertEqual(copy.props.implementation, 'batched_mm')
        self.assertEqual(copy.props.activation, ex.props.activation)
        self.assertLessEqual(rel_err(values(copy.forward(*inputs(ck))), values(ex.forward(*inputs(ck)))), 0.0)
        with self.assertRaises(GLib.Error) as cm:
            ex.to_device('no-such-device')
        self.assertIn('no-such-device', cm.exception.message)

    def test_gpu_only_backends_on_the_cpu(self):
        ck = Moe.Checkpoint.open(FIXTURES[0])
        for name, needs in (('deepgemm', 'compute capability 9.0 (Hopper) or 10.x (Blackwell)'),
                            ('sonicmoe', 'compute capability 9.0 or newer')):
            with self.subTest(backend=name):
                self.assertIn(name, self.registry.list_backends())
                self.assertNotIn(name, self.backends)
                with self.assertRaises(GLib.Error) as cm:
                    make_experts(ck, name).forward(*inputs(ck))
                self.assertMoeError(cm, Moe.Error.NOT_SUPPORTED)
                self.assertIn(needs, cm.exception.message)
                self.assertIn('these experts are on cpu', cm.exception.message)

    def test_wrong_hidden_shape(self):
        ck = Moe.Checkpoint.open(FIXTURES[0])
        md = ck.get_metadata()
        T, H = int(md['T']), int(md['H'])
        _, index, weights = inputs(ck)
        for backend in self.backends:
            ex = make_experts(ck, backend)
            for shape in ([T, H + 1], [T * H], [1, T, H]):
                with self.subTest(backend=backend, shape=shape):
                    bad = Moe.Tensor.new_zeros(Moe.DType.F32, shape)
                    with self.assertRaises(GLib.Error) as cm:
                        ex.forward(bad, index, weights)
                    self.assertMoeError(cm, Moe.Error.SHAPE_MISMATCH)

    def test_bad_expert_ids(self):
        ck = Moe.Checkpoint.open(FIXTURES[0])
        md = ck.get_metadata()
        T, K, E = int(md['T']), int(md['K']), int(md['E'])
        hidden, index, weights = inputs(ck)
        ids = list(struct.unpack('<%dq' % (T * K), index.dup_bytes().get_data()))
        for backend in self.backends:
            ex = make_experts(ck, backend)
            for bad_id in (-1, E + 1):
                with self.subTest(backend=backend, bad_id=bad_id):
                    bad = list(ids)
                    bad[len(bad) // 2] = bad_id
                    with self.assertRaises(GLib.Error) as cm:
                        ex.forward(hidden, i64_tensor([T, K], bad), weights)
                    self.assertMoeError(cm, Moe.Error.INVALID_ARGUMENT)

    def test_index_dtype(self):
        ck = Moe.Checkpoint.open(FIXTURES[0])
        md = ck.get_metadata()
        T, K = int(md['T']), int(md['K'])
        hidden, index, weights = inputs(ck)
        ids = struct.unpack('<%dq' % (T * K), index.dup_bytes().get_data())
        as_f32 = Moe.Tensor.new_from_bytes(Moe.DType.F32, [T, K],
                                           GLib.Bytes(array.array('f', ids).tobytes()))
        as_i32 = Moe.Tensor.new_from_bytes(Moe.DType.I32, [T, K],
                                           GLib.Bytes(array.array('i', ids).tobytes()))
        for backend in self.backends:
            with self.subTest(backend=backend):
                ex = make_experts(ck, backend)
                with self.assertRaises(GLib.Error) as cm:
                    ex.forward(hidden, as_f32, weights)
                self.assertMoeError(cm, Moe.Error.DTYPE_MISMATCH)
                # I32 ids are accepted and give the same result as I64
                want = values(ex.forward(hidden, index, weights))
                self.assertLessEqual(rel_err(values(ex.forward(hidden, as_i32, weights)), want), 0.0)

    def test_weights_shape_mismatch(self):
        ck = Moe.Checkpoint.open(FIXTURES[0])
        ex = make_experts(ck, 'eager')
        ex.props.has_gate = not ex.props.has_gate
        with self.assertRaises(GLib.Error) as cm:
            ex.validate()
        self.assertMoeError(cm, Moe.Error.SHAPE_MISMATCH)
        with self.assertRaises(GLib.Error) as cm:
            ex.forward(*inputs(ck))
        self.assertMoeError(cm, Moe.Error.SHAPE_MISMATCH)

    def test_unknown_activation(self):
        ck = Moe.Checkpoint.open(FIXTURES[0])
        ex = make_experts(ck, 'eager')
        ex.props.activation = 'no-such-activation'
        with self.assertRaises(GLib.Error) as cm:
            ex.forward(*inputs(ck))
        self.assertMoeError(cm, Moe.Error.INVALID_ARGUMENT)


QUANT = sorted(glob.glob(os.path.join(os.path.dirname(data_dir()), 'quant', 'experts', '*.safetensors')))


class QuantizedExpertsTest(unittest.TestCase):
    """FP8 and FP4 experts by the introspected names scripts use."""

    def test_fixtures_present(self):
        self.assertEqual(len(QUANT), 6)

    def test_quantized_experts_match_the_dynamic_reference(self):
        for path in QUANT:
            ck = Moe.Checkpoint.open(path)
            up, down = ck.get_tensor('up_weight'), ck.get_tensor('down_weight')
            fp4 = 'fp4' in os.path.basename(path)
            self.assertEqual(up.get_dtype(), Moe.DType.I8 if fp4 else Moe.DType.F8E4M3)
            ex = Moe.Experts.new(up, down)
            ex.set_up_weight_scale(ck.get_tensor('up_weight_scale_inv'))
            ex.set_down_weight_scale(ck.get_tensor('down_weight_scale_inv'))
            self.assertIn(ex.props.up_weight_scale.get_dtype(), (Moe.DType.F32, Moe.DType.E8M0))
            self.assertEqual(ex.props.expert_dtype, 'fp4' if fp4 else 'fp8')
            ref = values(ck.get_tensor('output_ref_dyn'))
            for backend in BACKENDS:
                ex.props.implementation = backend
                err = rel_err(values(ex.forward(*inputs(ck))), ref)
                self.assertLessEqual(err, 1e-2, '%s %s' % (os.path.basename(path), backend))

    def test_missing_scales(self):
        ck = Moe.Checkpoint.open(QUANT[0])
        ex = Moe.Experts.new(ck.get_tensor('up_weight'), ck.get_tensor('down_weight'))
        with self.assertRaises(GLib.Error) as cm:
            ex.forward(*inputs(ck))
        self.assertTrue(cm.exception.matches(Moe.error_quark(), Moe.Error.INVALID_ARGUMENT))
        self.assertIn('scale', cm.exception.message)

    def test_quantize_by_introspection(self):
        # a float weight quantized to FP4 and FP8 through the introspected API
        w = Moe.Tensor.new_from_bytes(Moe.DType.F32, [64, 64],
                                      GLib.Bytes(array.array('f', [((i * 37) % 101 - 50) / 100.0
                                                                   for i in range(64 * 64)]).tobytes()))
        q, scale = w.quantize(Moe.QuantFormat.FP4)
        self.assertEqual((q.get_dtype(), q.get_shape()), (Moe.DType.I8, [64, 32]))
        self.assertEqual((scale.get_dtype(), scale.get_shape()), (Moe.DType.E8M0, [64, 2]))
        q, scale = w.quantize(Moe.QuantFormat.FP8)
        self.assertEqual((q.get_dtype(), scale.get_dtype(), scale.get_shape()),
                         (Moe.DType.F8E4M3, Moe.DType.F32, [1, 1]))
        opts = Moe.LoadOptions()
        self.assertFalse(opts.props.dequantize)
        opts.props.dequantize = True
        self.assertTrue(opts.get_dequantize())

    def test_plain_experts_dtype(self):
        ck = Moe.Checkpoint.open(FIXTURES[0])
        self.assertEqual(make_experts(ck, 'eager').props.expert_dtype, 'f32')
        self.assertEqual(make_experts(ck, 'eager', Moe.DType.BF16).props.expert_dtype, 'bf16')


if __name__ == '__main__':
    unittest.main(verbosity=2)
