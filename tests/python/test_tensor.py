#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
#
# Moe.Tensor, Moe.Checkpoint and Moe.PluginRegistry through PyGObject:
# building tensors from bytes, reading them back, dtype conversion, and the
# errors for bad shapes, sizes and names.

import array
import gc
import os
import struct
import unittest

import gi

gi.require_version('Moe', '1')
from gi.repository import GLib, Moe  # noqa: E402


def fixture(name):
    d = os.environ.get('MOE_TEST_DATA')
    if not d:
        d = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'data')
    return os.path.join(d, 'experts', name)


class TensorTest(unittest.TestCase):

    def assertMoeError(self, cm, code):
        err = cm.exception
        self.assertTrue(err.matches(Moe.error_quark(), code),
                        'expected %s, got %s (%d): %s'
                        % (code, err.domain, err.code, err.message))

    def test_new_from_bytes_round_trip(self):
        vals = [0.5, -1.25, 3.0, 1e-3, -7.75, 42.0]
        data = array.array('f', vals).tobytes()
        t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [2, 3], GLib.Bytes(data))
        self.assertEqual(t.get_dtype(), Moe.DType.F32)
        self.assertEqual(list(t.get_shape()), [2, 3])
        self.assertEqual(t.get_n_dims(), 2)
        self.assertEqual(t.get_dim(0), 2)
        self.assertEqual(t.get_dim(1), 3)
        self.assertEqual(t.get_n_elements(), 6)
        self.assertEqual(t.get_n_bytes(), 24)
        self.assertTrue(t.has_shape([2, 3]))
        self.assertFalse(t.has_shape([3, 2]))
        self.assertEqual(t.to_f32_bytes().get_data(), data)
        self.assertEqual(t.dup_bytes().get_data(), data)
        self.assertEqual(list(array.array('f', t.to_f32_bytes().get_data())),
                         list(array.array('f', data)))

    def test_tensor_keeps_its_bytes_alive(self):
        data = array.array('f', range(12)).tobytes()
        t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [3, 4], GLib.Bytes(data))
        gc.collect()
        self.assertEqual(t.to_f32_bytes().get_data(), data)

    def test_scalar_and_empty(self):
        t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [], GLib.Bytes(struct.pack('<f', 2.5)))
        self.assertEqual(list(t.get_shape()), [])
        self.assertEqual(t.get_n_elements(), 1)
        self.assertEqual(struct.unpack('<f', t.to_f32_bytes().get_data()), (2.5,))
        e = Moe.Tensor.new_from_bytes(Moe.DType.F32, [0, 4], GLib.Bytes(b''))
        self.assertEqual(e.get_n_elements(), 0)
        self.assertEqual(list(e.get_shape()), [0, 4])

    def test_int_tensor(self):
        ids = [0, 7, -1, 2**40]
        t = Moe.Tensor.new_from_bytes(Moe.DType.I64, [4], GLib.Bytes(struct.pack('<4q', *ids)))
        self.assertEqual(t.get_dtype(), Moe.DType.I64)
        self.assertEqual(t.get_n_bytes(), 32)
        self.assertEqual(list(struct.unpack('<4q', t.dup_bytes().get_data())), ids)
        # integer tensors do not convert to floats
        with self.assertRaises(GLib.Error) as cm:
            t.to_f32_bytes()
        self.assertMoeError(cm, Moe.Error.DTYPE_MISMATCH)

    def test_zeros(self):
        t = Moe.Tensor.new_zeros(Moe.DType.BF16, [4, 5])
        self.assertEqual(t.get_dtype(), Moe.DType.BF16)
        self.assertEqual(t.get_n_bytes(), 40)
        self.assertEqual(list(array.array('f', t.to_f32_bytes().get_data())), [0.0] * 20)

    def test_to_dtype(self):
        # exactly representable in bf16 and f16, so the round trip is exact
        vals = [1.5, -2.0, 0.25, 96.0, -0.375, 0.0]
        t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [6], GLib.Bytes(array.array('f', vals).tobytes()))
        for dtype, size in ((Moe.DType.BF16, 2), (Moe.DType.F16, 2), (Moe.DType.F64, 8)):
            with self.subTest(dtype=dtype):
                c = t.to_dtype(dtype)
                self.assertEqual(c.get_dtype(), dtype)
                self.assertEqual(list(c.get_shape()), [6])
                self.assertEqual(c.get_n_bytes(), 6 * size)
                self.assertEqual(Moe.dtype_get_size(dtype), size)
                self.assertEqual(list(array.array('f', c.to_f32_bytes().get_data())), vals)
        # bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1
        r = Moe.Tensor.new_from_bytes(Moe.DType.F32, [1], GLib.Bytes(struct.pack('<f', 1.0 + 2 ** -9)))
        self.assertEqual(struct.unpack('<f', r.to_dtype(Moe.DType.BF16).to_f32_bytes().get_data()), (1.0,))

    def test_size_mismatch(self):
        for n in (20, 28, 0):
            with self.subTest(n_bytes=n):
                with self.assertRaises(GLib.Error) as cm:
                    Moe.Tensor.new_from_bytes(Moe.DType.F32, [2, 3], GLib.Bytes(b'\0' * n))
                self.assertMoeError(cm, Moe.Error.SHAPE_MISMATCH)
                self.assertIn('24', cm.exception.message)

    def test_negative_dim(self):
        with self.assertRaises(GLib.Error) as cm:
            Moe.Tensor.new_zeros(Moe.DType.F32, [2, -3])
        self.assertMoeError(cm, Moe.Error.SHAPE_MISMATCH)

    def test_reshape(self):
        data = array.array('f', range(6)).tobytes()
        t = Moe.Tensor.new_from_bytes(Moe.DType.F32, [2, 3], GLib.Bytes(data))
        r = t.reshape([3, 2])
        self.assertEqual(list(r.get_shape()), [3, 2])
        self.assertEqual(r.to_f32_bytes().get_data(), data)
        with self.assertRaises(GLib.Error) as cm:
            t.reshape([4, 2])
        self.assertMoeError(cm, Moe.Error.SHAPE_MISMATCH)

    def test_dtype_names(self):
        self.assertEqual(Moe.dtype_get_name(Moe.DType.BF16).lower(), 'bf16')
        self.assertTrue(Moe.dtype_is_float(Moe.DType.F32))
        self.assertFalse(Moe.dtype_is_float(Moe.DType.I64))


class CheckpointTest(unittest.TestCase):

    def assertMoeError(self, cm, code):
        err = cm.exception
        self.assertTrue(err.matches(Moe.error_quark(), code),
                        'expected %s, got %s (%d): %s'
                        % (code, err.domain, err.code, err.message))

    def test_open_and_read(self):
        path = fixture('silu_concat.safetensors')
        ck = Moe.Checkpoint.open(path)
        self.assertEqual(ck.get_path(), path)
        names = list(ck.list_tensors())
        for name in ('hidden_states', 'top_k_index', 'top_k_weights',
                     'up_weight', 'down_weight', 'output_f64'):
            self.assertIn(name, names)
            self.assertTrue(ck.has_tensor(name))
        self.assertFalse(ck.has_tensor('nope'))
        md = ck.get_metadata()
        self.assertEqual(ck.get_metadata_value('act'), md['act'])
        self.assertIsNone(ck.get_metadata_value('no-such-key'))
        T, H = int(md['T']), int(md['H'])
        ok, dtype, shape = ck.get_tensor_info('hidden_states')
        self.assertTrue(ok)
        self.assertEqual(dtype, Moe.DType.F32)
        self.assertEqual(list(shape), [T, H])
        t = ck.get_tensor('hidden_states')
        self.assertEqual(list(t.get_shape()), [T, H])
        self.assertEqual(ck.get_tensor('top_k_index').get_dtype(), Moe.DType.I64)
        self.assertEqual(ck.get_tensor('output_f64').get_dtype(), Moe.DType.F64)

    def test_tensor_outlives_checkpoint(self):
        ck = Moe.Checkpoint.open(fixture('silu_concat.safetensors'))
        want = ck.get_tensor('hidden_states').to_f32_bytes().get_data()
        t = ck.get_tensor('hidden_states')
        del ck
        gc.collect()
        self.assertEqual(t.to_f32_bytes().get_data(), want)

    def test_missing(self):
        with self.assertRaises(GLib.Error) as cm:
            Moe.Checkpoint.open(fixture('no-such-file.safetensors'))
        self.assertMoeError(cm, Moe.Error.NOT_FOUND)
        ck = Moe.Checkpoint.open(fixture('silu_concat.safetensors'))
        with self.assertRaises(GLib.Error) as cm:
            ck.get_tensor('no-such-tensor')
        self.assertMoeError(cm, Moe.Error.NOT_FOUND)


class RegistryTest(unittest.TestCase):

    def test_backends(self):
        reg = Moe.PluginRegistry.get_default()
        self.assertIs(reg, Moe.PluginRegistry.get_default())
        names = list(reg.list_backends())
        self.assertEqual(names, sorted(names))
        for name in ('batched_mm', 'eager', 'grouped_mm'):
            self.assertIn(name, names)
            self.assertIsNotNone(reg.get_backend(name))
        with self.assertRaises(GLib.Error) as cm:
            reg.get_backend('no-such-backend')
        self.assertTrue(cm.exception.matches(Moe.error_quark(), Moe.Error.UNKNOWN_BACKEND))
        for name in names:
            self.assertIn(name, cm.exception.message)


if __name__ == '__main__':
    unittest.main(verbosity=2)
